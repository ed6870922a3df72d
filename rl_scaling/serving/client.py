"""The trainer's side of the rollout service: one pipeline backend over M engine replicas
(`launch/serve.py` processes, --config.rollout.servers=HOST:PORT,HOST:PORT,...).

Dispatch: each new prompt group goes to the live replica with the fewest samples outstanding;
results are fetched from every live replica. Weights go to every replica after each step (a
gRPC push, in parallel), or are written once to `weights_dir` for the replicas to poll. Either
way they are first cast on device to `push_dtype` (wire.cast_for_push: bfloat16 halves the
bytes; the LM head stays float32 with fp32_lm_head). The gRPC push needs host bytes: one host
copy of the cast params, kept for replicas that rejoin. The directory is written by Orbax from
the device arrays (weights_dir.py): no host copy of the whole tree.

Failover: a replica whose RPC fails (its process died, its host is unreachable, its engine
reports a failure) is marked dead with a logged warning; its groups in flight are re-dispatched
to the live ones (rollout/failovers, rollout/redispatched_groups). A dead replica is probed
every `probe_s`; when it answers again (restarted or back on the network) it gets the current
weights and new groups (rollout/rejoins). Probes run on their own threads, off the trainer's
step path: a replica that is stopped but still accepts connections costs the step its failover
(one RPC timeout) once, never a probe's timeout on every poll. With no replica left for `reconnect_s` the trainer
stops with a RolloutError naming every address; the last checkpoint is intact. A group is never
lost (it stays outstanding until some replica returns it) and never trained twice (the
pipeline drops results whose id it has already received).

Errors that retrying cannot fix (a different config on the server, a wrong token, a request
refused as malformed, a replica held by another trainer session) raise at once.

Sessions: each backend is one trainer session (a random id sent with every Health, Submit,
Fetch and PushWeights). A replica serves one session at a time (server.py): a second trainer
pointed at a replica that another one holds is refused at connect with FAILED_PRECONDITION
naming the holder; `close()` releases the replicas so a resumed trainer takes them at once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
import uuid
from concurrent import futures

import grpc
import jax
import numpy as np

from rl_scaling.serving import weights_dir as weights_dir_lib
from rl_scaling.rollout.errors import RolloutError
from rl_scaling.serving.wire import (OPTIONS, SERVICE, TOKEN_METADATA, BadRequest, cast_for_push, check_push_dtype,
                                     pack, read_result, unpack, weight_chunks)

log = logging.getLogger(__name__)

SESSION_METADATA = "x-rl-scaling-session"
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# a restarted replica is found within a second, not after gRPC's default backoff of up to 2 minutes
_CHANNEL_OPTIONS = OPTIONS + [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                              ("grpc.max_reconnect_backoff_ms", 1000)]


class ReplicaDown(Exception):
    """One replica failed in a way another replica can make up for."""


def parse_servers(servers) -> list[str]:
    """'HOST:PORT,HOST:PORT' (or a list) -> addresses, checked."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out = [s.strip() for s in items if s.strip()]
    for s in out:
        host, _, port = s.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"config.rollout.servers: {s!r} is not HOST:PORT")
    if len(set(out)) != len(out):
        raise ValueError(f"config.rollout.servers names a replica twice: {out}")
    return out


@dataclasses.dataclass
class Replica:
    address: str
    channel: grpc.Channel
    rpc: dict
    live: bool = False
    instance: str | None = None
    devices: int = 0
    outstanding: dict = dataclasses.field(default_factory=dict)  # group id -> GroupRequest
    ack: list = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)
    next_probe: float = 0.0
    last_error: str = ""

    def load(self) -> int:
        return sum(r.num_samples for r in self.outstanding.values())


