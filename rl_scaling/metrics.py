"""Metrics to TensorBoard (tensorboardX event files) and `metrics.jsonl`, from process 0."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
from tensorboardX import SummaryWriter


class MetricsWriter:
    def __init__(self, workdir: str, resume_step: int | None = None):
        self.active = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        if not self.active:
            return
        if resume_step is not None and os.path.exists(self.path):
            # Drop lines written after the checkpoint we resume from: they will be redone.
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        elif resume_step is None and os.path.exists(self.path):
            os.remove(self.path)
        self.tb = SummaryWriter(os.path.join(workdir, "tb"))

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
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")

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
