"""Rollouts in another process or slice: the JetStream engine behind a small gRPC service.

`python launch/serve.py --config=configs/tiny.py --port=PORT` runs a `PolicyEngine` and its
`Generator` (rollout/engine.py) and serves, on 127.0.0.1 unless --host names another
interface, the service `rl_scaling.Rollout`. The trainer connects with
`--config.rollout.mode=pipeline --config.rollout.server=HOST:PORT`.

Why a service of ours for RL and not JetStream's stock gRPC `Decode`: that API returns token
ids and text only; RL needs each token's generator log-prob and policy version, and log-probs
recomputed on the trainer would not be those the sampler drew from. With `jetstream=True`
(`launch/serve.py --jetstream`) the same server also speaks JetStream's `Orchestrator` API over
the same engine and weights, for JetStream's stock clients (rollout/jetstream_service.py).

The service uses grpc's generic handlers (no generated code); every message is an
uncompressed .npz archive (a JSON header `__meta__` plus plain numpy arrays). The server
never unpickles: `unpack` refuses object arrays, compressed members and anything else.
Every request is checked field by field before it touches the engine; a malformed one is
answered INVALID_ARGUMENT with a message naming the fault, any other failure INTERNAL with
a one-line message (the traceback stays in the server's log), never UNKNOWN.

  Health({})                                  -> {instance, live, error, version, fingerprint, devices, stats}
  PushWeights(stream of chunks)               -> {version}
      the weight channel: after every trainer step the trainer streams its params, leaf by
      leaf, in chunks of at most 64 MiB (`key`, dtype, shape, raw bytes); the server swaps
      them in between two generate steps (sequences in flight keep their KV cache). A
      group is started only once the server has weights at least as new as its
      `min_version` (the trainer's version when it was submitted).
  Submit({groups: [{id, num_samples, min_version}]}, prompt_<id>)   -> {accepted}
  Fetch({ack: [ids], timeout})                -> finished groups (prompt_<id>, tokens_<id>, logprobs_<id>,
      versions_<id>, lengths_<id>, stopped_<id>, forced_<id>), generator stats, the server's error if any.
      Long-polls up to `timeout`. A group is re-sent until acked (the client drops
      duplicates by id), so a lost reply loses no group.

Faults: the client turns a dead server into `RolloutError` within `reconnect_s`: it retries
for that long, and if a new server instance answers it pushes the latest weights again
and resubmits the groups still outstanding; otherwise it stops with a message naming
the address. A failed generator thread in the server is reported through Health/Fetch.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import queue
import threading
import time
import uuid
import zipfile
from concurrent import futures

import grpc
import jax
import numpy as np
from flax import linen as nn

from rl_scaling.policy import model as model_lib
from rl_scaling.rollout import generator as generator_lib
from rl_scaling.rollout.pipeline import RolloutError

log = logging.getLogger(__name__)

SERVICE = "rl_scaling.Rollout"
CHUNK_BYTES = 64 << 20
MAX_MESSAGE = 256 << 20
RESULT_FIELDS = ("prompt", "tokens", "logprobs", "versions", "lengths", "stopped", "forced")  # GroupResult order
MAX_SAMPLES = 4096  # per group: a bigger request is refused, not allowed to exhaust host memory
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


class BadRequest(ValueError):
    """A malformed request: answered INVALID_ARGUMENT with this message."""


class Refused(Exception):
    """A well-formed request the server cannot serve now: answered with `code` and the message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _abort_with(method: str, context, e: Exception):
    if isinstance(e, BadRequest):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(e, Refused):
        code = e.code
    elif not context.is_active():  # the client hung up mid-request (a cancelled stream raises here)
        return
    else:  # a fault of the server's own: the traceback goes to its log, one line to the client
        log.error("%s failed", method, exc_info=e)
        code, e = grpc.StatusCode.INTERNAL, f"server error: {type(e).__name__}: {e}"
    context.abort(code, f"{method}: {e}")


def guarded(method: str, fn):
    """A unary-response handler that answers every exception with a status (see the module doc)."""

    @functools.wraps(fn)
    def handler(request, context):
        try:
            return fn(request, context)
        except Exception as e:  # noqa: BLE001 - each becomes a status, never UNKNOWN
            error = e
        _abort_with(method, context, error)

    return handler


