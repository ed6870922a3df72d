"""launch/sweep.py: the commands it plans, its errors, and the whole loop (warm start, runs,
skip-on-rerun, fit, comparison.md, figures) with a stand-in interpreter whose `run.py`
writes synthetic sigmoid curves instead of training."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_sweep():
    spec = importlib.util.spec_from_file_location("sweep", os.path.join(ROOT, "launch", "sweep.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sweep = _load_sweep()


def test_dry_run_prints_warm_start_runs_and_fit(tmp_path, capsys):
    rc = sweep.main(["--config=configs/tiny.py:samples=7680", "--recipes=scalerl,grpo+rl.adv_norm=none,scalerl+prompts=64",
                     "--seeds=2",
                     f"--workdir={tmp_path}", "--extra=--config.eval.num_prompts=64", "--dry_run"])
    assert rc == 0
    cmds = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert not os.listdir(tmp_path)  # nothing ran
    warm, runs, fit = cmds[0], [c for c in cmds[1:7] if "prompts=64" not in c[2]], cmds[7]
    batch = [c for c in cmds[1:7] if "prompts=64" in c[2]]
    assert [c[2] for c in batch] == [f"--config=configs/tiny.py:samples=7680,recipe=scalerl,seed={s},prompts=64" for s in (0, 1)]
    assert f"--workdir={tmp_path}/scalerl+prompts=64/seed1" in batch[1] and "--config.recipe=scalerl+prompts=64" in batch[1]
    assert warm[1].endswith("launch/run.py") and "--config.steps=1" in warm
    assert warm[2] == "--config=configs/tiny.py:samples=7680,recipe=scalerl,seed=0"
    init = f"--config.init_checkpoint={tmp_path}/warmstart/warmstart/params"
    expected = [("scalerl", "scalerl", 0), ("grpo", "grpo+rl.adv_norm=none", 0), ("scalerl", "scalerl", 1),
                ("grpo", "grpo+rl.adv_norm=none", 1)]
    for cmd, (name, label, seed) in zip(runs, expected):
        assert cmd[2] == f"--config=configs/tiny.py:samples=7680,recipe={name},seed={seed}"
        assert f"--workdir={tmp_path}/{label}/seed{seed}" in cmd and init in cmd
        assert cmd[-1] == "--config.eval.num_prompts=64"
        if "+" in label:
            assert "--config.rl.adv_norm=none" in cmd and f"--config.recipe={label}" in cmd
    assert fit[1].endswith("launch/fit.py") and f"--out={tmp_path}/fit" in fit and len(fit) == 2 + 6 + 2
    # fresh seeds for a confirmation: 2 and 3, from a given warm start (none is run)
    rc = sweep.main(["--config=configs/tiny.py:samples=7680", "--recipes=scalerl", "--seeds=2", "--first_seed=2",
                     f"--workdir={tmp_path}", "--init_checkpoint=/ws/params", "--dry_run"])
    cmds = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert rc == 0 and [c[2] for c in cmds[:2]] == [f"--config=configs/tiny.py:samples=7680,recipe=scalerl,seed={s}"
                                                    for s in (2, 3)]
    assert f"--workdir={tmp_path}/scalerl/seed3" in cmds[1] and "--config.init_checkpoint=/ws/params" in cmds[1]


@pytest.mark.parametrize("recipes, message", [
    ("scalerl,dapoo", "unknown recipe 'dapoo'; valid recipes: dapo, grpo, magistral, minimax, scalerl"),
    ("scalerl+rl.adv_norm", "must look like section.field=value"),
    ("scalerl+adv_norm=none", r"unknown config arg\(s\) \['adv_norm'\]"),
    ("scalerl+prompts=0", "prompts=0 must be positive"),
    ("grpo,grpo", "give distinct recipes"),
])
def test_bad_recipe_specs_fail_clearly(tmp_path, recipes, message):
    with pytest.raises(SystemExit, match=message):
        sweep.main([f"--recipes={recipes}", f"--workdir={tmp_path}", "--dry_run"])


FAKE_PYTHON = r'''#!{python}
"""Stand-in interpreter: run.py writes a synthetic curve, anything else runs for real."""
import json, math, os, sys
script, args = sys.argv[1], sys.argv[2:]
if not script.endswith("run.py"):
    os.execv({python!r}, [{python!r}, script, *args])
flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
wd = flags["workdir"]
os.makedirs(wd, exist_ok=True)
sweep_dir = os.path.dirname(wd) if wd.endswith("warmstart") else os.path.dirname(os.path.dirname(wd))
with open(os.path.join(sweep_dir, "calls.log"), "a") as f:
    f.write(wd + "\n")
if wd.endswith("warmstart"):
    os.makedirs(os.path.join(wd, "warmstart", "params"))
    sys.exit(0)
arg = dict(kv.split("=") for kv in flags["config"].split(":", 1)[1].split(","))
label = flags.get("config.recipe", arg["recipe"])
seed = int(arg["seed"])
A = {{"scalerl": 0.6, "grpo": 0.45}}.get(arg["recipe"], 0.5)
sys.path.insert(0, {root!r})
from configs import tiny
steps = tiny.get_config(flags["config"].split(":", 1)[1]).steps  # the planned steps, as the trainer records them
json.dump({{"recipe": label, "seed": seed, "steps": steps}}, open(os.path.join(wd, "config.json"), "w"))
if os.path.exists(os.path.join(wd, "preempt_me")):  # stopped after recording its new plan, as a preempted run is
    os.remove(os.path.join(wd, "preempt_me"))
    sys.exit(75)
os.makedirs(os.path.join(wd, "checkpoints", str(steps)), exist_ok=True)
with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    for i in range(25):
        c = i * 4e9
        y = 0.1 + (A - 0.1) / (1 + (2e10 / c) ** 1.8) if c else 0.1
        y += 0.004 * math.sin(7 * i + seed)
        f.write(json.dumps({{"step": i * 10 + 1, "loss": 0.1, "compute_flops": c + 1, "samples": i, "truncation_rate": 0.01,
                            "interruption_rate": 0.0, "rho_abs_dev_first_mb": 1e-7, "keep_frac": 0.5}}) + "\n")
        f.write(json.dumps({{"step": i * 10, "compute_flops": c, "eval/pass_rate": y}}) + "\n")
'''


def test_sweep_runs_fits_and_writes_the_comparison(tmp_path):
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, root=ROOT))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "sweep"
    argv = ["--recipes=scalerl,grpo", "--seeds=2", f"--workdir={out}", f"--python={fake}", "--fit_args=--n-boot=40",
            "--poll_s=0.1"]
    assert sweep.main(argv) == 0
    calls = (out / "calls.log").read_text().split()
    assert calls == [str(out / "warmstart")] + [str(out / r / f"seed{s}") for s in (0, 1) for r in ("scalerl", "grpo")]
    text = (out / "comparison.md").read_text()
    main_table = text.split("read as a power law")[0]
    fitted = {m.group(1): (float(m.group(2)), float(m.group(3)))
              for m in re.finditer(r"^\| (\w+) \| ([0-9.]+) \[[^|]*\| ([0-9.]+) \[", main_table, re.M)}
    assert abs(fitted["scalerl"][0] - 0.6) < 0.02 and abs(fitted["grpo"][0] - 0.45) < 0.02  # the synthetic A
    assert all(abs(b - 1.8) < 0.2 for _, b in fitted.values())  # and B
    assert "Ranking" in text and "1. scalerl" in text
    assert re.search(r"^\| scalerl \|.*\| [0-9.]+ (in|OUTSIDE) \[[0-9.]+, [0-9.]+\] \(predicted [0-9.]+\) \|", text, re.M)
    assert (out / "curves.png").stat().st_size > 0 and (out / "fit" / "fit.json").exists()
    record = json.loads((out / "sweep.json").read_text())
    assert all(r["rc"] == 0 for r in record["runs"]) and record["wall_s"] > 0
    # a second sweep skips the finished runs and the warm start, and writes the same table
    assert sweep.main(argv) == 0
    assert (out / "calls.log").read_text().split() == calls
    assert (out / "comparison.md").read_text().split("in all")[1].split("\n", 1)[1] == \
        text.split("in all")[1].split("\n", 1)[1]
    # twice the budget: the finished runs resume to it (the warm start is not redone), except one
    # without a checkpoint to resume from (shipped results keep none), which is left as it is
    shutil.rmtree(out / "grpo" / "seed1" / "checkpoints")
    assert sweep.main(argv + ["--config=configs/tiny.py:samples=512000"]) == 0
    assert (out / "calls.log").read_text().split() == calls + calls[1:4]
    record = json.loads((out / "sweep.json").read_text())
    assert [r.get("extended_from_steps") for r in record["runs"]] == [1000, 125, 1000, None]  # grpo: 8x the rows
    assert [bool(r.get("skipped")) for r in record["runs"]] == [False, False, False, True]
    assert [json.loads((out / r / "seed0" / "config.json").read_text())["steps"] for r in ("scalerl", "grpo")] == [2000, 250]
    # an extension stopped part way (its config.json already plans the longer budget) is resumed by
    # the next sweep, not read as finished
    (out / "scalerl" / "seed0" / "preempt_me").touch()
    longer = argv + ["--config=configs/tiny.py:samples=1024000"]
    assert sweep.main(longer) == 1
    assert sweep.main(longer) == 0
    record = json.loads((out / "sweep.json").read_text())
    assert [(r.get("rc"), bool(r.get("skipped"))) for r in record["runs"]] == [(0, False), (0, True), (0, True), (0, True)]
    assert (out / "calls.log").read_text().split()[-1] == str(out / "scalerl" / "seed0")


SLOW_FAKE_PYTHON = r'''#!{python}
"""Stand-in interpreter: run.py writes a synthetic curve one eval at a time and, like the
trainer, exits 75 on SIGTERM."""
import json, math, os, signal, sys, time
script, args = sys.argv[1], sys.argv[2:]
if not script.endswith("run.py"):
    os.execv({python!r}, [{python!r}, script, *args])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
wd = flags["workdir"]
os.makedirs(wd, exist_ok=True)
if wd.endswith("warmstart"):
    os.makedirs(os.path.join(wd, "warmstart", "params"))
    sys.exit(0)
arg = dict(kv.split("=") for kv in flags["config"].split(":", 1)[1].split(","))
A = {{"scalerl": 0.6, "grpo": 0.3}}[arg["recipe"]]
json.dump({{"recipe": arg["recipe"], "seed": int(arg["seed"]), "steps": 240}}, open(os.path.join(wd, "config.json"), "w"))
with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    for i in range(25):
        c = i * 4e9
        y = 0.1 + (A - 0.1) / (1 + (2e10 / c) ** 1.8) if c else 0.1
        f.write(json.dumps({{"step": i * 10, "compute_flops": c, "eval/pass_rate": y + 0.003 * math.sin(7 * i)}}) + "\n")
        f.flush()
        time.sleep(0.4)
'''


def test_prune_stops_a_recipe_the_law_rules_out(tmp_path):
    fake = tmp_path / "fakepy"
    fake.write_text(SLOW_FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "sweep"
    argv = ["--recipes=scalerl,grpo", "--seeds=2", f"--workdir={out}", f"--python={fake}", "--jobs=2", "--prune",
            "--prune_boot=100", "--poll_s=0.2", "--fit_args=--n-boot=40"]
    assert sweep.main(argv) == 0
    record = json.loads((out / "sweep.json").read_text())
    assert list(record["pruned"]) == ["grpo"]
    assert "grpo's A" not in record["pruned"]["grpo"]["reason"] and "scalerl's A >=" in record["pruned"]["grpo"]["reason"]
    runs = {(r["label"], r["seed"]): r for r in record["runs"]}
    assert runs[("scalerl", 0)]["rc"] == 0 and runs[("scalerl", 1)]["rc"] == 0
    assert runs[("grpo", 0)]["rc"] == 75 and runs[("grpo", 0)]["pruned"]  # stopped mid-run ...
    n_evals = sum("eval/pass_rate" in line for line in open(out / "grpo" / "seed0" / "metrics.jsonl"))
    assert 3 <= n_evals < 25
    assert runs[("grpo", 1)]["rc"] is None and not (out / "grpo" / "seed1").exists()  # ... and never started
    saved = record["compute_saved"]
    # planned: 4 runs x 240 steps x 4e8 FLOPs/step; saved: grpo seed1 whole and the rest of seed0
    assert saved["planned_flops"] == pytest.approx(4 * 240 * 4e8)
    assert saved["saved_flops"] == pytest.approx(240 * 4e8 + (24 - n_evals + 1) * 4e9, rel=1e-6)
    assert "Pruned grpo" in (out / "comparison.md").read_text()
    marker = json.loads((out / "grpo" / "seed0" / sweep.PRUNED).read_text())
    assert marker == record["pruned"]["grpo"]
    # Resumed with --prune: the pruned run is skipped (its curve untouched), the record the same.
    before = (out / "grpo" / "seed0" / "metrics.jsonl").read_text()
    assert sweep.main(argv) == 0
    again = json.loads((out / "sweep.json").read_text())
    assert (out / "grpo" / "seed0" / "metrics.jsonl").read_text() == before
    assert again["pruned"] == record["pruned"] and again["compute_saved"] == saved
    runs = {(r["label"], r["seed"]): r for r in again["runs"]}
    assert runs[("grpo", 0)]["skipped"] and runs[("grpo", 1)]["rc"] is None and not (out / "grpo" / "seed1").exists()


def test_named_comparison_reuses_the_runs_of_its_directory(tmp_path):
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, root=ROOT))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "sweep"
    common = [f"--workdir={out}", f"--python={fake}", "--fit_args=--n-boot=40", "--poll_s=0.1", "--seeds=2"]
    assert sweep.main(["--recipes=scalerl,grpo", *common]) == 0
    calls = (out / "calls.log").read_text().split()
    assert sweep.main(["--recipes=scalerl,grpo+rl.adv_norm=none", "--name=loo", *common]) == 0
    new_calls = (out / "calls.log").read_text().split()[len(calls):]
    assert new_calls == [str(out / "grpo+rl.adv_norm=none" / f"seed{s}") for s in (0, 1)]  # scalerl's seeds reused
    loo = (out / "comparison_loo.md").read_text()
    assert "| grpo+rl.adv_norm=none |" in loo and "| grpo |" not in loo and "`fit_loo/fit.json`" in loo
    assert (out / "fit_loo" / "fit.json").exists() and (out / "sweep_loo.json").exists()
    assert "| grpo |" in (out / "comparison.md").read_text()  # the first comparison is left as it was
