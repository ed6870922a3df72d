"""Metrics to TensorBoard (event files) and `metrics.jsonl`, from process 0.

The workdir is a local path or a gs:// URL (rl_scaling/paths.py). Each file only grows: locally
by appends, on gs:// by composing each new part onto the object (paths.append_bytes), so a
write uploads only what is new and the upload volume grows with the step count, not its square.

TensorBoard: every writer (`tb/` and `tb/compute_axis`) starts its event file with a
SessionLog.START at its purge step (0 on a fresh run, the step after the restored checkpoint on a
resume). TensorBoard's loaders take the first START of a run as its beginning and every later one
as "drop the steps from here on", so after a resume, or a re-run of a run killed before its first
checkpoint, no step shows twice. Events are encoded synchronously (no queue, no thread):
`MetricsWriter.flush()` returns once every event and line written so far is on disk (fsync) or
in the bucket. Between flushes they are written out at least every `flush_s` seconds.

A write that fails (a full disk, storage gone) raises MetricsWriteError naming the file and the
last good checkpoint; the checkpoints are untouched."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import sys
import time

import jax
from tensorboardX import record_writer, summary
from tensorboardX.proto.event_pb2 import Event, SessionLog

from rl_scaling import paths

log = logging.getLogger(__name__)


class MetricsWriteError(RuntimeError):
    """metrics.jsonl or a TensorBoard event file could not be written (disk full, storage gone)."""


class _GCSEventFile:
    """An event file on gs:// for tensorboardX writers (launch/eval_fit.py's): each flush
    appends only the bytes written since the last one (paths.append_bytes). tensorboardX's own
    gs:// writer re-uploads the whole file on every flush, and again when garbage-collected."""

    def __init__(self, path):
        self.path, self.data, self.closed = path, bytearray(), False

    def write(self, b):
        self.data += b

    def flush(self):
        if not self.closed and self.data:
            paths.append_bytes(self.path, bytes(self.data))
            self.data = bytearray()

    def close(self):
        self.flush()
        self.closed = True


class _GCSEventFiles:
    def open(self, path):
        return _GCSEventFile(path)

    def directory_check(self, path):
        pass  # GCS has no directories to create


record_writer.register_writer_factory("gs", _GCSEventFiles())


def _record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC32C, the data, its masked CRC32C."""
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", record_writer.masked_crc32c(header)) + data
            + struct.pack("<I", record_writer.masked_crc32c(data)))


class EventWriter:
    """One TensorBoard event file, encoded in the caller's thread. Opening it writes the file
    version and a SessionLog.START at `purge_step`; `flush` puts everything written on disk
    (fsync) or in the bucket (an append)."""

    def __init__(self, logdir: str, purge_step: int):
        now = time.time()
        # the second, then the microsecond: TensorBoard reads a run's files in name order
        name = "events.out.tfevents.%010d.%s.%06d.%d" % (now, socket.gethostname(), (now % 1) * 1e6, os.getpid())
        self.path = paths.join(logdir, name)
        self.remote = paths.is_gcs(self.path)
        self.pending = bytearray()
        self._file = None
        if not self.remote:
            os.makedirs(paths.resolve(logdir), exist_ok=True)
            self._file = open(self.path, "ab")
        self.add(Event(wall_time=now, step=purge_step, file_version="brain.Event:2"))
        self.add(Event(wall_time=now, step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def add(self, event: Event) -> None:
        self.pending += _record(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, step: int, summary_description: str | None = None) -> None:
        kw = {"summary_description": summary_description} if summary_description else {}
        self.add(Event(wall_time=time.time(), step=int(step), summary=summary.scalar(tag, float(value), **kw)))

    def flush(self) -> None:
        if self.remote:
            if self.pending:
                paths.append_bytes(self.path, bytes(self.pending))
        elif self._file is not None:
            self._file.write(self.pending)
            self._file.flush()
            os.fsync(self._file.fileno())
        self.pending = bytearray()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._file is not None:
                f, self._file = self._file, None
                try:
                    f.close()
                except OSError:
                    pass  # the flush above raised or succeeded; nothing is left to write


COUNTER_TAGS = {"compute_flops": "compute/flops", "accel_seconds": "compute/accel_seconds", "samples": "compute/samples"}
ROLLOUT_KEYS = ("truncation_rate", "interruption_rate", "response_len", "pass_rate_train")
FAMILIES = ("train", "rollout", "eval", "compute", "time", "router")
COMPUTE_UNIT = 1e9  # eval_vs_compute/*: the TensorBoard step is cumulative training FLOPs / 1e9
COMPUTE_AXIS_RUN = "compute_axis"  # tb/compute_axis: its own run, so that its steps purge apart
EVAL_VS_COMPUTE = ("Held-out pass rate against training compute: the step is cumulative model FLOPs / 1e9 "
                   "(GFLOP, generation + training, evaluation not counted), the x-axis of the sigmoid law.")


def tb_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: train/*, rollout/*, eval/*, compute/*, time/*
    (router/* and other families as they are)."""
    if key in COUNTER_TAGS:
        return COUNTER_TAGS[key]
    head = key.split("/", 1)[0] if "/" in key else ""
    if head == "npr" or key in ROLLOUT_KEYS:
        return "rollout/" + key
    return key if head else "train/" + key


