"""PipelineRL-k: rollouts generated continuously, trained on as they arrive.

    trainer (main thread)                              generator (generator.Generator thread,
      next_batch():                                    in this process or in launch/serve.py)
        top up prompt groups (bounded: queue_size) --->  prefill once per group, G slots,
        <--- finished groups, every token tagged          generate with whatever weights
             with its policy version + log-prob           the holder has at each step
        select P groups, staleness <= k
      rl_step(...)
      push_weights(params, version) -------------------> swapped between two generate steps;
                                                         in-flight sequences keep their KV cache

Versions: the weights after `n` trainer steps are version n. A group's staleness when
the trainer consumes it is `trainer version - v_first` (v_first: the oldest version that
produced one of its first tokens); it never exceeds k = rollout.max_staleness:
  stale_policy="wait": groups are consumed in submission order (the trainer waits for the
      oldest), new prompts are admitted only at a step start and at most (k+1)*P groups
      are outstanding, so no group can get older than k: nothing is dropped.
  stale_policy="drop": new prompts are admitted whenever fewer than queue_size groups are
      outstanding; ready groups are consumed oldest-first and a group older than k is
      dropped (counted in rollout/dropped_groups) -- the trainer then waits for fresh data.
A group (the G samples of one prompt) always arrives whole, so advantages are per prompt;
a step trains on exactly P whole groups or raises: never on partial data.

Topologies (topology.py builds the one a config asks for): the engine in this process (`EmbeddedBackend`; with rollout.engine_devices=n
it gets the last n devices to itself and the trainer's mesh the rest, otherwise it shares
the trainer's first device and its computations queue behind the trainer's), or M engine
replicas, each a `launch/serve.py` process on its own devices or slice (`client.RemoteBackend`,
rollout.servers; failover between them). With several trainer processes (jax.distributed),
process 0 drives the pipeline and every other process gets each batch from it
(multihost.BroadcastPipeline): all see the same global batch and feed their own rows.

Faults: a trainer that waits logs what it waits for every `wait_log_s` (30 s): the groups it
needs, those outstanding, and the backend's account of them (each replica's state and groups in
flight). Every wait polls the backend's health at least every 0.1 s; a dead generator
thread, engine or server raises `RolloutError` naming it (a remote backend first tries
to reconnect for rollout.reconnect_s); a generator alive but stuck for `stall_s` raises
too. `close()` stops the threads; it also runs at interpreter exit (Ctrl-C included)
for pipelines left open.

Layout: the engine is built on the generator mesh `config.tpu.gen_mesh` describes, over the
engine's devices (`engine.generator_mesh`, `engine.generator_layout`: the same shardings the dry
run compiles generation with), in this process and in every `launch/serve.py` replica.

Routing replay (rl.routing_replay="r3", MoE): the engines record each token's experts per layer
(generator.GroupResult.routing) and a batch carries them as the sync sampler does
(`out.routing_BSLK` [P*G, max_prompt_len + T, n_layers, k], prompt columns left-padded); a group
that arrives without them, or with another shape, is a RolloutError.

Resume: the prompt stream is pulled ahead of training. `resume_state()` (saved with each
checkpoint) is the stream's state before the oldest prompt not yet trained on, plus the
prompts after it that were (to skip when the stream is replayed): groups in flight at the
checkpoint are regenerated after a resume, so a resumed run sees every prompt of the stream.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
import time
import weakref
from typing import NamedTuple

import numpy as np

from rl_scaling.rollout import sampler
from rl_scaling.rollout.errors import RolloutError

log = logging.getLogger(__name__)

STALE_POLICIES = ("wait", "drop")

class WaitInterrupted(Exception):
    """A signal arrived while the trainer waited for rollouts (Pipeline.interrupted said so): the caller
    saves its last finished step instead of waiting on."""


class StepData(NamedTuple):
    prompt_tokens: np.ndarray  # [P*G, max_prompt_len] left-padded, as collect.generate returns
    prompt_mask: np.ndarray
    out: sampler.Samples  # completions, float32 generator log-probs, lengths, truncation
    rewards: np.ndarray  # [P*G]
    metrics: dict  # rollout/* scalars for the metrics writer
    sample_ids: np.ndarray  # [P*G] group_id * G + sample index: unique over a run
    v_first: np.ndarray  # [P*G] policy version of each sample's first token
    v_last: np.ndarray  # [P*G] policy version of each sample's last token
    staleness: np.ndarray  # [P*G] trainer version - v_first
    dropped: tuple = ((), ())  # (prompt, completion) lengths of the samples dropped as too stale since the last batch


class EmbeddedBackend:
    """The engine and its generator thread in this process (the tiny run's default)."""

    devices = 0  # accelerators beyond jax.devices() (the engine's are among them, already counted)

    def __init__(self, engine, holder):
        from rl_scaling.rollout import generator as generator_lib

        self.engine, self.holder = engine, holder
        self.generator = generator_lib.Generator(engine, holder).start()

    def submit(self, requests):
        self.generator.submit(requests)

    def poll(self, timeout: float):
        out = []
        try:
            out.append(self.generator.results.get(timeout=timeout) if timeout > 0 else self.generator.results.get_nowait())
            while True:
                out.append(self.generator.results.get_nowait())
        except queue.Empty:
            pass
        return out

    def push_weights(self, params, version: int):
        self.holder.set(params, version)

    def check(self):
        try:
            self.generator.check()
        except RuntimeError as e:
            raise RolloutError(f"embedded rollout engine: {e}") from self.generator.error

    def stats(self) -> dict:
        return self.generator.stats()

    def close(self):
        self.generator.stop()


_OPEN: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


def close_all():
    for p in list(_OPEN):
        p.close()


atexit.register(close_all)


class Pipeline:
    def __init__(self, backend, task, stream, *, prompts_per_step: int, samples_per_prompt: int,
                 max_prompt_len: int, max_new_tokens: int, max_staleness: int, stale_policy: str = "wait",
                 queue_size: int = 0, poll_s: float = 0.1, stall_s: float = 600.0, skip_prompts: dict | None = None,
                 routing_shape: tuple | None = None, wait_log_s: float = 30.0):
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"config.rollout.stale_policy={stale_policy!r} is not valid; choose one of {STALE_POLICIES}")
        if max_staleness < 0:
            raise ValueError(f"config.rollout.max_staleness must be >= 0, got {max_staleness}")
        self.backend, self.task, self.tok, self.stream = backend, task, task.tokenizer, stream
        self.P, self.G, self.k = prompts_per_step, samples_per_prompt, max_staleness
        self.max_prompt_len, self.T = max_prompt_len, max_new_tokens
        self.policy, self.poll_s, self.stall_s = stale_policy, poll_s, stall_s
        self.routing_shape = None if routing_shape is None else tuple(routing_shape)  # (n_layers, k) under r3
        self.wait_log_s = wait_log_s
        self.interrupted = None  # () -> bool, polled while waiting: True raises WaitInterrupted (a preemption)
        cap = queue_size or 2 * self.P
        if cap < self.P:
            raise ValueError(f"config.rollout.queue_size={queue_size} must be at least prompts_per_step={self.P} (or 0: auto)")
        if stale_policy == "wait":
            cap = min(cap, (self.k + 1) * self.P)
        self.capacity = cap
        self.version = -1
        self._problems = collections.deque()  # (serial, problem) pulled from the stream, not yet submitted
        self._serial = 0  # problems pulled from the stream so far (after skips)
        self._serial_of: dict[int, int] = {}  # outstanding group id -> serial of its problem
        self._pulls = collections.deque()  # (stream state before a pull, first serial, [prompts]) still needed
        self._skip = collections.Counter(skip_prompts or {})  # prompts already trained on before a resume
        self._outstanding: dict[int, object] = {}  # group id -> problem, submitted, not consumed/dropped
        self._order = collections.deque()  # outstanding group ids in submission order
        self._ready: dict = {}  # group id -> GroupResult
        self._next_gid = 0
        self.counts = collections.Counter()
        self._dropped_lengths = []  # (prompt, completion) lengths of dropped groups, until the next batch
        self.staleness_hist = np.zeros(self.k + 1, np.int64)  # samples trained on, by staleness
        self.trainer_wait_s = 0.0
        self._t_prev = None
        self._gen_prev = None
        self._closed = False
        self._lock = threading.Lock()
        _OPEN.add(self)

    @property
    def devices(self) -> int:
        return getattr(self.backend, "devices", 0)

    # ---- weights ---------------------------------------------------------------------
    def push_weights(self, params, version: int) -> None:
        """After each trainer step: the generators use these weights from their next step on."""
        self.backend.push_weights(params, int(version))
        self.version = int(version)

    # ---- prompts in ------------------------------------------------------------------
    def _top_up(self):
        requests = []
        from rl_scaling.rollout.generator import GroupRequest

        while len(self._outstanding) < self.capacity:
            if not self._problems:
                self._pull()
                continue
            serial, problem = self._problems.popleft()
            ids = np.asarray(self.tok.encode(problem.prompt), np.int32)
            if len(ids) > self.max_prompt_len:
                raise ValueError(f"prompt has {len(ids)} tokens, more than config.task.max_prompt_len="
                                 f"{self.max_prompt_len}: {problem.prompt[:80]!r}")
            gid = self._next_gid
            self._next_gid += 1
            self._outstanding[gid] = problem
            self._serial_of[gid] = serial
            self._order.append(gid)
            requests.append(GroupRequest(gid, ids, self.G, min_version=max(self.version, 0)))
        if requests:
            self.backend.submit(requests)
            self.counts["submitted"] += len(requests)

    def _pull(self):
        state = self.stream.get_state() if hasattr(self.stream, "get_state") else None
        entries = []  # (prompt, serial); serial None: skipped, trained on before the checkpoint resumed from
        for problem in next(self.stream):
            if self._skip[problem.prompt] > 0:
                self._skip[problem.prompt] -= 1
                entries.append((problem.prompt, None))
                continue
            entries.append((problem.prompt, self._serial))
            self._problems.append((self._serial, problem))
            self._serial += 1
        self._pulls.append((state, entries))
        self._trim_pulls(self._pending_serials())

    def _pending_serials(self) -> set:
        return set(self._serial_of.values()) | {s for s, _ in self._problems}

    def _trim_pulls(self, pending):
        """Forget pulls before the oldest one that still has a prompt not trained on."""
        while len(self._pulls) > 1 and not any(s in pending for _, s in self._pulls[0][1] if s is not None):
            self._pulls.popleft()

    def resume_state(self) -> dict:
        """{"stream": state to replay from, "skip": {prompt: count}}: replaying the stream from
        `stream` and skipping `skip` gives exactly the prompts not yet trained on (nor dropped)."""
        pending = self._pending_serials()
        self._trim_pulls(pending)
        if not self._pulls:
            return {"stream": self.stream.get_state() if hasattr(self.stream, "get_state") else None, "skip": {}}
        skip = collections.Counter(prompt for _, entries in self._pulls for prompt, s in entries
                                   if s is None or s not in pending)
        return {"stream": self._pulls[0][0], "skip": dict(skip)}

    def _receive(self, timeout: float):
        for r in self.backend.poll(timeout):
            if r.group_id not in self._outstanding or r.group_id in self._ready:
                self.counts["duplicates"] += 1  # e.g. re-sent after a reconnect; never trained twice
                continue
            if r.tokens.shape != (self.G, self.T):
                raise RolloutError(f"group {r.group_id} came back with shape {r.tokens.shape}, expected {(self.G, self.T)}: "
                                   "the rollout server's config does not match the trainer's")
            if self.routing_shape is not None:
                want = (self.G, len(r.prompt) + self.T) + self.routing_shape
                got = None if getattr(r, "routing", None) is None else np.shape(r.routing)
                if got != want:
                    raise RolloutError(f"group {r.group_id} came back with routing of shape {got}, expected {want} "
                                       "(rl.routing_replay='r3' needs each token's experts per layer from the engine)")
            self._ready[r.group_id] = r

    def _drop(self, gid):
        r = self._ready.pop(gid, None)
        if r is not None:  # generated, then found too stale: its compute was spent all the same
            self._dropped_lengths.append((np.full(len(r.lengths), len(r.prompt)), np.asarray(r.lengths)))
        self._outstanding.pop(gid)
        self._serial_of.pop(gid)
        self._order.remove(gid)
        self.counts["dropped"] += 1

    def _select(self):
        """P group ids to train on now, or None to wait for more."""
        for gid in [g for g, r in self._ready.items() if self.version - r.v_first > self.k]:
            self._drop(gid)  # too old (only possible with stale_policy="drop", or a remote lag)
        if self.policy == "wait":
            head = [self._order[i] for i in range(min(self.P, len(self._order)))]
            return head if len(head) == self.P and all(g in self._ready for g in head) else None
        if len(self._ready) < self.P:
            return None
        return sorted(self._ready, key=lambda g: (self._ready[g].v_first, g))[: self.P]

    # ---- batches out -----------------------------------------------------------------
    def next_batch(self) -> StepData:
        """The next P whole groups (P*G samples), each at most k versions old."""
        if self.version < 0:
            raise RolloutError("push_weights(params, version) must be called before next_batch()")
        t_call = time.perf_counter()
        self._receive(0.0)
        queue_depth = len(self._ready)  # groups ready before any waiting
        self._top_up()
        chosen = None
        next_log = time.perf_counter() + self.wait_log_s
        while chosen is None:
            if self.interrupted is not None and self.interrupted():
                raise WaitInterrupted(f"a signal arrived after {time.perf_counter() - t_call:.0f} s of waiting for "
                                      f"{len(self._outstanding)} outstanding prompt groups")
            if time.perf_counter() >= next_log:
                next_log += self.wait_log_s
                self._log_wait(time.perf_counter() - t_call)
            self.backend.check()
            stalled = self.backend.stats().get("stalled_s", 0.0)
            if stalled > self.stall_s:  # alive but stuck (a hang, not a crash)
                raise RolloutError(f"the rollout generator made no progress for {stalled:.0f} s "
                                   f"with {len(self._outstanding)} prompt groups outstanding")
            self._receive(0.0)
            chosen = self._select()
            if chosen is None:
                if self.policy == "drop":
                    self._top_up()
                self._receive(self.poll_s)
                chosen = self._select()
        t_ready = time.perf_counter()
        data = self._assemble(chosen, queue_depth, t_call, t_ready)
        for gid in chosen:
            self._ready.pop(gid)
            self._outstanding.pop(gid)
            self._serial_of.pop(gid)
            self._order.remove(gid)
        self.counts["consumed"] += len(chosen)
        return data

    def _log_wait(self, waited: float) -> None:
        head = [g for g in list(self._order)[: self.P] if g not in self._ready]
        what = (f"groups {head[:8]}{' ...' if len(head) > 8 else ''} (the oldest, in order)" if self.policy == "wait"
                else f"{self.P - len(self._ready)} more groups")
        backend = self.backend.waiting() if hasattr(self.backend, "waiting") else \
            ", ".join(f"{k} {v:.0f}" for k, v in self.backend.stats().items() if isinstance(v, (int, float)))
        log.info("trainer at version %d has waited %.0f s for %s; %d groups ready, %d outstanding; %s",
                 self.version, waited, what, len(self._ready), len(self._outstanding), backend)

    def _assemble(self, gids, queue_depth, t_call, t_ready) -> StepData:
        P, G, T, L = self.P, self.G, self.T, self.max_prompt_len
        N = P * G
        prompt_tokens = np.full((N, L), self.tok.pad_id, np.int32)
        prompt_mask = np.zeros((N, L), bool)
        tokens = np.empty((N, T), np.int32)
        forced = np.empty((N, T), bool)
        logprobs = np.empty((N, T), np.float32)
        versions = np.empty((N, T), np.int32)
        lengths = np.empty((N,), np.int32)
        stopped = np.empty((N,), bool)
        rewards = np.empty((N,), np.float32)
        ids = np.empty((N,), np.int64)
        routing = None if self.routing_shape is None else np.zeros((N, L + T) + self.routing_shape, np.int32)
        for i, gid in enumerate(gids):
            r, problem = self._ready[gid], self._outstanding[gid]
            rows = slice(i * G, (i + 1) * G)
            n = len(r.prompt)
            prompt_tokens[rows, L - n:] = r.prompt
            prompt_mask[rows, L - n:] = True
            tokens[rows], logprobs[rows], versions[rows], forced[rows] = r.tokens, r.logprobs, r.versions, r.forced
            lengths[rows], stopped[rows] = r.lengths, r.stopped
            ids[rows] = gid * G + np.arange(G)
            if routing is not None:  # the prompt's columns left-padded, as its tokens
                routing[rows, L - n:] = r.routing
            for j in range(G):
                response = self.tok.decode(r.tokens[j, : r.lengths[j]])
                rewards[i * G + j] = self.task.reward(response, problem)
        v_first = versions[:, 0]
        v_last = versions[np.arange(N), lengths - 1]
        staleness = self.version - v_first
        if staleness.max() > self.k or v_first.min() < 0:
            raise RolloutError(f"internal error: staleness {staleness.max()} > k={self.k}")
        hist = np.bincount(staleness, minlength=self.k + 1)[: self.k + 1]
        self.staleness_hist += hist
        out = sampler.Samples(tokens, logprobs, forced, lengths, ~stopped, forced.any(axis=1), routing)

        wait = t_ready - t_call
        self.trainer_wait_s += wait
        now = time.perf_counter()
        gen = self.backend.stats()
        metrics = {
            "time/rollout_s": wait,
            "rollout/staleness_mean": float(staleness.mean()),
            "rollout/staleness_max": float(staleness.max()),
            "rollout/version_span_mean": float((v_last - v_first).mean()),
            "rollout/queue_depth": float(queue_depth),
            "rollout/outstanding": float(len(self._outstanding)),
            "rollout/dropped_groups": float(self.counts["dropped"]),
            "rollout/duplicates": float(self.counts["duplicates"]),
            **{f"rollout/staleness_{s}": float(c) for s, c in enumerate(hist)},
            **(self.backend.metrics() if hasattr(self.backend, "metrics") else {}),
        }
        if self._t_prev is not None:
            metrics["rollout/trainer_idle_frac"] = wait / max(now - self._t_prev, 1e-9)
            d = {k: max(gen[k] - self._gen_prev[k], 0) for k in ("busy_s", "idle_s", "steps", "slot_steps")}
            metrics["rollout/gen_idle_frac"] = d["idle_s"] / max(d["busy_s"] + d["idle_s"], 1e-9)
            metrics["rollout/slot_occupancy"] = d["slot_steps"] / max(d["steps"] * gen["slots"], 1)
        self._t_prev, self._gen_prev = now, gen
        dropped = tuple(np.concatenate(x) for x in zip(*self._dropped_lengths)) if self._dropped_lengths else ((), ())
        self._dropped_lengths = []
        return StepData(prompt_tokens, prompt_mask, out, rewards, metrics, ids, v_first, v_last, staleness, dropped)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.backend.close()
        finally:
            _OPEN.discard(self)
