"""Metrics to TensorBoard (tensorboardX event files) and `metrics.jsonl`, from process 0.

The workdir is a local path or a gs:// URL (rl_scaling/paths.py). A GCS object cannot be
appended to, so on gs:// metrics.jsonl is rewritten whole on every write: it always holds every
line written so far, whatever kills the run."""

from __future__ import annotations

import json
import logging
import math
import sys
import time

import jax
from tensorboardX import SummaryWriter, record_writer

from rl_scaling import paths

log = logging.getLogger(__name__)


class _GCSEventFile:
    """A TensorBoard event file on gs:// through the path layer: the whole file is rewritten on
    each flush (GCS objects cannot be appended to). tensorboardX's own gs:// writer re-uploads
    again when garbage-collected, which stalls for minutes at exit once storage is gone."""

    def __init__(self, path):
        self.path, self.data, self.closed = path, bytearray(), False

    def write(self, b):
        self.data += b

    def flush(self):
        if not self.closed:
            with paths.open_file(self.path, "wb") as f:
                f.write(bytes(self.data))

    def close(self):
        self.flush()
        self.closed = True


class _GCSEventFiles:
    def open(self, path):
        return _GCSEventFile(path)

    def directory_check(self, path):
        pass  # GCS has no directories to create


record_writer.register_writer_factory("gs", _GCSEventFiles())


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
    steps past it, so that no step shows twice. Each TensorBoard scalar is written once a step."""

    def __init__(self, workdir: str, resume_step: int | None = None, resume_flops: float = 0.0):
        self.active = jax.process_index() == 0
        self.path = paths.join(workdir, "metrics.jsonl")
        self.remote = paths.is_gcs(self.path)
        self.lines = []  # on gs:// every line, rewritten whole on each write
        self.tb_step, self.tb_tags = None, set()
        if not self.active:
            return
        if resume_step is not None and paths.exists(self.path):
            # Drop lines written after the checkpoint we resume from: they will be redone.
            kept = [json.dumps(r) + "\n" for r in read_records(self.path) if r["step"] <= resume_step]
            paths.write_text(self.path, "".join(kept))
            self.lines = kept
        elif resume_step is None and paths.exists(self.path):
            paths.remove(self.path)
        purge = (resume_step + 1, compute_step(resume_flops) + 1) if resume_step is not None else (None, None)
        self.tb = SummaryWriter(paths.join(workdir, "tb"), purge_step=purge[0])
        self.tb_compute = SummaryWriter(paths.join(workdir, "tb", COMPUTE_AXIS_RUN), purge_step=purge[1])

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
            paths.write_text(self.path, "".join(self.lines))
        else:
            with open(self.path, "a") as f:
                f.write(line)

    def flush(self):
        if self.active:
            self.tb.flush()
            self.tb_compute.flush()

    def close(self):
        if self.active:
            self.tb.close()
            self.tb_compute.close()


class Progress:
    """One console line per call: step, a few metrics, rate and ETA."""

    def __init__(self, total: int, start: int = 0):
        self.total, self.start, self.t0 = total, start, time.time()

    def line(self, step: int, metrics: dict, keys=("reward_mean", "loss", "eval/pass_rate")) -> str:
        done = step - self.start
        elapsed = time.time() - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        shown = " ".join(f"{k}={float(metrics[k]):.4g}" for k in keys if k in metrics)
        return f"step {step}/{self.total} {shown} | {rate:.2f} steps/s, ETA {eta / 60:.1f} min"

    def print(self, step, metrics, **kw):
        if jax.process_index() == 0:
            print(self.line(step, metrics, **kw), file=sys.stderr, flush=True)
