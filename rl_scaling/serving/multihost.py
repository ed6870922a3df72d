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

Weights (`push_weights`, called on every process with the same global params): every process
first casts its own shards to rollout.push_dtype on its devices (wire.cast_for_push; nothing
moves). Then
  - with rollout.weights_dir: every process writes only its own shards of the cast params into
    the version's Orbax checkpoint (weights_dir.write, collective); process 0 writes LATEST.
    No process gathers the model to host memory.
  - by gRPC push: process 0 needs the whole cast model as host bytes (wire.weight_chunks; it
    keeps them for replicas that rejoin). jax.experimental.multihost_utils has no gather to
    one process: `process_allgather` (and `broadcast_one_to_all`) hand the result to every
    process, and every process must take part. So `gather_to_main` gathers piece by piece
    (<= 256 MiB of one leaf at a time, along its first axis) and only process 0 keeps the
    pieces: the other processes hold at most one piece at a time beyond their own shards, but
    each process's devices and host still see every byte of the model go by. For a model
    whose host copy does not fit on one trainer host (Scout in float32: 431 GB), use the
    directory channel.
With one process, `push_weights` hands the params on unchanged: the backend casts and writes or
pushes them itself (client.RemoteBackend; an embedded engine takes them as they are).

Ledger (`ledger=PATH`): each process appends one JSON line per batch (trainer version, group
ids, prompts, staleness): an audit trail of what every process trained on.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from rl_scaling import distributed, paths
from rl_scaling.rollout import sampler
from rl_scaling.serving import wire
from rl_scaling.serving import weights_dir as weights_dir_lib
from rl_scaling.rollout.errors import RolloutError
from rl_scaling.rollout.pipeline import StepData

_BUCKET = 64 << 10
_ARRAYS = ("prompt_tokens", "prompt_mask", "rewards", "sample_ids", "v_first", "v_last", "staleness")


def encode(data: StepData, resume: dict | None) -> bytes:
    arrays = {k: np.asarray(getattr(data, k)) for k in _ARRAYS}
    arrays.update({f"out_{k}": np.asarray(v) for k, v in data.out._asdict().items() if v is not None})
    dropped = [np.asarray(x).tolist() for x in data.dropped]
    return wire.pack({"metrics": data.metrics, "dropped": dropped, "resume": resume}, arrays)


def decode(blob: bytes):
    meta, a = wire.unpack(blob)
    out = sampler.Samples(**{k: a.get(f"out_{k}") for k in sampler.Samples._fields})  # routing: optional
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


_GATHER_BYTES = 256 << 20


def gather_to_main(params):
    """The params as numpy on process 0 (None leaves elsewhere). Every process must call it (the
    gathers are collectives); see the module doc for what each process holds meanwhile."""
    from jax.experimental import multihost_utils

    main = jax.process_index() == 0

    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x) if main else None
        if x.sharding.is_fully_replicated:  # process 0 has a whole copy already
            return np.asarray(x.addressable_data(0)) if main else None
        if x.ndim == 0:
            full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
            return full if main else None
        out = np.empty(x.shape, x.dtype) if main else None
        rows = x.shape[0]
        step = max(1, _GATHER_BYTES // max(1, x.nbytes // max(rows, 1)))
        for i in range(0, rows, step):
            piece = np.asarray(multihost_utils.process_allgather(x[i:i + step], tiled=True))
            if main:
                out[i:i + step] = piece
            del piece
        return out

    return jax.tree.map(get, params)


class BroadcastPipeline:
    """The Pipeline interface on every trainer process; `pipe` is the real one on process 0, None elsewhere.
    `weights_dir`, `push_dtype`, `fp32_lm_head`, `tie_embeddings`: as config.rollout / the model
    (the weights every process writes or gathers, see the module doc)."""

    def __init__(self, pipe, tokenizer, samples_per_prompt: int, ledger: str = "", *, weights_dir: str = "",
                 push_dtype: str = "", fp32_lm_head: bool = True, tie_embeddings: bool = False):
        self.pipe, self.tok, self.G = pipe, tokenizer, samples_per_prompt
        self.weights_dir, self.push_dtype = weights_dir, wire.check_push_dtype(push_dtype)
        self._keep_f32 = {"fp32_lm_head": fp32_lm_head, "tie_embeddings": tie_embeddings}
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
        if not distributed.multiprocess():  # one process: its backend casts and writes or pushes
            self.pipe.push_weights(params, version)
            return
        params = wire.cast_for_push(params, self.push_dtype, **self._keep_f32)  # each process its own shards
        if self.weights_dir:
            weights_dir_lib.write(self.weights_dir, params, version)  # collective: each process its own shards
            payload = weights_dir_lib.Written(version)
        else:
            payload = gather_to_main(params)  # collective: only process 0 keeps the bytes
        if self.pipe is not None:
            self.pipe.push_weights(payload, version)

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