def compute_step(flops: float) -> int:
    return int(flops // COMPUTE_UNIT)


def read_records(path: str) -> list[dict]:
    """The records of a JSONL file; a torn last line (a kill during a write) is dropped with a
    warning, any other unreadable line is an error naming the file and line."""
    lines = paths.read_text(path).splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if i == len(lines):
                log.warning("%s: dropping a torn last line %d (%r)", path, i, line[:80])
                continue
            raise ValueError(f"{path}, line {i}: not JSON ({e}): {line[:80]!r}") from e
    return out


class MetricsWriter:
    """metrics.jsonl and TensorBoard events of a run. Resuming at `resume_step` drops the
    records past it (and a torn last line) from metrics.jsonl, and purges TensorBoard of the
    steps past it, so that no step shows twice; a fresh run purges from step 0 (the events of a
    run killed before its first checkpoint). Each TensorBoard scalar is written once a step."""

    flush_s = 30.0  # events and (on gs://) lines are written out at least this often

    def __init__(self, workdir: str, resume_step: int | None = None, resume_flops: float = 0.0):
        self.active = jax.process_index() == 0
        self.workdir = workdir
        self.path = paths.join(workdir, "metrics.jsonl")
        self.remote = paths.is_gcs(self.path)
        self.lines = []  # lines not yet written out (gs:// only: locally each is appended at once)
        self.tb_step, self.tb_tags = None, set()
        self.resume_step = resume_step
        self._last_flush = time.monotonic()
        if not self.active:
            return
        with self._failing(self.path):
            if resume_step is not None and paths.exists(self.path):
                # Drop lines written after the checkpoint we resume from: they will be redone.
                kept = [json.dumps(r) + "\n" for r in read_records(self.path) if r["step"] <= resume_step]
                paths.write_text(self.path, "".join(kept))
            elif resume_step is None and paths.exists(self.path):
                paths.remove(self.path)
        purge = (resume_step + 1, compute_step(resume_flops) + 1) if resume_step is not None else (0, 0)
        with self._failing(paths.join(workdir, "tb")):
            self.tb = EventWriter(paths.join(workdir, "tb"), purge[0])
            self.tb_compute = EventWriter(paths.join(workdir, "tb", COMPUTE_AXIS_RUN), purge[1])
            self._flush_events()  # the START markers are on disk before any step is

    # ---- errors -----------------------------------------------------------------------------
    def _last_checkpoint(self) -> str:
        directory = paths.join(self.workdir, "checkpoints")
        try:
            steps = [int(n) for n in paths.listdir(directory) if n.isdigit()] if paths.isdir(directory) else []
        except Exception:  # noqa: BLE001 - the storage that just failed may not answer a listing either
            return f"the newest step in {directory} (not listed: the storage did not answer)"
        return f"step {max(steps)} in {directory}" if steps else f"none yet (no step in {directory})"

    def _failing(self, what: str):
        writer = self

        class _Guard:
            def __enter__(self):
                return self

            def __exit__(self, kind, e, tb):
                if e is None or not isinstance(e, OSError):
                    return False
                reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
                last = (f"the newest step in {paths.join(writer.workdir, 'checkpoints')} (not listed: the storage "
                        "did not answer)") if isinstance(e, paths.StorageError) else writer._last_checkpoint()
                raise MetricsWriteError(
                    f"writing {getattr(e, 'filename', None) or what} failed: {type(e).__name__}: {reason}. "
                    f"The last good checkpoint is {last}; its metrics are written. "
                    "Free space (or restore the storage) and re-run the same command to resume from it") from e

        return _Guard()

    # ---- writing ----------------------------------------------------------------------------
    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        clean = {k: (float(v) if not isinstance(v, (int, str)) else v) for k, v in metrics.items()}
        for k, v in clean.items():
            if isinstance(v, float) and not math.isfinite(v) and not k.startswith("eval/"):
                raise FloatingPointError(f"metric {k} is {v} at step {step}; stopping. The last checkpoint is "
                                         f"untouched: lower config.optim.lr or check the rewards, then re-run to resume")
        if step != self.tb_step:
            self.tb_step, self.tb_tags = step, set()
        for k, v in clean.items():
            tag = tb_tag(k)
            if not isinstance(v, str) and tag not in self.tb_tags:  # counters come again with an eval record
                self.tb.add_scalar(tag, v, step)
                self.tb_tags.add(tag)
        if "eval/pass_rate" in clean and "compute_flops" in clean:
            self.tb_compute.add_scalar("eval_vs_compute/pass_rate", clean["eval/pass_rate"],
                                       compute_step(clean["compute_flops"]), summary_description=EVAL_VS_COMPUTE)
        line = json.dumps({"step": step, **clean}) + "\n"
        if self.remote:
            self.lines.append(line)
        else:
            with self._failing(self.path):
                with open(self.path, "a") as f:
                    f.write(line)
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def _flush_events(self):
        for w in (self.tb, self.tb_compute):
            with self._failing(w.path):
                w.flush()

    def flush(self):
        """Every line and event written so far is on disk (fsync) or in the bucket when this returns."""
        if not self.active:
            return
        if self.lines:
            with self._failing(self.path):
                paths.append_bytes(self.path, "".join(self.lines).encode())
            self.lines = []
        elif not self.remote:
            with self._failing(self.path):
                if os.path.exists(self.path):
                    fd = os.open(self.path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        self._flush_events()
        self._last_flush = time.monotonic()

    def close(self):
        if self.active:
            try:
                self.flush()
            finally:
                for w in (self.tb, self.tb_compute):
                    if w._file is not None:
                        w._file.close()
                        w._file = None


class Progress:
    """One console line per call: step, a few metrics, rate and ETA."""

    def __init__(self, total: int, start: int = 0):
        self.total, self.start, self.t0 = total, start, time.time()

    def line(self, step: int, metrics: dict, keys=("reward_mean", "loss", "eval/pass_rate")) -> str:
        done = step - self.start
        elapsed = time.time() - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        shown = " ".join(f"{k}={float(metrics[k]):.4g}" for k in keys if k in metrics)
        if rate <= 0:  # step 0, or the first line after a resume: nothing timed yet
            return f"step {step}/{self.total} {shown} | ETA after the first timed step"
        return f"step {step}/{self.total} {shown} | {rate:.2f} steps/s, ETA {(self.total - step) / rate / 60:.1f} min"

    def print(self, step, metrics, **kw):
        if jax.process_index() == 0:
            print(self.line(step, metrics, **kw), file=sys.stderr, flush=True)
