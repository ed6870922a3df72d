"""Metrics to TensorBoard (tensorboardX event files) and `metrics.jsonl`, from process 0.

The workdir is a local path or a gs:// URL (rl_scaling/paths.py). A GCS object cannot be
appended to, so on gs:// metrics.jsonl is rewritten whole on every write: it always holds every
line written so far, whatever kills the run."""

from __future__ import annotations

import json
import math
import sys
import time

import jax
from tensorboardX import SummaryWriter, record_writer

from rl_scaling import paths


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


class MetricsWriter:
    def __init__(self, workdir: str, resume_step: int | None = None):
        self.active = jax.process_index() == 0
        self.path = paths.join(workdir, "metrics.jsonl")
        self.remote = paths.is_gcs(self.path)
        self.lines = []  # on gs:// every line, rewritten whole on each write
        if not self.active:
            return
        if resume_step is not None and paths.exists(self.path):
            # Drop lines written after the checkpoint we resume from: they will be redone.
            kept = [line + "\n" for line in paths.read_text(self.path).splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            paths.write_text(self.path, "".join(kept))
            self.lines = kept
        elif resume_step is None and paths.exists(self.path):
            paths.remove(self.path)
        self.tb = SummaryWriter(paths.join(workdir, "tb"))

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        clean = {k: (float(v) if not isinstance(v, (int, str)) else v) for k, v in metrics.items()}
        for k, v in clean.items():
            if isinstance(v, float) and not math.isfinite(v) and not k.startswith("eval/"):
                raise FloatingPointError(f"metric {k} is {v} at step {step}; stopping. The last checkpoint is "
                                         f"untouched: lower config.optim.lr or check the rewards, then re-run to resume")
            if not isinstance(v, str):
                self.tb.add_scalar(k, v, step)
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

    def close(self):
        if self.active:
            self.tb.close()


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
