"""Rollouts in another process or slice: the JetStream engine behind a small gRPC service.

`python launch/serve.py --config=configs/tiny.py --port=PORT` runs a `PolicyEngine` and its
`Generator` (rollout/engine.py) and serves, on 127.0.0.1 unless --host names another
interface, the service `rl_scaling.Rollout`. The trainer connects with
`--config.rollout.mode=pipeline --config.rollout.servers=HOST:PORT[,HOST:PORT...]`
(client.py: several replicas, failover).

Why a service of ours for RL and not JetStream's stock gRPC `Decode`: that API returns token
ids and text only; RL needs each token's generator log-prob and policy version, and log-probs
recomputed on the trainer would not be those the sampler drew from. With `jetstream=True`
(`launch/serve.py --jetstream`) the same server also speaks JetStream's `Orchestrator` API over
the same engine and weights, for JetStream's stock clients (jetstream_service.py).

The service uses grpc's generic handlers (no generated code); messages are wire.py's .npz
archives, never unpickled. Every request is checked field by field before it touches the
engine; a malformed one is answered INVALID_ARGUMENT with a message naming the fault, a
well-formed one beyond the server's limits RESOURCE_EXHAUSTED, any other failure INTERNAL
with a one-line message (the traceback stays in the server's log), never UNKNOWN (rpc.guarded).

Authentication: with a token (wire.load_token: $RL_SCALING_ROLLOUT_TOKEN or --token_file),
every RPC of every service must carry it in the `x-rl-scaling-token` metadata (compared in
constant time) or is answered UNAUTHENTICATED before any handler runs (rpc.TokenCheck).

  Health({})                                  -> {instance, live, error, version, fingerprint, devices, stats}
  PushWeights(stream of chunks; metadata x-rl-scaling-session)   -> {version}
      the weight channel: the trainer streams its params leaf by leaf in chunks of at most
      64 MiB; the server swaps them in between two generate steps (sequences in flight keep
      their KV cache). Within a session versions only go up: an older one is refused
      (FAILED_PRECONDITION). A group is started only once the server has weights at least as
      new as its `min_version`. (Or, with `weights_dir`, the server polls a directory the
      trainer writes: weights_dir.py.)
  Submit({session, groups: [{id, num_samples, min_version}]}, prompt_<id>)   -> {accepted}
      at most MAX_SAMPLES samples a group, `max_submit_samples` a Submit and `max_pending`
      groups queued.
  Fetch({ack: [ids], timeout})                -> finished groups (prompt_<id>, tokens_<id>, logprobs_<id>,
      versions_<id>, lengths_<id>, stopped_<id>, forced_<id>[, routing_<id>]), generator stats, the server's
      error if any (routing_<id>: each token's experts, from an engine that records them; wire.py).
      Long-polls up to `timeout` (<= MAX_FETCH_S); at most `max_fetches` at once. A group is
      re-sent until acked (the client drops duplicates by id), so a lost reply loses no group.

Sessions: a replica serves one trainer session at a time. Every PushWeights carries the
trainer's session id (x-rl-scaling-session metadata; without it INVALID_ARGUMENT), every Submit
its `session` field, and the client's Health and Fetch calls their `session`: the first session
to call holds the replica, and while it does (until it releases it on close, or for
`session_lease_s` after its last call) another session is refused with FAILED_PRECONDITION naming
the holder. A new holder is a new trainer: the server forgets the previous session's groups and
results, and its versions start afresh (a trainer resumed from an older checkpoint); within a
session versions only go up. Versions are 0..MAX_VERSION (the engine records each token's version
as int32); another is INVALID_ARGUMENT. A pushed leaf with a NaN or inf is INVALID_ARGUMENT
naming the leaf, and the replica keeps its weights.

Binding is exclusive (no SO_REUSEPORT): a second server on a taken port fails with an error
naming the address instead of sharing the port's connections.
"""

from __future__ import annotations

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
from rl_scaling.serving import weights_dir as weights_dir_lib
from rl_scaling.serving.rpc import Refused, TokenCheck, bind_address, guarded
from rl_scaling.serving.wire import (
    OPTIONS, SERVICE, BadRequest, _leaf_keys, check_prompt, field, fingerprint, pack, read_weight_chunks, result_arrays,
    unpack)

log = logging.getLogger(__name__)

