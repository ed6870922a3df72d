"""Loaders: metrics.jsonl workdirs, TensorBoard, CSV; grouping of seeds; errors that name the fault."""

import json

import numpy as np
import pytest

from rl_scaling.scaling import io, law
from rl_scaling.scaling.errors import ScalingDataError


def write_workdir(d, A=0.6, seed_offset=0.0, steps=range(0, 2001, 50), eval_every=100, config=None):  # noqa: B008 (immutable)
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
    # a sweep's shared warm start (a 1-step run of scalerl seed 0) is the base model, not a run
    write_workdir(tmp_path / "results" / "warmstart", config={"recipe": "scalerl", "seed": 0})
    runs = io.load_inputs([str(tmp_path / "results")], axis="flops")
    groups = io.group_runs(runs)
    assert sorted(groups) == ["other_run", "scalerl"]
    assert len(io.load_inputs([str(tmp_path / "results" / "warmstart")])) == 1  # named, it loads
    assert [r.seed for r in groups["scalerl"]] == ["0", "1", "2"]
    r = groups["scalerl"][0]
    assert r.compute[0] == 0 and r.compute.size == 21 and r.compute[-1] == 2000e12
    assert r.stderr is not None and r.stderr[0] == 0.01
    np.testing.assert_array_equal(r.samples, np.arange(0, 2001, 100) * 256)  # the generated samples at each eval
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


def test_relogged_evals_keep_the_last_record_of_each_step(tmp_path):
    """A run resumed from its step-1000 checkpoint logs the evals of steps 1100-1400 again."""
    d = write_workdir(tmp_path / "w", steps=range(0, 1401, 50))
    first = io.load_inputs([str(d)])[0]
    lines = (d / "metrics.jsonl").read_text().splitlines()
    again = []
    for ln in lines:
        rec = json.loads(ln)
        if "eval/pass_rate" in rec and rec["step"] > 1000:
            rec["eval/pass_rate"] += 0.05  # the second pass differs: the last record must win
            again.append(json.dumps(rec))
    (d / "metrics.jsonl").write_text("\n".join(lines + again) + "\n")
    run = io.load_inputs([str(d)])[0]
    np.testing.assert_array_equal(run.compute, first.compute)
    np.testing.assert_array_equal(run.samples, first.samples)
    late = first.compute > 1000e12
    np.testing.assert_allclose(run.pass_rate[late], first.pass_rate[late] + 0.05)
    np.testing.assert_array_equal(run.pass_rate[~late], first.pass_rate[~late])
    assert len(run.notes) == 1 and "4 step(s) have more than one eval record" in run.notes[0]
    assert "steps 1100, 1200, 1300, 1400" in run.notes[0]


def test_byte_order_mark_is_accepted(tmp_path):
    d = write_workdir(tmp_path / "w")
    text = (d / "metrics.jsonl").read_text()
    (d / "metrics.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert io.load_inputs([str(d)])[0].compute.size == 21
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbfcompute,pass_rate\n0,0.2\n10,0.3\n20,0.35\n")
    run = io.load_inputs([str(p)])[0]
    np.testing.assert_array_equal(run.compute, [0, 10, 20])


def test_unsorted_csv_rows_are_sorted_with_a_note(tmp_path):
    p = tmp_path / "mixed.csv"
    p.write_text("run,compute,pass_rate\na,20,0.35\na,0,0.2\nb,0,0.1\na,10,0.3\nb,5,0.15\n")
    a, b = io.load_inputs([str(p)])
    np.testing.assert_array_equal(a.compute, [0, 10, 20])
    np.testing.assert_array_equal(a.pass_rate, [0.2, 0.3, 0.35])
    assert len(a.notes) == 1 and "'a' were not in compute order" in a.notes[0] and b.notes == ()
    dup = tmp_path / "dup.csv"
    dup.write_text("compute,pass_rate\n10,0.3\n0,0.2\n10,0.31\n")
    with pytest.raises(ScalingDataError, match=r"dup.csv:4: column 'compute': compute does not increase"):
        io.load_inputs([str(dup)])


def test_percent_scale_csv_names_the_line(tmp_path):
    p = tmp_path / "pct.csv"
    p.write_text("compute,pass_rate\n0,0.2\n10,31.5\n20,35\n")
    with pytest.raises(ScalingDataError, match=r"pct.csv:3: column 'pass_rate' is 31.5: .*percent scale"):
        io.load_inputs([str(p)])


def test_eval_size_comes_from_config_json(tmp_path):
    d = write_workdir(tmp_path / "w", config={"recipe": "x", "seed": 0,
                                              "eval": {"num_prompts": 256, "samples_per_prompt": 4}})
    assert io.load_inputs([str(d)])[0].eval_samples == 1024
    d2 = write_workdir(tmp_path / "v", config={"recipe": "x", "seed": 1, "eval": {"num_prompts": "many"}})
    assert io.load_inputs([str(d2)])[0].eval_samples is None
