"""Comparisons from independent random streams, the still-rising and late-dip checks, the measured eval
noise, the block bootstrap, both curve shapes side by side, and the pre-registration scorer."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rl_scaling.scaling import api, compare, diagnostics, io, law, shapes, uncertainty

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = np.linspace(0.25, 8.0, 32)  # evals to 8x C_mid = 1


def _seeds(rng, n=3, A=0.58, B=1.5, noise=0.0032, extra=None, eval_samples=None):
    runs = []
    for s in range(n):
        y = law.sigmoid(C, A, B, 1.0, 0.18) + rng.normal(0, noise, C.size) + rng.normal(0, 0.004)
        if extra is not None:
            y = y + extra
        runs.append(io.Run(name=f"r/seed{s}", recipe="r", seed=str(s), compute=np.r_[0.0, C],
                           pass_rate=np.r_[0.18, y], source=f"synthetic{s}", axis="compute",
                           eval_samples=eval_samples))
    return runs


def test_identical_recipes_get_p_near_half_only_with_independent_streams():
    runs = _seeds(np.random.default_rng(0))
    sa, sb = api.streams(7, 2)  # what launch/fit.py does: one child stream per recipe
    a = api.fit_runs(runs, name="a", n_boot=400, seed=sa)
    b = api.fit_runs(runs, name="b", n_boot=400, seed=sb)
    pair = compare.compare_pair(a, b)
    assert 0.35 < pair["p_A_greater"] < 0.65, pair
    assert pair["winner"] == compare.UNDECIDED
    # The old code seeded every recipe's bootstrap alike: replicate i of both is the same draw, so
    # P(A_a > A_b) is 0 for identical curves and the pair reads as decided.
    old_a = api.fit_runs(runs, name="a", n_boot=400, seed=0)
    old_b = api.fit_runs(runs, name="b", n_boot=400, seed=0)
    p_old = compare.compare_pair(old_a, old_b)["p_A_greater"]
    assert not 0.35 < p_old < 0.65
    # and the replicate A's of two recipes are uncorrelated with their own streams
    r = np.corrcoef(a.boot.params()["A"], b.boot.params()["A"])[0, 1]
    assert abs(r) < 0.15


def test_streams_are_reproducible_and_distinct():
    s1, s2 = api.streams(3, 2), api.streams(3, 2)
    assert [s.generate_state(2).tolist() for s in s1] == [s.generate_state(2).tolist() for s in s2]
    assert s1[0].generate_state(2).tolist() != s1[1].generate_state(2).tolist()


def test_fit_cli_records_one_stream_per_recipe(tmp_path):
    rows = ["run,seed,compute,pass_rate"]
    rng = np.random.default_rng(1)
    for run in ("alpha", "beta"):
        for s in range(2):
            y = law.sigmoid(C, 0.6, 1.8, 1.0, 0.2) + rng.normal(0, 0.004, C.size)
            rows += [f"{run},{s},{c},{v}" for c, v in zip(C, y)]
    (tmp_path / "runs.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "fit"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "fit.py"), str(tmp_path / "runs.csv"),
                        f"--out={out}", "--n-boot=100", "--seed=5"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    fit = json.loads((out / "fit.json").read_text())
    keys = {k: tuple(v["spawn_key"]) for k, v in fit["settings"]["streams"].items()}
    assert fit["settings"]["root_seed"] == 5 and len(set(keys.values())) == 2
    assert "shape" in fit["recipes"]["alpha"] and "power_law" in fit["recipes"]["alpha"]["shape"]
    assert "holds_under_both_shapes" in fit["comparison"]["pairs"][0]


def test_still_rising_tail_makes_A_a_lower_bound():
    rng = np.random.default_rng(2)
    # a sigmoid that saturates, then climbs again over the last quarter (a second skill switching on)
    climb = np.where(C > 6.0, 0.03 * np.log(C / 6.0) / np.log(8.0 / 6.0), 0.0)
    res = api.fit_runs(_seeds(rng, extra=climb), n_boot=200)
    codes = [k for k, _ in res.flags]
    assert "still_rising" in codes
    s = res.summary()
    assert s["A"] is None and s["A_lower_bound"] is not None and not s["identifiable"]
    assert "still rising" in " ".join(t for _, t in compare.blocking(res))


def test_saturated_curves_are_rarely_still_rising():
    rng = np.random.default_rng(3)
    hits = sum("still_rising" in [k for k, _ in api.fit_runs(_seeds(rng), n_boot=50, holdout=None).flags]
               for _ in range(20))
    assert hits <= 2


def test_late_dip_at_realistic_noise_is_flagged():
    rng = np.random.default_rng(4)
    fn = lambda c, y: __import__("rl_scaling.scaling.fit", fromlist=["fit_direct"]).fit_direct(c, y)  # noqa: E731
    flagged, false = 0, 0
    for _ in range(20):
        y = law.sigmoid(C, 0.58, 1.5, 1.0, 0.18) + rng.normal(0, 0.0032, C.size)
        false += diagnostics.late_dip_test(C, y, np.zeros(C.size), fn)["p_value"] < diagnostics.ALPHA
        y[-3:] -= 0.02
        flagged += diagnostics.late_dip_test(C, y, np.zeros(C.size), fn)["p_value"] < diagnostics.ALPHA
    assert flagged >= 18 and false <= 2
    # through fit_runs it is a not_sigmoidal finding, so the recipe cannot be ranked
    runs = _seeds(rng, n=1, extra=np.where(np.arange(C.size) >= C.size - 3, -0.025, 0.0))
    res = api.fit_runs(runs, n_boot=50)
    assert "not_sigmoidal" in [k for k, _ in res.flags] and compare.blocking(res)


def test_lack_of_fit_uses_the_measured_noise_and_says_which():
    rng = np.random.default_rng(5)
    wiggle = 0.01 * np.sin(C * 3.0)  # structure 3x the eval noise, well under a binomial bound over 1,024 samples
    runs = _seeds(rng, extra=wiggle, eval_samples=1024)
    binom = api.fit_runs(runs, n_boot=50)
    noise = binom.extras["diagnostics"]["noise"]
    assert "binomial" in noise["source"] and noise["ratio"] < 1 and noise["p_value"] > 0.5
    assert not any("eval noise" in m for k, m in binom.flags if k == "lack_of_fit")
    measured = api.fit_runs(runs, n_boot=50, eval_sd=0.0032, eval_sd_source="noise.json")
    noise = measured.extras["diagnostics"]["noise"]
    assert "measured" in noise["source"] and noise["ratio"] > 2
    assert any("noise.json" in m for k, m in measured.flags if k == "lack_of_fit")


def test_block_bootstrap_when_residuals_are_autocorrelated():
    idx = uncertainty.resample_index(20, 50, np.random.default_rng(0), block=4)
    assert idx.shape == (50, 20) and (np.diff(idx[:, :4], axis=1) == 1).all()
    rng = np.random.default_rng(6)
    ar = np.zeros(C.size)
    for i in range(1, C.size):  # AR(1) wiggles
        ar[i] = 0.9 * ar[i - 1] + rng.normal(0, 0.004)
    res = api.fit_runs(_seeds(rng, n=1, extra=ar), n_boot=50)
    auto = res.extras["autocorrelation"]
    assert auto["lag1"] > 0.3 and auto["block_bootstrap"] and auto["block"] >= 2
    clean = api.fit_runs(_seeds(rng, n=1), n_boot=50)
    assert not clean.extras["autocorrelation"]["block_bootstrap"]


def test_both_shapes_are_fitted_and_the_right_one_preferred():
    rng = np.random.default_rng(7)
    sig = api.fit_runs(_seeds(rng), n_boot=100)
    assert sig.extras["shape"]["preferred_by_aic"] == "sigmoid"
    # a power-law curve with no ceiling in sight: the power law wins by AIC
    pw_runs = [io.Run(name=f"p/seed{s}", recipe="p", seed=str(s), compute=C,
                      pass_rate=law.power_law(C, 0.9, 0.5, 0.4) + rng.normal(0, 0.003, C.size), source="p",
                      axis="compute") for s in range(3)]
    pw = api.fit_runs(pw_runs, n_boot=100)
    shape = pw.extras["shape"]
    assert shape["preferred_by_aic"] == "power_law"
    assert abs(shape["power_law"]["A"] - 0.9) < 0.05
    lo, hi = shape["power_law"]["ci_A"]
    assert lo <= shape["power_law"]["A"] <= hi


def test_observed_at_interpolates_in_log_compute():
    run = io.Run(name="x", recipe="x", seed="0", compute=np.array([0.0, 1.0, 4.0]),
                 pass_rate=np.array([0.1, 0.3, 0.5]), source="x", axis="compute")
    assert shapes.observed_at(run, 2.0) == pytest.approx(0.3 + 0.2 * np.log(2) / np.log(4))
    assert shapes.observed_at(run, 4.0 * (1 + shapes.LAST_EVAL_SLACK / 2)) == pytest.approx(0.5)
    assert shapes.observed_at(run, 4.1 * (1 + shapes.LAST_EVAL_SLACK)) is None


def test_preregister_freeze_then_score(tmp_path):
    rng = np.random.default_rng(8)
    short, long = ["run,seed,compute,pass_rate"], ["run,seed,compute,pass_rate"]
    c_long = np.linspace(0.25, 32.0, 128)
    for s in range(3):
        y = law.sigmoid(c_long, 0.6, 1.6, 1.0, 0.2) + rng.normal(0, 0.004, c_long.size)
        long += [f"rec,{s},{c},{v}" for c, v in zip(c_long, y)]
        short += [f"rec,{s},{c},{v}" for c, v in zip(c_long, y) if c <= 8.0]
    (tmp_path / "short").mkdir()
    (tmp_path / "long").mkdir()
    (tmp_path / "short" / "rec.csv").write_text("\n".join(short) + "\n")
    (tmp_path / "long" / "rec.csv").write_text("\n".join(long) + "\n")
    script = os.path.join(ROOT, "launch", "preregister.py")
    pre = tmp_path / "pre.json"
    r = subprocess.run([sys.executable, script, "freeze", f"--runs={tmp_path / 'short' / 'rec.csv'}", "--recipes=rec",
                        f"--out={pre}"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    frozen = json.loads(pre.read_text())["recipes"]["rec"]
    assert [round(a["compute"] / frozen["shipped_compute"]) for a in frozen["sigmoid"]["at"]] == [2, 3, 4]
    md = tmp_path / "ext.md"
    r = subprocess.run([sys.executable, script, "score", f"--prereg={pre}", f"--runs={tmp_path / 'long' / 'rec.csv'}",
                        f"--out={md}"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert "| rec | sigmoid | 4 |" in text
    # the true curve is a sigmoid: its one-seed intervals cover most of the 9 observations
    line = [ln for ln in text.splitlines() if ln.startswith("- sigmoid")][0]
    covered, scored = map(int, line.split("one-seed intervals ")[1].split(",")[0].split("/"))
    assert scored == 9 and covered >= 7
    # the .json beside it carries each row: observed = the seed's evals linear in ln C at the target
    rows = json.loads((tmp_path / "ext.json").read_text())["rows"]
    row = [r for r in rows if r["shape"] == "sigmoid" and r["multiple"] == 4][0]
    seed0 = np.array([ln.split(",")[2:] for ln in long[1:] if ln.startswith("rec,0,")], float)
    want = np.interp(np.log(row["compute"]), np.log(seed0[:, 0]), seed0[:, 1])
    assert row["observed"][0] == pytest.approx(want, abs=1e-9)
    assert row["mean"] == pytest.approx(np.mean(row["observed"]))


def test_nested_sweeps_are_skipped_unless_named(tmp_path):
    for d in ("a/seed0", "ext/a/seed0", "named/b/seed0"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "compute_flops": float(i), "eval/pass_rate": 0.1 + 0.01 * i}) + "\n"
            for i in range(6)))
    (tmp_path / "ext" / "sweep.json").write_text("{}")
    (tmp_path / "named" / "sweep_b.json").write_text("{}")  # a sweep run only with --name=b
    runs = io.load_inputs([str(tmp_path)])
    assert [r.source for r in runs] == [str(tmp_path / "a" / "seed0" / "metrics.jsonl")]
    assert len(io.load_inputs([str(tmp_path / "ext")])) == 1
    assert len(io.load_inputs([str(tmp_path / "named")])) == 1


def test_csv_byte_order_mark_is_noted(tmp_path):
    p = tmp_path / "bom.csv"
    p.write_text("\ufeffcompute,pass_rate\n" + "".join(f"{c},{0.1 + 0.01 * i}\n" for i, c in enumerate(C[:6])),
                 encoding="utf-8")
    (run,) = io.load_csv(str(p))
    assert any("byte-order mark" in n for n in run.notes)
