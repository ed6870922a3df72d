"""Seed-to-seed spread and the margin on A it supports, against numpy; fit.py reports both."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rl_scaling.scaling import io, noise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(recipe, seed, ys):
    c = np.linspace(0.0, 1e12, len(ys))
    return io.Run(name=f"{recipe}/{seed}", recipe=recipe, seed=str(seed), compute=c, pass_rate=np.asarray(ys, float),
                  source="test", axis="flops")


def test_plateau_is_the_mean_over_the_last_quarter_of_compute():
    r = _run("a", 0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])  # compute 0, 1/8, ..., 1
    assert noise.plateau(r) == pytest.approx(np.mean([0.7, 0.8, 0.9]))  # c >= 0.75


def test_seed_spread_is_the_pooled_within_recipe_sd():
    a = [[0.1, 0.50], [0.1, 0.54], [0.1, 0.52]]
    b = [[0.1, 0.40], [0.1, 0.46]]
    groups = {"a": [_run("a", i, y) for i, y in enumerate(a)], "b": [_run("b", i, y) for i, y in enumerate(b)],
              "c": [_run("c", 0, [0.1, 0.9])]}  # one seed: no spread, ignored
    s = noise.seed_spread(groups)
    va, vb = np.array([0.50, 0.54, 0.52]), np.array([0.40, 0.46])
    pooled = np.sqrt((((va - va.mean()) ** 2).sum() + ((vb - vb.mean()) ** 2).sum()) / 3)
    assert s["sd"] == pytest.approx(pooled) and s["df"] == 3 and s["seeds_per_recipe"] == 2
    assert s["per_recipe"]["a"]["sd"] == pytest.approx(va.std(ddof=1)) and "c" not in s["per_recipe"]
    m = noise.margin_from_seeds(pooled, 2)
    assert m == pytest.approx(1.96 * pooled)  # sqrt(2 / 2) = 1
    assert noise.choose_margin("auto", s) == (pytest.approx(m), "from the seeds")
    assert noise.choose_margin("0.05", s) == (0.05, "given")
    tight = noise.seed_spread({"a": [_run("a", i, [0.1, 0.5 + 0.001 * i]) for i in range(3)]})
    assert noise.choose_margin("auto", tight)[0] == noise.PAPER_MARGIN
    assert noise.choose_margin("auto", noise.seed_spread({"c": groups["c"]}))[0] == noise.PAPER_MARGIN


def test_fit_cli_reports_both_margins(tmp_path):
    rows = []
    for k, shift in enumerate((0.0, 0.03, -0.02)):
        for i in range(20):
            c = i * 1e11
            y = 0.1 + (0.6 + shift - 0.1) / (1 + (5e11 / c) ** 2) if c else 0.1
            rows.append(f"{c},{y:.5f},scalerl,{k}")
    csv = tmp_path / "runs.csv"
    csv.write_text("compute,pass_rate,run,seed\n" + "\n".join(rows) + "\n")
    ev = tmp_path / "noise.json"
    ev.write_text(json.dumps({"sd_measured_pooled": 0.003, "sd_binomial_pooled": 0.0031, "runs": []}))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "fit.py"), str(csv), f"--out={tmp_path / 'out'}",
                          "--n-boot=50", f"--noise={ev}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads((tmp_path / "out" / "fit.json").read_text())["noise"]
    plateaus = [np.mean([0.1 + (0.6 + s - 0.1) / (1 + (5e11 / (i * 1e11)) ** 2) for i in range(15, 20)])
                for s in (0.0, 0.03, -0.02)]
    assert got["seed_sd"] == pytest.approx(np.std(plateaus, ddof=1), rel=1e-3)
    assert got["margin_used"] == pytest.approx(1.96 * got["seed_sd"] * np.sqrt(2 / 3), rel=1e-6)
    assert got["margin_paper"] == 0.02 and got["eval_sd_measured"] == 0.003
    assert "margin on A:" in res.stdout and "eval-to-eval sd on the fixed prompt set: 0.0030" in res.stdout
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "fit.py"), str(csv), f"--out={tmp_path}",
                          "--margin=wide"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--margin='wide'" in bad.stderr
