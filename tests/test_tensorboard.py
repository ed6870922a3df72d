"""TensorBoard events of a short run, read back with tensorboard's own EventAccumulator: tag
families, each scalar once per step, the eval pass rate against compute (GFLOPs as the step),
and the project's TensorBoard loader on them."""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_run import fast_config, read_jsonl  # noqa: E402

FAMILIES = ("train/", "rollout/", "eval/", "compute/", "time/", "router/")


def _accumulator(path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return acc


def test_tag_families_once_per_step_and_eval_against_compute(tmp_path):
    from rl_scaling import metrics, train
    from rl_scaling.scaling import io

    train.train(fast_config(steps=4, eval_every=2, checkpoint_every=4, log_every=1), str(tmp_path))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = {r["step"]: r for r in rows if "loss" in r}
    eval_rows = [r for r in rows if "eval/pass_rate" in r]

    acc = _accumulator(tmp_path / "tb")
    tags = acc.Tags()["scalars"]
    assert [t for t in tags if not t.startswith(FAMILIES)] == []
    for tag in ("train/loss", "train/grad_norm", "train/reward_mean", "rollout/pass_rate_train",
                "rollout/response_len", "rollout/npr/removed", "eval/pass_rate", "compute/flops",
                "compute/accel_seconds", "compute/samples", "time/rollout_s"):
        assert tag in tags, (tag, tags)
    for tag in tags:  # once per step: the counters of an eval step are not written again
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)
    assert [e.step for e in acc.Scalars("compute/flops")] == [0, 1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("train/loss")] == [np.float32(train_rows[s]["loss"]) for s in (1, 2, 3, 4)]
    assert [e.step for e in acc.Scalars("eval/pass_rate")] == [0, 2, 4]

    vs = _accumulator(tmp_path / "tb" / metrics.COMPUTE_AXIS_RUN)
    assert vs.Tags()["scalars"] == ["eval_vs_compute/pass_rate"]
    events = vs.Scalars("eval_vs_compute/pass_rate")
    assert [e.step for e in events] == [int(r["compute_flops"] // 1e9) for r in eval_rows]
    assert [e.step for e in events][-1] > 0
    assert [e.value for e in events] == [np.float32(r["eval/pass_rate"]) for r in eval_rows]
    assert "FLOPs / 1e9" in vs.SummaryMetadata("eval_vs_compute/pass_rate").summary_description

    # the fit loader reads the run's events on the FLOPs axis (compute/flops against the step)
    run, = io.load_tensorboard(str(tmp_path / "tb"), axis="flops")
    assert np.allclose(run.compute, [r["compute_flops"] for r in eval_rows], rtol=1e-6)
    assert json.loads((tmp_path / "config.json").read_text())["recipe"] == "scalerl"
