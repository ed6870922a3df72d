"""The rollout service's wire format and shared secret, used by the server (server.py), its
clients (client.py) and the weight directory channel (weights_dir.py).

Every message is an uncompressed .npz archive (a JSON header `__meta__` plus plain numpy
arrays). `unpack` never unpickles: it refuses object arrays, compressed members and
anything else, and a failure is `BadRequest` (answered INVALID_ARGUMENT) naming the fault.
Weights travel leaf by leaf in chunks of at most CHUNK_BYTES, so no message approaches the
message-size limit whatever the model's size.

Weights on the wire: `cast_for_push` gives the trainer's params in `rollout.push_dtype` (cast on
the devices that hold them, before any byte leaves the trainer), with the exceptions of
`keeps_float32`; the receiver casts them to its own avals (server.py `_set_weights`).

Routing (MoE routing replay, rl.routing_replay="r3"): a finished group may carry `routing_<id>`,
each token's experts per layer ([G, len(prompt) + T, n_layers, k], generator.GroupResult.routing),
sent in the smallest unsigned integer type that holds the expert ids. The receiver checks it with
`check_routing` (`BadRouting` names the array: a wrong shape or dtype, an id outside [0,
num_experts)) before any of it reaches the trainer.

Authentication: every RPC carries the shared secret in the `TOKEN_METADATA` gRPC metadata
entry; `load_token` reads it from the environment (RL_SCALING_ROLLOUT_TOKEN) or a file.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import zipfile

import jax
import numpy as np

SERVICE = "rl_scaling.Rollout"
CHUNK_BYTES = 64 << 20
MAX_MESSAGE = CHUNK_BYTES + (1 << 20)  # one weight chunk and its header; a Fetch reply is much smaller
RESULT_FIELDS = ("prompt", "tokens", "logprobs", "versions", "lengths", "stopped", "forced")  # GroupResult order
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
TOKEN_ENV = "RL_SCALING_ROLLOUT_TOKEN"
TOKEN_METADATA = "x-rl-scaling-token"


class BadRequest(ValueError):
    """A malformed request: answered INVALID_ARGUMENT with this message."""


class BadRouting(BadRequest):
    """A group's recorded routing (`routing_<id>`) that is not each token's experts per layer."""


def routing_wire_dtype(num_experts: int):
    """The smallest unsigned integer type that holds expert ids 0..num_experts-1."""
    return next(t for t in (np.uint8, np.uint16, np.uint32) if num_experts - 1 <= np.iinfo(t).max)


def check_routing(a, *, samples: int, length: int, n_layers: int, k: int, num_experts: int,
                  name: str = "routing") -> np.ndarray:
    """`a` as int32 [samples, length, n_layers, k] expert ids in [0, num_experts), or BadRouting naming `name`."""
    a = np.asarray(a)
    want = (samples, length, n_layers, k)
    if not np.issubdtype(a.dtype, np.integer):
        raise BadRouting(f"{name}: expert ids must be integers, got {a.dtype}")
    if a.shape != want:
        raise BadRouting(f"{name}: shape {a.shape}, expected {want} (samples, prompt + completion tokens, "
                         f"n_layers={n_layers}, k={k})")
    if a.size and (a.min() < 0 or a.max() >= num_experts):
        bad = np.argwhere((a < 0) | (a >= num_experts))[0]
        raise BadRouting(f"{name}: expert ids must be in [0, {num_experts}), got {a[tuple(bad)]} at "
                         f"(sample, token, layer, k) = {tuple(int(i) for i in bad)}")
    return a.astype(np.int32)


def result_arrays(r, num_experts: int = 0) -> dict:
    """The arrays of a finished group (generator.GroupResult) in a Fetch reply."""
    gid = r.group_id
    arrays = {f"{name}_{gid}": getattr(r, name) for name in RESULT_FIELDS}
    if getattr(r, "routing", None) is not None:
        arrays[f"routing_{gid}"] = np.asarray(r.routing).astype(routing_wire_dtype(max(num_experts, 1)))
    return arrays


def read_result(gid: int, arrays: dict, routing: tuple | None = None):
    """The GroupResult of group `gid` from a Fetch reply; with routing=(n_layers, k, num_experts)
    its `routing_<gid>` too, checked (BadRouting)."""
    from rl_scaling.rollout import generator

    try:
        fields = [arrays[f"{n}_{gid}"] for n in RESULT_FIELDS]
    except KeyError as e:
        raise BadRequest(f"group {gid}: no array {e.args[0]}") from None
    rt = None
    if routing is not None:
        name = f"routing_{gid}"
        if name not in arrays:
            raise BadRouting(f"{name}: missing (rl.routing_replay='r3' needs each token's experts per layer; "
                             "is the replica's config the trainer's?)")
        n_layers, k, num_experts = routing
        G, T = np.shape(fields[1])
        rt = check_routing(arrays[name], samples=G, length=len(fields[0]) + T, n_layers=n_layers, k=k,
                           num_experts=num_experts, name=name)
    return generator.GroupResult(gid, *fields, routing=rt)


def load_token(token_file: str = "") -> str:
    """The shared secret: the contents of `token_file` if given, else $RL_SCALING_ROLLOUT_TOKEN, else ""."""
    if token_file:
        from rl_scaling import paths

        try:
            token = paths.read_text(token_file).strip()
        except Exception as e:  # noqa: BLE001 - a missing file locally, a client error on gs://
            raise ValueError(f"rollout token file {token_file}: {type(e).__name__}: {e}") from e
        if not token:
            raise ValueError(f"rollout token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip()


def pack(meta: dict, arrays: dict | None = None) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **(arrays or {}))
    return buf.getvalue()


def _read_member(archive, info):
    if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
        raise ValueError(f"member {info.filename!r} is not an uncompressed .npy")  # a compressed one could explode
    with archive.open(info) as f:  # the header first: refuse a shape bigger than the bytes present
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"member {info.filename!r}: .npy format version {version}")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        if dtype.hasobject or math.prod(shape) * dtype.itemsize > info.file_size:
            raise ValueError(f"member {info.filename!r}: {dtype} {shape} is not a plain array of its size")
    with archive.open(info) as f:
        return np.lib.format.read_array(f, allow_pickle=False)


def unpack(blob: bytes):
    """(meta, arrays) of a `pack` message. Never unpickles; BadRequest names what is wrong."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            arrays = {info.filename[:-4]: _read_member(archive, info) for info in archive.infolist()}
        raw = arrays.pop("__meta__")
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise ValueError(f"__meta__ is {raw.dtype} {raw.shape}, not JSON bytes")
        meta = json.loads(raw.tobytes().decode())
    except Exception as e:  # noqa: BLE001 - any failure to parse client bytes is the client's fault
        raise BadRequest(f"not a message of this service (an uncompressed .npz of plain arrays with a JSON "
                         f"__meta__): {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict):
        raise BadRequest(f"__meta__ must be a JSON object, got {type(meta).__name__}")
    return meta, arrays


def field(obj, name: str, kind, where: str = "the request"):
    """obj[name], checked to be a `kind` (int and float exclude bool; float must be finite)."""
    value = obj.get(name) if isinstance(obj, dict) else None
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise BadRequest(f"{where}: field {name!r} must be a{'n' if kind is int else ''} {kind.__name__}, "
                         f"got {str(value)[:60]!r}")
    return value


def check_prompt(tokens, *, max_len: int, vocab_size: int, where: str = "the request") -> np.ndarray:
    """A prompt as the engine takes it (1-D int32, 1..max_len ids in [0, vocab_size)) or BadRequest."""
    a = np.asarray(tokens)
    if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
        raise BadRequest(f"{where}: a prompt is a 1-D array of integer token ids, got {a.dtype} of shape {a.shape}")
    if not 1 <= a.size <= max_len:
        raise BadRequest(f"{where}: prompt of {a.size} tokens; this engine takes 1..{max_len}")
    if a.min() < 0 or a.max() >= vocab_size:
        raise BadRequest(f"{where}: token ids must be in [0, {vocab_size}), got {a.min()}..{a.max()}")
    return a.astype(np.int32)


def fingerprint(config) -> dict:
    """What must agree between a trainer and its rollout server."""
    rc = config.rollout
    return {"model": {k: v for k, v in config.model.to_dict().items()}, "fp32_lm_head": rc.fp32_lm_head,
            "task": config.task.name, "max_prompt_len": config.task.max_prompt_len,
            "max_new_tokens": rc.max_new_tokens, "temperature": rc.temperature,
            "record_routing": config.rl.get("routing_replay", "off") == "r3" and bool(config.model.get("num_experts", 0)),
            "length_control": {k: rc[k] for k in ("length_control", "think_budget_lo", "think_budget_hi",
                                                  "interrupt_phrase", "answer_budget")}}


PUSH_DTYPES = ("", "bfloat16", "float32")  # "": the params' own dtype (bit-exact)


def check_push_dtype(value) -> str:
    if value not in PUSH_DTYPES:
        raise ValueError(f"config.rollout.push_dtype={value!r} is not valid; choose one of {PUSH_DTYPES} "
                         "(\"\": the params' own dtype)")
    return value


def keeps_float32(path, fp32_lm_head: bool, tie_embeddings: bool = False) -> bool:
    """Whether the leaf at `path` (a key path of the params tree) stays float32 whatever
    rollout.push_dtype says: ScaleRL keeps the generator's LM head in float32. In
    policy/model.py's Decoder that is the top-level param `lm_head` ([d_model, vocab]), or, with
    tied embeddings, `embed` ([vocab, d_model]), which then is the LM head."""
    if not fp32_lm_head or not path:
        return False
    name = getattr(path[-1], "key", None)
    return name == "lm_head" or (tie_embeddings and name == "embed")


@functools.lru_cache(maxsize=None)
def _device_cast(dtype, sharding):
    """A jitted cast that keeps the sharding (compiled once per dtype, sharding and shape)."""
    return jax.jit(lambda a: a.astype(dtype), out_shardings=sharding)


def cast_for_push(params, push_dtype: str, *, fp32_lm_head: bool, tie_embeddings: bool = False):
    """`params` with each floating leaf in `push_dtype` ("" or the leaf's own dtype: unchanged,
    the same object), but those `keeps_float32` names. A jax.Array is cast where it lies (each
    device its own shards: nothing is gathered, the result has the input's sharding; with several
    processes every process must call this, as with any computation on global arrays); a numpy
    leaf is cast with numpy."""
    if not check_push_dtype(push_dtype):
        return params
    target = np.dtype(jax.numpy.dtype(push_dtype))

    def cast(path, x):
        dtype = np.dtype(x.dtype)
        if (not jax.numpy.issubdtype(dtype, jax.numpy.floating) or dtype == target
                or keeps_float32(path, fp32_lm_head, tie_embeddings)):
            return x
        if isinstance(x, jax.Array):
            return _device_cast(target, x.sharding)(x)
        return np.asarray(x).astype(target)

    return jax.tree_util.tree_map_with_path(cast, params)


def _leaf_keys(tree):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) for p, _ in leaves], [x for _, x in leaves], treedef