class RemoteBackend:
    """The pipeline backend interface (see pipeline.EmbeddedBackend) over one or more replicas."""

    def __init__(self, servers, *, expected: dict | None = None, reconnect_s: float = 10.0,
                 rpc_timeout_s: float = 10.0, token: str = "", weights_dir: str = "", probe_s: float = 0.5,
                 push_dtype: str = "", fp32_lm_head: bool = True, tie_embeddings: bool = False,
                 routing: tuple | None = None):
        self.addresses = parse_servers(servers)
        self.routing = routing  # (n_layers, k, num_experts): each group's routing_<id> is required and checked
        self.push_dtype = check_push_dtype(push_dtype)
        self._keep_f32 = {"fp32_lm_head": fp32_lm_head, "tie_embeddings": tie_embeddings}
        if not self.addresses:
            raise ValueError("config.rollout.servers is empty")
        self.expected, self.reconnect_s, self.rpc_timeout_s = expected, reconnect_s, rpc_timeout_s
        self.weights_dir, self.probe_s = weights_dir, probe_s
        self.session = uuid.uuid4().hex
        self._metadata = ((TOKEN_METADATA, token),) if token else ()
        self.replicas = [self._replica(a) for a in self.addresses]
        self._unassigned: collections.OrderedDict = collections.OrderedDict()  # groups waiting for a live replica
        self._latest = None  # (host params, version): what a rejoining replica gets
        self._pool = futures.ThreadPoolExecutor(max_workers=len(self.replicas))
        self._probe_pool = futures.ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="replica-probe")
        self._probes: dict = {}  # address -> the Future of a probe in flight (_probe_in_background)
        self.counts = collections.Counter()
        self._all_dead_since = time.monotonic()
        deadline = time.monotonic() + reconnect_s
        while not any(r.live for r in self.replicas):
            for r in self.replicas:
                self._probe(r)
            if any(r.live for r in self.replicas):
                break
            if time.monotonic() >= deadline:
                self.close()
                raise RolloutError(f"rollout server{'s' if len(self.replicas) > 1 else ''} {self._names()} not "
                                   f"reachable within {reconnect_s:.0f} s ({self._last_errors()}); start them with "
                                   "`python launch/serve.py --config=... --port=...`")
            time.sleep(0.2)
        self._all_dead_since = None

    @property
    def address(self) -> str:
        return self.addresses[0] if len(self.addresses) == 1 else ",".join(self.addresses)

    @property
    def devices(self) -> int:
        return sum(r.devices for r in self.replicas)

    def _names(self) -> str:
        return ", ".join(self.addresses)

    def _last_errors(self) -> str:
        return "; ".join(f"{r.address}: {r.last_error}" for r in self.replicas if r.last_error) or "no answer"

    def _replica(self, address) -> Replica:
        channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        ident = lambda b: b  # noqa: E731 - messages are already bytes
        rpc = {name: channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=ident, response_deserializer=ident)
               for name in ("Health", "Submit", "Fetch")}
        rpc["PushWeights"] = channel.stream_unary(f"/{SERVICE}/PushWeights", request_serializer=ident,
                                                  response_deserializer=ident)
        return Replica(address, channel, rpc)

    # ---- one replica's RPCs: grpc errors -> ReplicaDown (retry elsewhere) or RolloutError --------
    def _rpc(self, r: Replica, name: str, request, timeout: float, extra=()):
        try:
            return r.rpc[name](request, timeout=timeout, metadata=self._metadata + tuple(extra))
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise ReplicaDown(f"{e.code().name}: {e.details()}") from None
            hint = " (set the same RL_SCALING_ROLLOUT_TOKEN or rollout.token_file as the server)" \
                if e.code() == grpc.StatusCode.UNAUTHENTICATED else ""
            raise RolloutError(f"rollout server {r.address}: {name}: {e.code().name}: {e.details()}{hint}") from None

    def _push_to(self, r: Replica, latest=None):
        latest = latest or self._latest
        if latest is None or self.weights_dir:
            return  # nothing yet, or the replica polls the directory
        host, version = latest
        nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(host))
        self._rpc(r, "PushWeights", weight_chunks(host, version), self.rpc_timeout_s + nbytes / 100e6,  # >= 100 MB/s
                  ((SESSION_METADATA, self.session),))

    def _submit_to(self, r: Replica, requests):
        meta = {"session": self.session, "groups": [{"id": q.group_id, "num_samples": q.num_samples,
                                                     "min_version": q.min_version} for q in requests]}
        arrays = {f"prompt_{q.group_id}": np.asarray(q.prompt, np.int32) for q in requests}
        self._rpc(r, "Submit", pack(meta, arrays), self.rpc_timeout_s)
        for q in requests:
            r.outstanding[q.group_id] = q

    def _health(self, r: Replica):
        """A dead (or not yet seen) replica's probe: (its Health reply, the version pushed to it). Raises
        ReplicaDown (still dead) or RolloutError (another config, a wrong token, another session). Touches
        no backend state, so it may run on a probe thread."""
        meta, _ = unpack(self._rpc(r, "Health", pack({"session": self.session}), 2.0))
        if meta["error"]:
            raise ReplicaDown(f"reports a failure: {meta['error'].splitlines()[0]}")
        if self.expected is not None and meta["fingerprint"] != json.loads(json.dumps(self.expected)):
            raise RolloutError(f"rollout server {r.address} runs a different config: server {meta['fingerprint']} "
                               f"vs trainer {self.expected}")
        latest = self._latest
        self._push_to(r, latest)
        return meta, None if latest is None else latest[1]

    def _joined(self, r: Replica, meta: dict, pushed) -> None:
        """A probe answered: the replica is live again, unless the weights moved on meanwhile."""
        if not self.weights_dir and self._latest is not None and pushed != self._latest[1]:
            r.next_probe = 0.0  # pushed an older version while the trainer stepped: probe and push again
            return
        back = r.instance is not None
        r.instance, r.devices, r.ack, r.stats = meta["instance"], int(meta["devices"]), [], meta["stats"]
        r.live, r.last_error = True, ""
        self._all_dead_since = None
        if back:
            self.counts["rejoins"] += 1
            log.warning("rollout server %s is back (instance %s): it has the current weights and takes new groups",
                        r.address, r.instance[:8])

    def _probe(self, r: Replica) -> None:
        """Probe a dead (or not yet seen) replica now, in this thread (at connect)."""
        r.next_probe = time.monotonic() + self.probe_s
        try:
            meta, pushed = self._health(r)
        except ReplicaDown as e:
            r.last_error = str(e)
            return
        self._joined(r, meta, pushed)

    def _probe_in_background(self, now: float) -> None:
        """Start a probe of each dead replica that is due, and take in those that finished."""
        for r in self.replicas:
            f = self._probes.get(r.address)
            if f is not None and f.done():
                del self._probes[r.address]
                self.counts["probes"] += 1
                try:
                    meta, pushed = f.result()  # a RolloutError raises here, in the trainer's thread
                except ReplicaDown as e:
                    r.last_error = str(e)
                else:
                    if not r.live:
                        self._joined(r, meta, pushed)
            elif f is None and not r.live and now >= r.next_probe:
                r.next_probe = now + self.probe_s  # the next one: probe_s after this one started, or later
                self._probes[r.address] = self._probe_pool.submit(self._health, r)

    def _fail(self, r: Replica, error: str) -> None:
        r.live, r.last_error = False, error
        r.next_probe = time.monotonic() + self.probe_s
        moved = list(r.outstanding.values())
        r.outstanding.clear()
        self.counts["failovers"] += 1
        self.counts["redispatched_groups"] += len(moved)
        live = [x.address for x in self.replicas if x.live]
        log.warning("rollout server %s lost (%s); re-dispatching its %d groups in flight to %s", r.address, error,
                    len(moved), ", ".join(live) or "the first replica back")
        for q in moved:
            self._unassigned[q.group_id] = q
        if not live and self._all_dead_since is None:
            self._all_dead_since = time.monotonic()

    def _dispatch(self) -> None:
        """Send every unassigned group to the least loaded live replica."""
        while self._unassigned:
            live = [r for r in self.replicas if r.live]
            if not live:
                return
            r = min(live, key=Replica.load)
            batch = list(self._unassigned.values())
            share = batch[: max(1, -(-len(batch) // len(live)))]
            try:
                self._submit_to(r, share)
            except ReplicaDown as e:
                self._fail(r, str(e))
                continue
            for q in share:
                del self._unassigned[q.group_id]

    def _maintain(self) -> None:
        self._probe_in_background(time.monotonic())
        self._dispatch()
        if self._all_dead_since is not None and time.monotonic() - self._all_dead_since > self.reconnect_s:
            plural = "s" if len(self.replicas) > 1 else ""
            raise RolloutError(
                f"rollout server{plural} {self._names()} lost for {self.reconnect_s:.0f} s ({self._last_errors()}); "
                "stopping. The last checkpoint is intact: restart launch/serve.py and re-run the same command "
                "to resume.")

    # ---- backend interface ---------------------------------------------------------------
    def submit(self, requests):
        for q in requests:
            self._unassigned[q.group_id] = q
        self._dispatch()

    def poll(self, timeout: float):
        self._maintain()
        live = [r for r in self.replicas if r.live]
        if not live:
            time.sleep(min(timeout, 0.1))
            return []
        per = timeout / len(live)
        out = []
        for r in live:
            try:
                reply = self._rpc(r, "Fetch", pack({"session": self.session, "ack": r.ack, "timeout": per}),
                                  per + self.rpc_timeout_s)
                meta, arrays = unpack(reply)
                if meta["instance"] != r.instance:
                    raise ReplicaDown(f"restarted (instance {meta['instance'][:8]}): its groups are gone")
                if meta["error"]:
                    raise ReplicaDown(f"reports a failure: {meta['error']}")
            except ReplicaDown as e:
                self._fail(r, str(e))
                continue
            r.stats, r.ack = meta["stats"], []
            for g in meta["groups"]:
                gid = g["id"]
                r.ack.append(gid)
                r.outstanding.pop(gid, None)
                try:
                    out.append(read_result(gid, arrays, self.routing))
                except BadRequest as e:  # BadRouting included: never reaches the trainer
                    raise RolloutError(f"rollout server {r.address}: Fetch: group {gid}: {e}") from e
        self._dispatch()
        return out

    def cast(self, params):
        """`params` as they go to the replicas (on device; see the module doc)."""
        return cast_for_push(params, self.push_dtype, **self._keep_f32)

    def push_weights(self, params, version: int):
        if isinstance(params, weights_dir_lib.Written):  # every trainer process wrote it (multihost.py)
            return
        params = self.cast(params)
        if self.weights_dir:  # written once, by Orbax from the device arrays; the replicas poll
            weights_dir_lib.write(self.weights_dir, params, version)
            return
        host = jax.device_get(params)  # a host copy: the trainer donates its params on the next step
        self._latest = (host, version)
        live = [r for r in self.replicas if r.live]
        for r, f in [(r, self._pool.submit(self._push_to, r)) for r in live]:
            try:
                f.result()
            except ReplicaDown as e:
                self._fail(r, str(e))
        self._maintain()

    def check(self):
        self._maintain()  # every poll also reports each replica's health

    def stats(self) -> dict:
        seen = [r.stats for r in self.replicas if r.stats]  # a dead replica's last counters still count
        live = [r.stats for r in self.replicas if r.live and r.stats] or [{}]
        out = {k: sum(s.get(k, 0) for s in seen) for k in ("busy_s", "idle_s", "steps", "slot_steps", "tokens")}
        out["slots"] = max(sum(s.get("slots", 0) for s in live), 1)
        out["stalled_s"] = min(s.get("stalled_s", 0.0) for s in live)  # stuck only if every replica is
        return out

    def waiting(self) -> str:
        """What the trainer waits on, replica by replica (logged while it waits)."""
        parts = []
        for r in self.replicas:
            state = "live" if r.live else f"down ({r.last_error or 'not seen yet'}; probed every {self.probe_s:g} s)"
            parts.append(f"{r.address} {state}, {len(r.outstanding)} groups in flight")
        if self._unassigned:
            parts.append(f"{len(self._unassigned)} groups waiting for a live replica")
        return "; ".join(parts)

    def metrics(self) -> dict:
        return {"rollout/replicas_live": float(sum(r.live for r in self.replicas)),
                **{f"rollout/{k}": float(self.counts[k]) for k in ("failovers", "redispatched_groups", "rejoins")}}

    def close(self):
        self._pool.shutdown(wait=False)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        for r in self.replicas:
            if r.live:  # hand the replica back: a resumed trainer (a new session) takes it at once
                try:
                    r.rpc["Health"](pack({"session": self.session, "release": True}), timeout=2.0,
                                    metadata=self._metadata)
                except grpc.RpcError as e:
                    log.info("rollout server %s: release: %s", r.address, e.code().name)
            r.channel.close()