def guarded_stream(method: str, fn):
    """`guarded` for a handler that yields its responses."""

    @functools.wraps(fn)
    def handler(request, context):
        try:
            yield from fn(request, context)
            return
        except Exception as e:  # noqa: BLE001
            error = e
        _abort_with(method, context, error)

    return handler


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
            "length_control": {k: rc[k] for k in ("length_control", "think_budget_lo", "think_budget_hi",
                                                  "interrupt_phrase", "answer_budget")}}


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


class RolloutServer:
    """The gRPC service over one engine + generator thread (and, with `jetstream`, JetStream's
    Orchestrator service over the same generator)."""

    def __init__(self, engine, holder, *, host: str = "127.0.0.1", port: int = 0, fingerprint: dict | None = None,
                 resend_s: float = 10.0, threads: int = 8, jetstream: bool = False):
        self.engine, self.holder = engine, holder
        self.generator = generator_lib.Generator(engine, holder).start()
        self.instance = uuid.uuid4().hex
        self.fingerprint = fingerprint or {}
        self.resend_s = resend_s
        abstract = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(engine.cfg, jax.random.key(0))))
        self._keys, self._avals, self._treedef = _leaf_keys(abstract)
        self._shapes = {k: a.shape for k, a in zip(self._keys, self._avals)}
        self._completed: dict[int, list] = {}  # group id -> [GroupResult, time sent or None]
        self._session = None  # the trainer whose groups are being served (group ids are per session)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        handlers = {
            "Health": grpc.unary_unary_rpc_method_handler(guarded("Health", self._health)),
            "Submit": grpc.unary_unary_rpc_method_handler(guarded("Submit", self._submit)),
            "Fetch": grpc.unary_unary_rpc_method_handler(guarded("Fetch", self._fetch)),
            "PushWeights": grpc.stream_unary_rpc_method_handler(guarded("PushWeights", self._push_weights)),
        }
        services = [grpc.method_handlers_generic_handler(SERVICE, handlers)]
        if jetstream:
            from rl_scaling.rollout import jetstream_service  # it builds on this module

            services.append(jetstream_service.Orchestrator(self).service())
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=_OPTIONS)
        self._server.add_generic_rpc_handlers(services)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"rollout server: cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"

    def start(self):
        self._server.start()
        log.info("rollout server %s listening on %s", self.instance[:8], self.address)
        return self

    def error(self) -> str:
        try:
            self.generator.check()
        except RuntimeError as e:
            return str(e)
        return ""

    def stop(self, grace: float = 2.0):
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._server.stop(grace).wait(grace + 1)
        self.generator.stop()

    def wait(self, poll_s: float = 0.5) -> str:
        """Block until stopped or the generator fails; returns the error text ("" if none)."""
        while not self._stopped.is_set():
            err = self.error()
            if err:
                return err
            time.sleep(poll_s)
        return ""

    # ---- handlers --------------------------------------------------------------------
    def _stats(self):
        return {**self.generator.stats(), "pending": self.generator.pending()}

    def _health(self, request: bytes, context) -> bytes:
        unpack(request)  # no fields; but it must be a message of this service
        return pack({"instance": self.instance, "live": self.generator.alive and not self.error(),
                     "error": self.error(), "version": self.holder.version, "fingerprint": self.fingerprint,
                     "devices": len(self.engine.mesh.devices.flat), "stats": self._stats()})

    def _group_request(self, group, arrays) -> generator_lib.GroupRequest:
        gid = field(group, "id", int, "a group")
        where = f"group {gid}"
        num_samples, min_version = field(group, "num_samples", int, where), field(group, "min_version", int, where)
        if not 1 <= num_samples <= MAX_SAMPLES:
            raise BadRequest(f"{where}: num_samples={num_samples}, allowed 1..{MAX_SAMPLES}")
        if f"prompt_{gid}" not in arrays:
            raise BadRequest(f"{where}: no array prompt_{gid}")
        prompt = check_prompt(arrays[f"prompt_{gid}"], max_len=self.engine.max_prefill_length,
                              vocab_size=self.engine.cfg.vocab_size, where=where)
        return generator_lib.GroupRequest(gid, prompt, num_samples, min_version)

    def _submit(self, request: bytes, context) -> bytes:
        meta, arrays = unpack(request)
        session = field(meta, "session", str)
        reqs = [self._group_request(g, arrays) for g in field(meta, "groups", list)]  # all checked first
        with self._lock:
            if session != self._session:  # a new trainer: drop the old one's work and results
                if self._session is not None:
                    log.info("new trainer session %s: dropping the previous session's groups", session[:8])
                self._session = session
                self.generator.reset()
                self._completed.clear()
        self.generator.submit(reqs)
        return pack({"accepted": len(reqs), "instance": self.instance})

    def _fetch(self, request: bytes, context) -> bytes:
        meta, _ = unpack(request)
        timeout = field(meta, "timeout", float) if "timeout" in meta else 0.0
        ack = field(meta, "ack", list) if "ack" in meta else []
        if timeout < 0 or not all(isinstance(g, int) and not isinstance(g, bool) for g in ack):
            raise BadRequest(f"timeout must be >= 0 and ack a list of group ids, got {timeout!r}, {str(ack)[:60]}")
        deadline = time.monotonic() + timeout
        with self._lock:
            for gid in ack:
                self._completed.pop(gid, None)
            while True:
                while True:
                    try:
                        r = self.generator.results.get_nowait()
                    except queue.Empty:
                        break
                    self._completed[r.group_id] = [r, None]
                now = time.monotonic()
                send = [g for g, (r, sent) in self._completed.items() if sent is None or now - sent > self.resend_s]
                err = self.error()
                if send or err or now >= deadline or self._stopped.is_set():
                    break
                try:
                    r = self.generator.results.get(timeout=min(0.05, deadline - now))
                    self._completed[r.group_id] = [r, None]
                except queue.Empty:
                    pass
            arrays, groups = {}, []
            for gid in send:
                entry = self._completed[gid]
                entry[1] = now
                r = entry[0]
                groups.append({"id": gid})
                for name in RESULT_FIELDS:
                    arrays[f"{name}_{gid}"] = getattr(r, name)
        return pack({"groups": groups, "stats": self._stats(), "error": err, "instance": self.instance}, arrays)

    def _push_weights(self, request_iterator, context) -> bytes:
        version, arrays = read_weight_chunks(request_iterator, self._shapes)
        missing = [k for k in self._keys if k not in arrays]
        if missing:
            raise BadRequest(f"weight push has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        leaves = [arrays[key].astype(aval.dtype) for key, aval in zip(self._keys, self._avals)]
        self.holder.set(jax.tree_util.tree_unflatten(self._treedef, leaves), int(version))
        return pack({"version": int(version), "instance": self.instance})


class RemoteBackend:
    """The trainer's side: the pipeline backend interface over the gRPC service."""

    RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)

    def __init__(self, address: str, *, expected: dict | None = None, reconnect_s: float = 10.0, rpc_timeout_s: float = 10.0):
        self.address, self.expected = address, expected
        self.reconnect_s, self.rpc_timeout_s = reconnect_s, rpc_timeout_s
        self._channel = grpc.insecure_channel(address, options=_OPTIONS)
        ident = lambda b: b  # noqa: E731 - messages are already bytes
        self._unary = {name: self._channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=ident,
                                                       response_deserializer=ident)
                       for name in ("Health", "Submit", "Fetch")}
        self._push = self._channel.stream_unary(f"/{SERVICE}/PushWeights", request_serializer=ident,
                                                response_deserializer=ident)
        self._outstanding: dict[int, generator_lib.GroupRequest] = {}  # submitted, not yet received
        self._ack: list[int] = []
        self._latest = None  # (params, version) to push again after a server restart
        self._stats = {"busy_s": 0.0, "idle_s": 0.0, "steps": 0, "slot_steps": 0, "tokens": 0, "slots": 1}
        self.instance, self.devices = None, 0
        self.session = uuid.uuid4().hex
        self._connect(deadline=time.monotonic() + reconnect_s)

    def _connect(self, deadline):
        last = None
        while True:
            try:
                meta, _ = unpack(self._unary["Health"](pack({}), timeout=2.0))
                break
            except grpc.RpcError as e:
                last = e
                if time.monotonic() >= deadline:
                    raise RolloutError(f"rollout server {self.address} is not reachable ({e.code().name}: {e.details()}); "
                                       "start it with `python launch/serve.py --config=... --port=...`") from None
                time.sleep(0.2)
        del last
        if meta["error"]:
            raise RolloutError(f"rollout server {self.address} reports a failure:\n{meta['error']}")
        if self.expected is not None and meta["fingerprint"] != json.loads(json.dumps(self.expected)):
            raise RolloutError(f"rollout server {self.address} runs a different config: server {meta['fingerprint']} "
                               f"vs trainer {self.expected}")
        restarted = self.instance is not None and meta["instance"] != self.instance
        self.instance, self.devices = meta["instance"], int(meta["devices"])
        if restarted:
            log.warning("rollout server %s restarted; pushing weights and resubmitting %d groups",
                        self.address, len(self._outstanding))
            self._ack = []
            if self._latest is not None:
                self._push(weight_chunks(*self._latest), timeout=self._push_timeout(self._latest[0]))
            if self._outstanding:
                self._submit_rpc(list(self._outstanding.values()))

    def _call(self, fn):
        """Run fn(); on a lost connection retry for reconnect_s, then raise RolloutError."""
        start = time.monotonic()
        while True:
            try:
                return fn()
            except grpc.RpcError as e:
                if e.code() not in self.RETRYABLE:
                    raise RolloutError(f"rollout server {self.address}: {e.code().name}: {e.details()}") from None
                deadline = start + self.reconnect_s
                if time.monotonic() >= deadline:
                    raise RolloutError(
                        f"rollout server {self.address} lost for {self.reconnect_s:.0f} s ({e.code().name}: {e.details()}); "
                        "stopping. The last checkpoint is intact: restart launch/serve.py and re-run the same "
                        "command to resume.") from None
                log.warning("rollout server %s: %s; reconnecting", self.address, e.code().name)
                try:
                    self._connect(deadline)
                except RolloutError as e2:
                    raise RolloutError(
                        f"rollout server {self.address} lost ({e.code().name}) and not back within "
                        f"{self.reconnect_s:.0f} s; stopping. The last checkpoint is intact: restart launch/serve.py "
                        f"and re-run the same command to resume. Last attempt: {e2}") from None

    def _push_timeout(self, host_params) -> float:
        nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(host_params))
        return self.rpc_timeout_s + nbytes / 100e6  # at least 100 MB/s

    def _submit_rpc(self, requests):
        meta = {"session": self.session, "groups": [{"id": r.group_id, "num_samples": r.num_samples,
                                                     "min_version": r.min_version} for r in requests]}
        arrays = {f"prompt_{r.group_id}": np.asarray(r.prompt, np.int32) for r in requests}
        self._unary["Submit"](pack(meta, arrays), timeout=self.rpc_timeout_s)

    # ---- backend interface (see pipeline.EmbeddedBackend) -----------------------------
    def submit(self, requests):
        for r in requests:
            self._outstanding[r.group_id] = r
        self._call(lambda: self._submit_rpc(requests))

    def poll(self, timeout: float):
        def fetch():
            return unpack(self._unary["Fetch"](pack({"ack": self._ack, "timeout": timeout}),
                                               timeout=timeout + self.rpc_timeout_s))

        meta, arrays = self._call(fetch)
        if meta["error"]:
            raise RolloutError(f"rollout server {self.address} failed:\n{meta['error']}")
        self._stats = meta["stats"]
        self._ack = []
        out = []
        for g in meta["groups"]:
            gid = g["id"]
            self._ack.append(gid)
            self._outstanding.pop(gid, None)
            out.append(generator_lib.GroupResult(gid, *(arrays[f"{n}_{gid}"] for n in RESULT_FIELDS)))
        return out

    def push_weights(self, params, version: int):
        host = jax.device_get(params)  # a host copy: the trainer donates its params on the next step
        self._latest = (host, version)
        self._call(lambda: self._push(weight_chunks(host, version), timeout=self._push_timeout(host)))

    def check(self):
        pass  # every poll reports the server's health

    def stats(self) -> dict:
        return self._stats

    def close(self):
        self._channel.close()


def serve(config, *, host: str = "127.0.0.1", port: int = 0, devices=None, jetstream: bool = False,
          params: str = "") -> RolloutServer:
    """Build the engine a config describes and start serving it. Weights arrive by push, or
    start as version 0 from `params` (an Orbax params checkpoint or a Hugging Face directory)."""
    from rl_scaling import checkpoint, config as config_lib, tasks, train
    from rl_scaling.rollout import pipeline

    task = tasks.make_task(config.task, config.seed)
    gen_cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    engine, holder = pipeline.make_engine(config, gen_cfg, task.tokenizer, devices or jax.devices())
    if params:
        abstract = checkpoint.abstract_like(
            jax.eval_shape(lambda: nn.unbox(model_lib.init_params(gen_cfg, jax.random.key(0)))), engine.param_shardings)
        holder.set(train.load_start_params(params, gen_cfg, engine.mesh, abstract), 0)
        log.info("serving the weights in %s as version 0", params)
    return RolloutServer(engine, holder, host=host, port=port, fingerprint=fingerprint(config),
                         jetstream=jetstream).start()