SESSION_METADATA = "x-rl-scaling-session"
MAX_SAMPLES = 4096  # per group: a bigger request is refused, not allowed to exhaust host memory
MAX_FETCH_S = 60.0  # longest Fetch long-poll
# A Fetch reply carries whole groups up to this many bytes (at least one group): a Scout group with
# its routing is ~16 MB, and the client refuses messages over wire.MAX_MESSAGE.
REPLY_BYTES = 32 << 20


MAX_VERSION = 2**31 - 1  # the engine records each token's policy version as int32
SESSION_LEASE_S = 60.0  # a trainer that has not called for this long no longer holds the replica
# Exclusive bind: with SO_REUSEPORT (grpc's default on Linux) a second server on the same port
# binds too, and the kernel splits the connections between the two silently.
SERVER_OPTIONS = OPTIONS + [("grpc.so_reuseport", 0)]


class RolloutServer:
    """The gRPC service over one engine + generator thread (and, with `jetstream`, JetStream's
    Orchestrator service over the same generator)."""

    def __init__(self, engine, holder, *, host: str = "127.0.0.1", port: int = 0, fingerprint: dict | None = None,
                 resend_s: float = 10.0, threads: int = 8, jetstream: bool = False, token: str = "",
                 max_submit_samples: int = 1 << 16, max_pending: int = 4096, max_fetches: int = 4,
                 weights_dir: str = "", poll_s: float = 1.0, session_lease_s: float = SESSION_LEASE_S,
                 reply_bytes: int = REPLY_BYTES):
        self.engine, self.holder = engine, holder
        self.reply_bytes = reply_bytes
        self.generator = generator_lib.Generator(engine, holder).start()
        self.instance = uuid.uuid4().hex
        self.fingerprint = fingerprint or {}
        self.resend_s = resend_s
        self.max_submit_samples, self.max_pending = max_submit_samples, max_pending
        self._fetch_slots = threading.BoundedSemaphore(max_fetches)
        abstract = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(engine.cfg, jax.random.key(0))))
        self._keys, self._avals, self._treedef = _leaf_keys(abstract)
        self._shapes = {k: a.shape for k, a in zip(self._keys, self._avals)}
        self._completed: dict[int, list] = {}  # group id -> [GroupResult, time sent or None]
        self._session = None  # the trainer whose groups are being served (group ids are per session)
        self._holder, self._holder_seen = None, 0.0  # the session holding the replica, its last call
        self.session_lease_s = session_lease_s
        self._weights_session = None  # the trainer whose pushes set the version (versions only go up within it)
        self._lock = threading.Lock()
        self._weights_lock = threading.Lock()  # one weight update at a time (push or directory)
        self._stopped = threading.Event()
        handlers = {
            "Health": grpc.unary_unary_rpc_method_handler(guarded("Health", self._health)),
            "Submit": grpc.unary_unary_rpc_method_handler(guarded("Submit", self._submit)),
            "Fetch": grpc.unary_unary_rpc_method_handler(guarded("Fetch", self._fetch)),
            "PushWeights": grpc.stream_unary_rpc_method_handler(guarded("PushWeights", self._push_weights)),
        }
        services = [grpc.method_handlers_generic_handler(SERVICE, handlers)]
        if jetstream:
            from rl_scaling.serving import jetstream_service  # it builds on this module

            services.append(jetstream_service.Orchestrator(self).service())
        interceptors = [TokenCheck(token)] if token else []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=SERVER_OPTIONS,
                                   interceptors=interceptors)
        self._server.add_generic_rpc_handlers(services)
        where = bind_address(host, port)
        try:
            self.port = self._server.add_insecure_port(where)
        except RuntimeError as e:  # grpc raises on a failed bind (older versions return 0)
            self.port, why = 0, str(e)
        else:
            why = ""
        if not self.port:
            self.generator.stop()
            raise OSError(f"rollout server: cannot bind {where}: the port is in use (another launch/serve.py?) "
                          f"or the address is not on this host{' (' + why + ')' if why else ''}")
        self.address = bind_address(host, self.port)
        self.weights_dir, self.poll_s = weights_dir, poll_s
        self._poller = threading.Thread(target=self._poll_weights, name="weights-dir-poller", daemon=True)

    def start(self):
        self._server.start()
        if self.weights_dir:
            self._poller.start()
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
        if self._poller.is_alive():
            self._poller.join(self.poll_s + 5)

    def wait(self, poll_s: float = 0.5) -> str:
        """Block until stopped or the generator fails; returns the error text ("" if none)."""
        while not self._stopped.is_set():
            err = self.error()
            if err:
                return err
            time.sleep(poll_s)
        return ""

    # ---- sessions and weights ----------------------------------------------------------
    def _hold(self, session: str) -> None:
        """`session` calls: it holds the replica (taking it over when free), or is refused while
        another session holds it (FAILED_PRECONDITION naming the holder)."""
        now = time.monotonic()
        with self._lock:
            if self._holder is not None and self._holder != session:
                idle = now - self._holder_seen
                if idle < self.session_lease_s:
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"this replica serves trainer session {self._holder} (last call {idle:.0f} s ago); "
                                  "one trainer at a time: stop that trainer (or give each trainer its own replicas), "
                                  f"or retry {self.session_lease_s - idle:.0f} s after its last call")
                log.warning("trainer session %s silent for %.0f s: session %s takes the replica over",
                            self._holder[:8], idle, session[:8])
            self._holder, self._holder_seen = session, now
            self._join_session(session)

    def _release(self, session: str) -> None:
        with self._lock:
            if self._holder == session:
                self._holder = None
                log.info("trainer session %s released the replica", session[:8])

    def _join_session(self, session: str) -> None:
        """Called with self._lock held: a new trainer drops the old one's work, results and versions."""
        if session == self._session:
            return
        if self._session is not None:
            log.info("new trainer session %s: dropping the previous session's groups", session[:8])
        self._session = session
        self.generator.reset()
        self._completed.clear()

    def _set_weights(self, arrays: dict, version: int, session: str | None = None) -> None:
        """Called with self._weights_lock held. `session`: the pushing trainer's (None: the directory)."""
        missing = [k for k in self._keys if k not in arrays]
        if missing:
            raise BadRequest(f"weight push has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if not 0 <= version <= MAX_VERSION:
            raise BadRequest(f"weight version {version} is out of range 0..{MAX_VERSION} (each token's version is "
                             "recorded as int32)")
        if session is not None:  # a push: every leaf must be finite (the directory is the trainer's own files)
            for key in self._keys:
                a = arrays[key]
                if np.issubdtype(a.dtype, np.inexact) or a.dtype.kind == "V" or "float" in str(a.dtype):
                    bad = ~np.isfinite(a.astype(np.float32) if a.dtype.itemsize < 4 else a)
                    if bad.any():
                        raise BadRequest(f"weight push: leaf {key} has {int(bad.sum())} non-finite values "
                                         f"(NaN or inf); the replica keeps version {self.holder.version}")
        new_session = session is not None and session != self._weights_session
        if version < self.holder.version and not new_session:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"weight version {version} is older than the server's {self.holder.version}; refused")
        if new_session:  # a new trainer (e.g. resumed from an older checkpoint): its versions start afresh
            self.holder.restart()
            self._weights_session = session
        # weights in rollout.push_dtype take the engine's own dtypes here (bfloat16 -> float32 is exact)
        leaves = [arrays[key].astype(aval.dtype) for key, aval in zip(self._keys, self._avals)]
        self.holder.set(jax.tree_util.tree_unflatten(self._treedef, leaves), int(version))

    def _restore_target(self):
        """The params' avals on the engine's shardings: the directory channel restores into them
        (each device reads its own slices, cast to the engine's dtypes)."""
        shardings = getattr(self.holder, "shardings", None)
        if shardings is None:
            shardings = jax.tree_util.tree_unflatten(
                self._treedef, [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * len(self._avals))
        return jax.tree_util.tree_unflatten(self._treedef, [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
            for a, sh in zip(self._avals, jax.tree_util.tree_leaves(shardings))])

    def _poll_weights(self):
        """The directory channel: load each new version the trainer writes (weights_dir.py)."""
        while not self._stopped.wait(self.poll_s):
            try:
                version = weights_dir_lib.latest(self.weights_dir)
                if version > self.holder.version:
                    _, arrays = weights_dir_lib.read(self.weights_dir, version, self._restore_target())
                    with self._weights_lock:
                        if version > self.holder.version:
                            self._set_weights(arrays, version)
                            log.info("weights version %d from %s", version, self.weights_dir)
            except Exception as e:  # noqa: BLE001 - a version being replaced, a bucket hiccup: try again
                log.warning("reading weights from %s: %s: %s", self.weights_dir, type(e).__name__, e)

    # ---- handlers --------------------------------------------------------------------
    def _stats(self):
        return {**self.generator.stats(), "pending": self.generator.pending()}

    def _health(self, request: bytes, context) -> bytes:
        meta, _ = unpack(request)  # a trainer's probe names its session; a monitor's names none
        if "session" in meta:
            session = field(meta, "session", str)
            if meta.get("release"):
                self._release(session)
            else:
                self._hold(session)
        return pack({"session": self._holder or "", "instance": self.instance, "live": self.generator.alive and not self.error(),
                     "error": self.error(), "version": self.holder.version, "fingerprint": self.fingerprint,
                     "devices": len(self.engine.mesh.devices.flat), "stats": self._stats(),
                     "weights_dir": self.weights_dir})

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
        groups = field(meta, "groups", list)
        if len(groups) > self.max_submit_samples:
            raise BadRequest(f"Submit of {len(groups)} groups; at most max_submit_samples={self.max_submit_samples}")
        reqs = [self._group_request(g, arrays) for g in groups]  # all checked first
        total = sum(r.num_samples for r in reqs)
        if total > self.max_submit_samples:
            raise BadRequest(f"Submit of {total} samples; at most max_submit_samples={self.max_submit_samples}")
        self._hold(session)
        with self._lock:
            if self.generator.pending() + len(reqs) > self.max_pending:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.generator.pending()} groups queued; at most max_pending={self.max_pending}")
            self.generator.submit(reqs)
        return pack({"accepted": len(reqs), "instance": self.instance})

    def _fetch(self, request: bytes, context) -> bytes:
        meta, _ = unpack(request)
        if "session" in meta:
            self._hold(field(meta, "session", str))
        timeout = field(meta, "timeout", float) if "timeout" in meta else 0.0
        ack = field(meta, "ack", list) if "ack" in meta else []
        if not 0 <= timeout <= MAX_FETCH_S or not all(isinstance(g, int) and not isinstance(g, bool) for g in ack):
            raise BadRequest(f"timeout must be in [0, {MAX_FETCH_S}] and ack a list of group ids, "
                             f"got {timeout!r}, {str(ack)[:60]}")
        if not self._fetch_slots.acquire(blocking=False):
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent Fetch calls")
        try:
            return self._fetch_locked(ack, timeout)
        finally:
            self._fetch_slots.release()

    def _fetch_locked(self, ack, timeout) -> bytes:
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
            arrays, groups, size = {}, [], 0
            for gid in send:
                entry = self._completed[gid]
                group = result_arrays(entry[0], self.engine.cfg.num_experts)  # routing_<id> too when recorded
                size += sum(np.asarray(a).nbytes for a in group.values())
                if groups and size > self.reply_bytes:  # the rest go in the next reply, at once
                    break
                entry[1] = now
                groups.append({"id": gid})
                arrays.update(group)
        return pack({"groups": groups, "stats": self._stats(), "error": err, "instance": self.instance}, arrays)

    def _push_weights(self, request_iterator, context) -> bytes:
        session = dict(context.invocation_metadata() or ()).get(SESSION_METADATA, "")
        if not isinstance(session, str) or not session.strip():
            raise BadRequest(f"a weight push must carry the trainer's session id ({SESSION_METADATA} metadata)")
        self._hold(session)
        version, arrays = read_weight_chunks(request_iterator, self._shapes)
        with self._weights_lock:
            self._set_weights(arrays, int(version), session)
        return pack({"version": int(version), "instance": self.instance})


