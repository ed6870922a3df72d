"""Loaders: metrics.jsonl workdirs, TensorBoard, CSV; grouping of seeds; errors that name the fault."""

import json

import numpy as np
import pytest

from rl_scaling.scaling import io, law
from rl_scaling.scaling.errors import ScalingDataError


def write_workdir(d, A=0.6, seed_offset=0.0, steps=range(0, 2001, 50), eval_every=100, config=None):
    """A metrics.jsonl laid out like the trainer's (test fixture, synthetic numbers): a training line per
    logged step, and at eval steps a second line with the same step, the counters and the eval keys."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metrics.jsonl", "w") as f:
        for s in steps:
            counters = {"compute_flops": s * 1e12, "accel_seconds": s * 7.2, "samples": s * 256}
            if s > 0:
                f.write(json.dumps({"step": s, "loss": 0.5, "reward_mean": 0.3, **counters}) + "\n")
            if s % eval_every == 0:
                ev = {"eval/pass_rate": float(law.sigmoid(s * 1e12, A, 2.0, 6e14, 0.2)) + seed_offset,
                      "eval/pass_rate_stderr": 0.01, "eval/pass_rate_level0": 0.9}
                f.write(json.dumps({"step": s, **counters, **ev}) + "\n")
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def test_jsonl_axes_and_seed_grouping(tmp_path):
    for k in range(3):
        write_workdir(tmp_path / "results" / "scalerl" / f"seed{k}", seed_offset=0.001 * k)
    write_workdir(tmp_path / "results" / "other_run", A=0.5)
    runs = io.load_inputs([str(tmp_path / "results")], axis="flops")
    groups = io.group_runs(runs)
    assert sorted(groups) == ["other_run", "scalerl"]
    assert [r.seed for r in groups["scalerl"]] == ["0", "1", "2"]
    r = groups["scalerl"][0]
    assert r.compute[0] == 0 and r.compute.size == 21 and r.compute[-1] == 2000e12
    assert r.stderr is not None and r.stderr[0] == 0.01
    hours = io.load_inputs([str(tmp_path / "results" / "scalerl" / "seed0")], axis="accel_hours")[0]
    np.testing.assert_allclose(hours.compute[-1], 2000 * 7.2 / 3600)
    steps = io.load_inputs([str(tmp_path / "results" / "scalerl" / "seed0" / "metrics.jsonl")], axis="steps")[0]
    assert steps.compute[-1] == 2000


def test_config_json_names_recipe_and_seed(tmp_path):
    write_workdir(tmp_path / "a", config={"recipe": "cispo", "seed": 4})
    write_workdir(tmp_path / "b", config={"recipe": "cispo", "seed": 5})
    runs = io.load_inputs([str(tmp_path / "a"), str(tmp_path / "b")])
    assert list(io.group_runs(runs)) == ["cispo"] and [r.seed for r in runs] == ["4", "5"]


def test_jsonl_errors_name_file_line_column(tmp_path):
    d = write_workdir(tmp_path / "w")
    lines = (d / "metrics.jsonl").read_text().splitlines()
    i = next(k for k, ln in enumerate(lines) if '"step": 200' in ln and "eval/pass_rate" in ln)
    assert i + 1 == 7  # the 7th line of the file
    bad = json.loads(lines[i])
    bad["eval/pass_rate"] = float("nan")
    lines[i] = json.dumps(bad)
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ScalingDataError, match=r"metrics.jsonl:7: column 'eval/pass_rate' is nan"):
        io.load_inputs([str(d)])
    bad["eval/pass_rate"] = 0.3
    bad["compute_flops"] = 50e12  # smaller than the previous eval's
    lines[i] = json.dumps(bad)
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ScalingDataError, match=r"metrics.jsonl:7: column 'compute_flops': compute does not increase"):
        io.load_inputs([str(d)])
    del bad["compute_flops"]
    lines[i] = json.dumps(bad)
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ScalingDataError, match=r"metrics.jsonl:7: column 'compute_flops' missing"):
        io.load_inputs([str(d)])
    lines[i] = "{not json"
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ScalingDataError, match=r"metrics.jsonl:7: not valid JSON"):
        io.load_inputs([str(d)])


def test_csv(tmp_path):
    p = tmp_path / "curves.csv"
    rows = ["run,seed,compute,pass_rate"]
    for seed in (0, 1):
        for c in range(0, 1001, 100):
            rows.append(f"grpo,{seed},{c},{0.2 + 0.0003 * c + 0.01 * seed}")
    p.write_text("\n".join(rows) + "\n")
    runs = io.load_inputs([str(p)])
    assert [r.name for r in runs] == ["grpo/seed0", "grpo/seed1"] and runs[0].compute.size == 11
    q = tmp_path / "plain.csv"
    q.write_text("compute,pass_rate\n0,0.2\n10,0.3\n")
    assert io.load_csv(str(q))[0].recipe == "plain"


@pytest.mark.parametrize("text,msg", [
    ("compute,score\n0,0.1\n", r"missing column 'pass_rate'"),
    ("compute,pass_rate\n0,0.1\n1,abc\n", r"plain.csv:3: column 'pass_rate': not a number"),
    ("compute,pass_rate\n0,0.1\n-1,0.2\n", r"plain.csv:3: column 'compute' is negative"),
    ("compute,pass_rate\n0,0.1\n0,0.2\n", r"plain.csv:3: column 'compute': compute 0 appears twice"),
    ("compute,pass_rate\n0,0.1\n5,nan\n", r"plain.csv:3: column 'pass_rate' is nan"),
    ("compute,pass_rate\n0,0.1\n5,\n", r"plain.csv:3: column 'pass_rate' is empty"),
])
def test_csv_errors(tmp_path, text, msg):
    p = tmp_path / "plain.csv"
    p.write_text(text)
    with pytest.raises(ScalingDataError, match=msg):
        io.load_inputs([str(p)])


def test_missing_inputs(tmp_path):
    with pytest.raises(ScalingDataError, match="no such file"):
        io.load_inputs([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScalingDataError, match="no metrics.jsonl"):
        io.load_inputs([str(tmp_path / "empty")])


def test_tensorboard(tmp_path):
    tbx = pytest.importorskip("tensorboardX")
    d = tmp_path / "cispo" / "seed1"
    w = tbx.SummaryWriter(str(d))
    for s in range(0, 1001, 50):
        w.add_scalar("compute/flops", s * 1e12, s)
        if s % 100 == 0:
            w.add_scalar("eval/pass_rate", 0.2 + 0.0003 * s, s)
    w.close()
    run = io.load_inputs([str(tmp_path)], axis="flops")[0]
    assert run.recipe == "cispo" and run.seed == "1"
    np.testing.assert_allclose(run.compute, np.arange(0, 1001, 100) * 1e12)
    np.testing.assert_allclose(run.pass_rate, 0.2 + 0.0003 * np.arange(0, 1001, 100), rtol=1e-6)
    assert io.load_tensorboard(str(d), axis="steps")[0].compute[-1] == 1000
    with pytest.raises(ScalingDataError, match="no compute scalar"):
        io.load_tensorboard(str(d), axis="accel_hours")
    # the trainer's layout: WORKDIR/tb/events..., WORKDIR/config.json, tags named like the jsonl keys
    wd = tmp_path / "runs" / "x"
    w = tbx.SummaryWriter(str(wd / "tb"))
    for s in range(0, 501, 100):
        w.add_scalar("accel_seconds", s * 36.0, s)
        w.add_scalar("eval/pass_rate", 0.2 + 0.0003 * s, s)
    w.close()
    (wd / "config.json").write_text(json.dumps({"recipe": "dapo", "seed": 2, "rl": {"eps": 0.2}}))
    run = io.load_inputs([str(wd)], axis="accel_hours")[0]
    assert (run.recipe, run.seed) == ("dapo", "2") and run.compute[-1] == 5.0