def weight_chunks(params, version: int):
    """Yield the PushWeights request stream for `params` (host copies are made here)."""
    keys, leaves, _ = _leaf_keys(params)
    host = jax.device_get(leaves)
    for key, x in zip(keys, host):
        x = np.ascontiguousarray(x)
        raw = x.reshape(-1).view(np.uint8)
        n = max(1, -(-raw.size // CHUNK_BYTES))
        for i in range(n):
            meta = {"version": version, "key": key, "dtype": str(x.dtype), "shape": list(x.shape), "part": i, "parts": n}
            yield pack(meta, {"data": raw[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]})
    yield pack({"version": version, "done": True, "leaves": len(keys)})


def _chunk_header(meta, expected):
    """(key, dtype, shape, parts) of one weight chunk, checked (against `expected` {key: shape} if given)."""
    where = "weight chunk"
    key = field(meta, "key", str, where)
    where = f"weight chunk of {key}"
    try:
        dtype = jax.numpy.dtype(field(meta, "dtype", str, where))
    except TypeError as e:
        raise BadRequest(f"{where}: dtype {meta['dtype']!r}: {e}") from None
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        raise BadRequest(f"{where}: weights are floating point, got dtype {dtype}")
    shape = field(meta, "shape", list, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadRequest(f"{where}: shape {shape} is not a list of sizes")
    if expected is not None and key not in expected:
        raise BadRequest(f"{where}: the server's model has no weight {key}")
    if expected is not None and tuple(shape) != tuple(expected[key]):
        raise BadRequest(f"weight {key} has shape {tuple(shape)}, the server's model expects {tuple(expected[key])}")
    parts = field(meta, "parts", int, where)
    if parts < 1:
        raise BadRequest(f"{where}: parts={parts}")
    return key, dtype, tuple(shape), parts


def read_weight_chunks(blobs, expected: dict | None = None):
    """(version, {key: array}) from a PushWeights stream. BadRequest (a ValueError) if a chunk is
    malformed, out of order or missing, or (with `expected`, {key: shape}) names a weight the
    model has not or has another shape: checked chunk by chunk, before the bytes pile up."""
    parts: dict[str, list] = {}
    header_of: dict[str, tuple] = {}
    version = None
    for blob in blobs:
        meta, arrays = unpack(blob)
        v = field(meta, "version", int, "weight chunk")
        if version is not None and v != version:
            raise BadRequest(f"weight push mixes versions {version} and {v}")
        version = v
        if meta.get("done"):
            leaves = field(meta, "leaves", int, "last weight chunk")
            if len(parts) != leaves or any(len(parts[k]) != header_of[k][3] for k in parts):
                raise BadRequest(f"weight push incomplete: {len(parts)} of {leaves} leaves")
            out = {}
            for k, (_, dtype, shape, _) in header_of.items():
                raw = np.concatenate(parts[k])
                if raw.size != math.prod(shape) * dtype.itemsize:
                    raise BadRequest(f"weight {k}: {raw.size} bytes for {dtype} {shape}")
                out[k] = raw.view(dtype).reshape(shape)
            return version, out
        header = _chunk_header(meta, expected)
        key = header[0]
        if header_of.setdefault(key, header) != header:
            raise BadRequest(f"weight chunk of {key}: dtype, shape or parts differ from its first chunk")
        received = parts.setdefault(key, [])
        if meta.get("part") != len(received) or len(received) >= header[3]:
            raise BadRequest(f"weight chunk of {key}: part {meta.get('part')!r}, expected {len(received)} of {header[3]}")
        data = arrays.get("data")
        if data is None or data.dtype != np.uint8 or data.ndim != 1:
            raise BadRequest(f"weight chunk of {key}: `data` must be 1-D uint8 bytes")
        received.append(data)
    raise BadRequest("weight push ended before its last chunk")