def serve(config, *, host: str = "127.0.0.1", port: int = 0, devices=None, jetstream: bool = False,
          params: str = "", token: str = "", weights_dir: str = "",
          session_lease_s: float = SESSION_LEASE_S) -> RolloutServer:
    """Build the engine a config describes and start serving it. Weights arrive by push (or from
    `weights_dir`), or start as version 0 from `params` (an Orbax params checkpoint or a Hugging
    Face directory)."""
    from rl_scaling import checkpoint, config as config_lib, tasks, train
    from rl_scaling.rollout import topology

    task = tasks.make_task(config.task, config.seed)
    gen_cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    engine, holder = topology.make_engine(config, gen_cfg, task.tokenizer, devices or jax.devices())
    if params:
        abstract = checkpoint.abstract_like(
            jax.eval_shape(lambda: nn.unbox(model_lib.init_params(gen_cfg, jax.random.key(0)))), engine.param_shardings)
        holder.set(train.load_start_params(params, gen_cfg, engine.mesh, abstract), 0)
        log.info("serving the weights in %s as version 0", params)
    return RolloutServer(engine, holder, host=host, port=port, fingerprint=fingerprint(config),
                         jetstream=jetstream, token=token, weights_dir=weights_dir,
                         session_lease_s=session_lease_s).start()
