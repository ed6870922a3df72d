"""PipelineRL with several trainer processes: one rollout stream, every process the same batches.

Design: process 0 alone talks to the engine replicas (it owns the `Pipeline`: prompt stream,
dispatch, staleness, failover) and broadcasts each step's batch to the other processes with
`multihost_utils.broadcast_one_to_all`; every process then feeds its own rows of the same global
batch (distributed.global_batch). Why not every process reading the same stream: which groups
finish first depends on the replicas' timing, so independent clients would disagree on the
batch; and one client means one session per replica, one ordering of group ids and one place
where a group can be lost or duplicated (none: pipeline.py's accounting).

A batch travels as one wire.pack message (arrays + a JSON header with the metrics, the dropped
lengths and the pipeline's resume state), as uint8 padded to a multiple of 64 KiB (few distinct
shapes to compile). An error in process 0's pipeline is broadcast too, so every process raises
the same RolloutError instead of waiting forever in the collective.

Weights: `push_weights` gathers the params to host on every process (a collective), then
process 0 pushes them.

Ledger (`ledger=PATH`): each process appends one JSON line per batch (trainer version, group
ids, prompts, staleness): an audit trail of what every process trained on.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from rl_scaling import distributed, paths
from rl_scaling.rollout import sampler, wire
from rl_scaling.rollout.errors import RolloutError
from rl_scaling.rollout.pipeline import StepData

_BUCKET = 64 << 10
_ARRAYS = ("prompt_tokens", "prompt_mask", "rewards", "sample_ids", "v_first", "v_last", "staleness")


def encode(data: StepData, resume: dict | None) -> bytes:
    arrays = {k: np.asarray(getattr(data, k)) for k in _ARRAYS}
    arrays.update({f"out_{k}": np.asarray(v) for k, v in data.out._asdict().items()})
    dropped = [np.asarray(x).tolist() for x in data.dropped]
    return wire.pack({"metrics": data.metrics, "dropped": dropped, "resume": resume}, arrays)


def decode(blob: bytes):
    meta, a = wire.unpack(blob)
    out = sampler.Samples(**{k: a[f"out_{k}"] for k in sampler.Samples._fields})
    dropped = tuple(np.asarray(x, np.int64) for x in meta["dropped"]) if meta["dropped"][0] else ((), ())
    data = StepData(a["prompt_tokens"], a["prompt_mask"], out, a["rewards"], meta["metrics"], a["sample_ids"],
                    a["v_first"], a["v_last"], a["staleness"], dropped)
    return data, meta["resume"]


def _broadcast_bytes(blob: bytes | None) -> bytes:
    """process 0's bytes on every process (others pass None)."""
    from jax.experimental import multihost_utils

    n = np.array([len(blob) if blob is not None else 0], np.int32)
    n = int(multihost_utils.broadcast_one_to_all(n)[0])
    size = -(-max(n, 1) // _BUCKET) * _BUCKET
    buf = np.zeros(size, np.uint8)
    if blob is not None:
        buf[:n] = np.frombuffer(blob, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes()


class BroadcastPipeline:
    """The Pipeline interface on every trainer process; `pipe` is the real one on process 0, None elsewhere."""

    def __init__(self, pipe, tokenizer, samples_per_prompt: int, ledger: str = ""):
        self.pipe, self.tok, self.G = pipe, tokenizer, samples_per_prompt
        self.main = jax.process_index() == 0
        if self.main and pipe is None:
            raise ValueError("process 0 needs the pipeline")
        self._resume = None
        self._ledger = None
        if ledger:
            self._ledger = paths.open_file(f"{ledger}.p{jax.process_index()}.jsonl", "w")

    @property
    def devices(self) -> int:
        many = distributed.multiprocess()
        n = np.array([self.pipe.devices if self.pipe is not None else 0], np.int32)
        if many:
            from jax.experimental import multihost_utils

            n = multihost_utils.broadcast_one_to_all(n)
        return int(n[0])

    def push_weights(self, params, version: int) -> None:
        host = distributed.to_host(params)  # a collective: every process takes part
        if self.pipe is not None:
            self.pipe.push_weights(host, version)

    def next_batch(self) -> StepData:
        blob = None
        if self.pipe is not None:
            try:
                data = self.pipe.next_batch()
                blob = b"\x01" + encode(data, self.pipe.resume_state())
            except Exception as e:  # noqa: BLE001 - every process must learn of it, then raise
                error = e
                blob = b"\x00" + f"{type(e).__name__}: {e}".encode()
        if distributed.multiprocess():
            blob = _broadcast_bytes(blob)
        if blob[:1] == b"\x00":
            if self.pipe is not None:
                raise error
            raise RolloutError(f"rollout pipeline on process 0 failed: {blob[1:].decode()}")
        data, self._resume = decode(blob[1:])
        self._write_ledger(data)
        return data

    def resume_state(self) -> dict | None:
        """Process 0's resume state as of the last batch (the same on every process)."""
        return self.pipe.resume_state() if self.pipe is not None else self._resume

    def _write_ledger(self, data: StepData) -> None:
        if self._ledger is None:
            return
        rows = range(0, len(data.sample_ids), self.G)  # a group's G samples are consecutive rows
        self._ledger.write(json.dumps({
            "version": int(data.v_first[0] + data.staleness[0]),
            "groups": [int(data.sample_ids[i]) // self.G for i in rows],
            "prompts": [self.tok.decode(data.prompt_tokens[i][data.prompt_mask[i]]) for i in rows],
            "staleness_max": int(data.staleness.max())}) + "\n")
        self._ledger.flush()

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        if self.pipe is not None:
            self.pipe.close()
