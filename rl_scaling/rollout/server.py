"""Rollouts in another process or slice: the JetStream engine behind a small gRPC service.

`python launch/serve.py --config=configs/tiny.py --port=PORT` runs a `PolicyEngine` and its
`Generator` (rollout/engine.py) and serves, on 127.0.0.1 unless --host names another
interface, the service `rl_scaling.Rollout`. The trainer connects with
`--config.rollout.mode=pipeline --config.rollout.server=HOST:PORT`.

Why a service of ours and not JetStream's stock gRPC `Decode`: that API returns token ids
and text only; RL needs each token's generator log-prob and policy version, and log-probs
recomputed on the trainer would not be those the sampler drew from. The service uses
grpc's generic handlers (no generated code); every message is an .npz archive (a JSON
header `__meta__` plus numpy arrays), read back with allow_pickle=False.

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

import io
import json
import logging
import queue
import threading
import time
import uuid
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
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


def pack(meta: dict, arrays: dict | None = None) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **(arrays or {}))
    return buf.getvalue()


def unpack(blob: bytes):
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        meta = json.loads(z["__meta__"].tobytes().decode())
        return meta, {k: z[k] for k in z.files if k != "__meta__"}


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


def read_weight_chunks(blobs):
    """(version, {key: array}) from a PushWeights stream; ValueError if it is incomplete."""
    parts: dict[str, list] = {}
    meta_of: dict[str, dict] = {}
    for blob in blobs:
        meta, arrays = unpack(blob)
        if meta.get("done"):
            if len(parts) != meta["leaves"] or any(len(parts[k]) != meta_of[k]["parts"] for k in parts):
                raise ValueError(f"weight push incomplete: {len(parts)} of {meta['leaves']} leaves")
            out = {k: np.concatenate(parts[k]).view(jax.numpy.dtype(meta_of[k]["dtype"])).reshape(meta_of[k]["shape"])
                   for k in parts}
            return int(meta["version"]), out
        parts.setdefault(meta["key"], []).append(arrays["data"])
        meta_of[meta["key"]] = meta
    raise ValueError("weight push ended before its last chunk")


class RolloutServer:
    """The gRPC service over one engine + generator thread."""

    def __init__(self, engine, holder, *, host: str = "127.0.0.1", port: int = 0, fingerprint: dict | None = None,
                 resend_s: float = 10.0, threads: int = 8):
        self.engine, self.holder = engine, holder
        self.generator = generator_lib.Generator(engine, holder).start()
        self.instance = uuid.uuid4().hex
        self.fingerprint = fingerprint or {}
        self.resend_s = resend_s
        abstract = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(engine.cfg, jax.random.key(0))))
        self._keys, self._avals, self._treedef = _leaf_keys(abstract)
        self._completed: dict[int, list] = {}  # group id -> [GroupResult, time sent or None]
        self._session = None  # the trainer whose groups are being served (group ids are per session)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        handlers = {
            "Health": grpc.unary_unary_rpc_method_handler(self._health),
            "Submit": grpc.unary_unary_rpc_method_handler(self._submit),
            "Fetch": grpc.unary_unary_rpc_method_handler(self._fetch),
            "PushWeights": grpc.stream_unary_rpc_method_handler(self._push_weights),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=_OPTIONS)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
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
        return pack({"instance": self.instance, "live": self.generator.alive and not self.error(),
                     "error": self.error(), "version": self.holder.version, "fingerprint": self.fingerprint,
                     "devices": len(self.engine.mesh.devices.flat), "stats": self._stats()})

    def _submit(self, request: bytes, context) -> bytes:
        meta, arrays = unpack(request)
        with self._lock:
            if meta["session"] != self._session:  # a new trainer: drop the old one's work and results
                if self._session is not None:
                    log.info("new trainer session %s: dropping the previous session's groups", meta["session"][:8])
                self._session = meta["session"]
                self.generator.reset()
                self._completed.clear()
        reqs = [generator_lib.GroupRequest(g["id"], arrays[f"prompt_{g['id']}"].astype(np.int32), int(g["num_samples"]),
                                        int(g["min_version"])) for g in meta["groups"]]
        self.generator.submit(reqs)
        return pack({"accepted": len(reqs), "instance": self.instance})

    def _fetch(self, request: bytes, context) -> bytes:
        meta, _ = unpack(request)
        deadline = time.monotonic() + float(meta.get("timeout", 0.0))
        with self._lock:
            for gid in meta.get("ack", []):
                self._completed.pop(int(gid), None)
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
        try:
            version, arrays = read_weight_chunks(request_iterator)
            leaves = []
            for key, aval in zip(self._keys, self._avals):
                if key not in arrays:
                    raise ValueError(f"weight push has no {key}")
                if tuple(arrays[key].shape) != tuple(aval.shape):
                    raise ValueError(f"weight {key} has shape {arrays[key].shape}, the server's model expects {aval.shape}")
                leaves.append(arrays[key].astype(aval.dtype))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
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


def serve(config, *, host: str = "127.0.0.1", port: int = 0, devices=None) -> RolloutServer:
    """Build the engine a config describes and start serving it (weights arrive by push)."""
    from rl_scaling import config as config_lib, tasks
    from rl_scaling.rollout import pipeline

    task = tasks.make_task(config.task, config.seed)
    gen_cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    engine, holder = pipeline.make_engine(config, gen_cfg, task.tokenizer, devices or jax.devices())
    return RolloutServer(engine, holder, host=host, port=port, fingerprint=fingerprint(config)).start()
