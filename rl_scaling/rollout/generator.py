"""The orchestrator loop over `engine.PolicyEngine`: prompt groups in, finished groups
(tokens, log-probs, policy versions) out.

Why our own orchestrator loop (`Generator`) instead of JetStream's `Driver`: the Driver
returns only token ids and text (no log-probs, no versions), SIGKILLs the whole process
when one of its threads raises (the trainer could not report the fault nor keep its
checkpoint clean), hangs the interpreter at exit without `stop()`, logs every step,
and runs four threads per engine that contend for the GIL with the trainer on small
hosts. `Generator` is one thread calling the same Engine API (prefill once per prompt
group, insert it into G slots, generate), returns whole groups with their log-probs and
versions, and stores any exception for the trainer to raise.

Routing (an engine with record_routing, for MoE routing replay r3): `GroupResult.routing` holds
each sample's experts per layer for every token of prompt + completion, [G, len(prompt) + T,
n_layers, k] int32: the prompt's tokens but the last from the group's prefill, the prompt's last
token and each generated token from the generate step that fed it. The last generated token is
never fed (its column, and those after the end, are 0): the trainer never replays it (it predicts
nothing that is trained on). Column for column the sync sampler's layout (Samples.routing_BSLK),
without the left padding.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
import traceback

import numpy as np

from rl_scaling.rollout.engine import PolicyEngine, WeightHolder, unpack

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GroupRequest:
    group_id: int
    prompt: np.ndarray  # int32 prompt tokens, no padding (BOS included if the task uses one)
    num_samples: int
    min_version: int = 0  # do not start before the engine has weights at least this new
    epoch: int = 0  # set by Generator.submit; results of an earlier epoch (before reset()) are dropped
    # A streamed group (a JetStream Decode): each token as (sample, token id) as it is generated, then
    # the GroupResult, go to this queue instead of `results`; reset() keeps it.
    stream: queue.SimpleQueue | None = None


@dataclasses.dataclass
class GroupResult:
    group_id: int
    prompt: np.ndarray
    tokens: np.ndarray  # [G, T] int32, pad after each sample's end
    logprobs: np.ndarray  # [G, T] float32, 0 after the end
    versions: np.ndarray  # [G, T] int32 policy version of each token, -1 after the end
    lengths: np.ndarray  # [G] generated tokens, stop token included
    stopped: np.ndarray  # [G] True: ended on a stop token (or its answer budget); False: ran out ("length")
    forced: np.ndarray  # [G, T] True where a token was injected (forced interruption), not sampled
    routing: np.ndarray | None = None  # [G, len(prompt) + T, n_layers, k] int32 experts (record_routing), else None

    @property
    def interrupted(self) -> np.ndarray:  # [G] the thinking budget was hit and the phrase injected
        return self.forced.any(axis=1)

    @property
    def v_first(self) -> int:  # oldest policy that produced a first token of the group
        return int(self.versions[:, 0].min())

    @property
    def v_last(self) -> int:  # newest policy that produced a last token of the group
        return int(self.versions[np.arange(len(self.lengths)), self.lengths - 1].max())

    @property
    def finish_reasons(self) -> list[str]:
        return ["stop" if s else "length" for s in self.stopped]


class _Group:
    def __init__(self, req: GroupRequest, T: int, pad_id: int, routing_shape=None, prefix_routing=None):
        G = req.num_samples
        self.req, self.done = req, 0
        self.tokens = np.full((G, T), pad_id, np.int32)
        self.logprobs = np.zeros((G, T), np.float32)
        self.versions = np.full((G, T), -1, np.int32)
        self.lengths = np.zeros((G,), np.int32)
        self.stopped = np.zeros((G,), bool)
        self.forced = np.zeros((G, T), bool)
        self.routing = None
        if routing_shape is not None:
            n = len(req.prompt)
            self.routing = np.zeros((G, n + T) + tuple(routing_shape), np.int32)
            self.routing[:, : n - 1] = prefix_routing[: n - 1]  # the prompt's tokens the prefill fed

    def result(self) -> GroupResult:
        return GroupResult(self.req.group_id, self.req.prompt, self.tokens, self.logprobs, self.versions,
                           self.lengths, self.stopped, self.forced, self.routing)


class Generator:
    """One thread that keeps the engine's slots full: pending groups -> prefill once ->
    insert into G slots -> generate steps -> finished groups on `results` (a queue).

    Never raises into the caller's thread: an exception is kept in `error` (with its
    traceback text) and the thread ends; `check()` re-raises it."""

    def __init__(self, engine: PolicyEngine, holder: WeightHolder, name: str = "rollout-generator"):
        self.engine, self.holder = engine, holder
        self.results: queue.Queue[GroupResult] = queue.Queue()
        self._pending: collections.deque[GroupRequest] = collections.deque()
        self._cv = threading.Condition()
        self._epoch = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.error_text = ""
        self.busy_s = self.idle_s = 0.0
        self.steps = self.slot_steps = self.tokens = 0
        self.started_at = None
        self.heartbeat = time.monotonic()  # last time the loop went round (busy or idle)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self):
        self.started_at = time.perf_counter()
        self._thread.start()
        return self

    def submit(self, requests) -> None:
        with self._cv:
            for r in requests:
                r.epoch = self._epoch
            self._pending.extend(requests)
            self._cv.notify_all()

    def reset(self) -> None:
        """Forget all pending work but streamed groups; groups in flight finish but are never returned."""
        with self._cv:
            self._epoch += 1
            kept = [r for r in self._pending if r.stream is not None]
            self._pending.clear()
            self._pending.extend(kept)
            while True:
                try:
                    self.results.get_nowait()
                except queue.Empty:
                    break

    def pending(self) -> int:
        with self._cv:
            return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout generator failed: {type(self.error).__name__}: {self.error}\n{self.error_text}")
        if self.started_at is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("rollout generator thread exited unexpectedly")

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("rollout generator did not stop within %.0f s", timeout)

    def stats(self) -> dict:
        return {"busy_s": self.busy_s, "idle_s": self.idle_s, "steps": self.steps, "slot_steps": self.slot_steps,
                "tokens": self.tokens, "slots": self.engine.slots, "version": self.holder.version,
                "stalled_s": time.monotonic() - self.heartbeat}

    def _next_request(self):
        with self._cv:
            version = self.holder.version
            if self._pending and self._pending[0].min_version <= version:
                return self._pending.popleft()
        return None

    def _run(self):
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - reported to the trainer through check()
            self.error, self.error_text = e, traceback.format_exc()
            log.error("rollout generator failed:\n%s", self.error_text)

    def _loop(self):
        eng, S, T = self.engine, self.engine.slots, self.engine.max_new_tokens
        Pb = eng.max_prefill_length
        state = eng.init_decode_state()
        free = list(range(S - 1, -1, -1))
        owner: list = [None] * S
        tok_h = np.full((S, T), eng.pad_id, np.int32)
        lp_h = np.zeros((S, T), np.float32)
        ver_h = np.full((S, T), -1, np.int32)
        forced_h = np.zeros((S, T), bool)
        routing_shape = getattr(eng, "routing_shape", None)  # (n_layers, k) with record_routing
        if routing_shape is not None:  # each generate step's fed token, by the slot's step index
            rt_h = np.zeros((S, T) + tuple(routing_shape), np.int32)
        current = None  # [_Group, prefix, next sample index]
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.heartbeat = time.monotonic()
            while free:  # fill free slots, prefilling each prompt group once
                if current is None:
                    req = self._next_request()
                    if req is None:
                        break
                    prompt = np.asarray(req.prompt, np.int32)
                    if not 1 <= len(prompt) <= Pb:
                        raise ValueError(f"group {req.group_id}: prompt of {len(prompt)} tokens; the engine takes 1..{Pb}")
                    padded = np.full((Pb,), eng.pad_id, np.int32)
                    padded[: len(prompt)] = prompt
                    prefix = eng.prefill(params=self.holder, padded_tokens=padded, true_length=len(prompt))
                    prefix_routing = None if routing_shape is None else np.asarray(prefix["routing"])
                    current = [_Group(req, T, eng.pad_id, routing_shape, prefix_routing), prefix, 0]
                slot = free.pop()
                state = eng.insert(current[1], state, slot)
                owner[slot] = (current[0], current[2])
                current[2] += 1
                if current[2] == current[0].req.num_samples:
                    current = None
            n_active = S - len(free)
            if n_active == 0:
                with self._cv:
                    if not self._stop.is_set():
                        self._cv.wait(0.05)
                self.idle_s += time.perf_counter() - t0
                continue
            state, result = eng.generate(self.holder, state)
            cols = unpack(result.data, routing_shape)
            valid = np.nonzero(cols["valid"])[0]
            pos = cols["length"][valid] - 1
            tok_h[valid, pos] = cols["token"][valid]
            lp_h[valid, pos] = cols["logprob"][valid]
            ver_h[valid, pos] = cols["version"][valid]
            forced_h[valid, pos] = cols["forced"][valid]
            if routing_shape is not None:  # step `pos` of a slot fed the token before its `pos`-th
                rt_h[valid, pos] = cols["routing"][valid]
            for s in valid:
                group, j = owner[s]
                if group.req.stream is not None:
                    group.req.stream.put((j, int(cols["token"][s])))
            for s in np.nonzero(cols["done"])[0]:
                group, j = owner[s]
                n = int(cols["length"][s])
                group.tokens[j], group.logprobs[j], group.versions[j] = tok_h[s], lp_h[s], ver_h[s]
                group.forced[j] = forced_h[s]
                if routing_shape is not None:
                    p = len(group.req.prompt)
                    group.routing[j, p - 1: p - 1 + n] = rt_h[s, :n]
                    rt_h[s] = 0
                group.lengths[j] = n
                group.stopped[j] = cols["stopped"][s]
                tok_h[s], lp_h[s], ver_h[s], forced_h[s] = eng.pad_id, 0.0, -1, False
                owner[s] = None
                free.append(s)
                group.done += 1
                if group.done == group.req.num_samples and group.req.stream is not None:
                    group.req.stream.put(group.result())
                elif group.done == group.req.num_samples and group.req.epoch == self._epoch:
                    self.results.put(group.result())
            self.steps += 1
            self.slot_steps += n_active
            self.tokens += len(valid)
            self.busy_s += time.perf_counter() - t0
