"""Sigmoid versus power law, the recipe comparison rule, and the eval-and-fit loop's refit()."""

import numpy as np
import pytest

from rl_scaling.scaling import api, calibration as cal, compare, fit, law


def _run(name, A, B, cm, seed=0, noise=0.005, c=None):
    c = np.concatenate([[0.0], np.linspace(0.1, 4, 40) * cm]) if c is None else c
    y = law.sigmoid(c, A, B, cm, cal.R0) + np.random.default_rng(seed).normal(0, noise, c.size)
    return api.Run(name=name, recipe=name, seed=None, compute=c, pass_rate=y, source=name, axis="gpu_hours")


def test_power_law_fit_recovers_a_power_law():
    c = np.geomspace(100, 1e5, 30)
    y = law.power_law(c, 0.7, 3.0, 0.4)
    p = compare.fit_power_law(c, y)
    assert p["A"] == pytest.approx(0.7, abs=1e-4) and p["B"] == pytest.approx(0.4, rel=1e-3)
    assert p["D"] == pytest.approx(3.0, rel=1e-3)


def test_sigmoid_beats_power_law_on_sigmoid_data():
    row = cal.TABLE1[0]
    c, y = cal.table1_curve(row)
    y = y + np.random.default_rng(0).normal(0, 0.01, y.size)
    out = compare.sigmoid_vs_power(c[1:], y[1:], lambda cc, yy: fit.fit_direct(cc, yy, r0=cal.R0))
    assert out["preferred_by_aic"] == "sigmoid"
    assert out["sigmoid"]["heldout"]["rmse"] < out["power_law"]["heldout"]["rmse"]
    assert compare.aic(1.0, 10, 3) < compare.aic(1.0, 10, 4)


def test_paper_rule_refits_with_mean_A_when_within_margin():
    a = api.fit_runs([_run("steep", 0.610, 2.4, 2500.0, seed=1)], c_min=0, n_boot=200)
    b = api.fit_runs([_run("shallow", 0.600, 1.5, 2500.0, seed=2)], c_min=0, n_boot=200)
    lo = api.fit_runs([_run("low", 0.500, 2.0, 2500.0, seed=3)], c_min=0, n_boot=200)
    pair = compare.compare_pair(a, b)
    assert pair["rule"].startswith("A within margin")
    assert pair["winner"] == "steep" and pair["B_a"] > pair["B_b"]
    assert pair["mean_A"] == pytest.approx((a.fit.A + b.fit.A) / 2)
    pair2 = compare.compare_pair(a, lo)
    assert pair2["rule"].startswith("A differs") and pair2["winner"] == "steep" and pair2["p_A_greater"] > 0.99
    cmp_ = compare.compare_recipes([lo, b, a])
    assert [r["name"] for r in cmp_["ranking"]] == ["steep", "shallow", "low"]
    assert {t["name"] for t in cmp_["table"]} == {"steep", "shallow", "low"}
    table = compare.budget_table([a, lo], [1000.0, 1e6])
    assert table.shape == (2, 2) and table[0, 1] == pytest.approx(a.fit.A, abs=1e-3)


def test_no_winner_and_no_ranking_where_the_bootstrap_does_not_separate_them():
    # same law, independent noise: within the margin, and B alike up to noise
    a = api.fit_runs([_run("twin_a", 0.60, 2.0, 2500.0, seed=4, noise=0.01)], c_min=0, n_boot=200)
    b = api.fit_runs([_run("twin_b", 0.60, 2.0, 2500.0, seed=5, noise=0.01)], c_min=0, n_boot=200)
    pair = compare.compare_pair(a, b)
    assert pair["rule"].startswith("A within margin") and pair["winner"] == compare.UNDECIDED
    assert "do not separate" in pair["rule"] and 0.025 < pair["p_B_greater"] < 0.975
    # A apart by more than a tiny margin, but only by noise: no call either
    loose = compare.compare_pair(a, b, margin=abs(a.fit.A - b.fit.A) / 2)
    assert loose["rule"].startswith("A differs") and loose["winner"] == compare.UNDECIDED
    lo = api.fit_runs([_run("low", 0.500, 2.0, 2500.0, seed=3)], c_min=0, n_boot=200)
    cmp_ = compare.compare_recipes([a, b, lo])
    assert cmp_["ranking"] == [] and "twin_a vs twin_b undecided" in cmp_["ranking_note"]
    assert sorted(cmp_["supported"]) == ["twin_a > low", "twin_b > low"]


def test_refit_statuses_and_target():
    assert api.refit([])["status"] == "too_few_points"
    few = api.refit([(0, 0.3), (100, 0.35), (200, 0.4)])
    assert few["status"] == "too_few_points" and "keep training" in few["message"]
    assert api.refit([(0, 0.3)] + [(c, 0.5) for c in range(100, 1001, 100)])["status"] == "error"  # constant
    assert api.refit([("a", "b", "c")])["status"] == "error"
    row = cal.TABLE1[0]
    c, y = cal.table1_curve(row)
    y = y + np.random.default_rng(4).normal(0, 0.01, y.size)
    recs = [{"compute": float(ci), "pass_rate": float(yi)} for ci, yi in zip(c, y)]
    recs.append({"compute": float("nan"), "pass_rate": 0.5})
    recs.append(dict(recs[5]))  # an eval logged twice
    s = api.refit(recs[::-1], target_compute=8 * row[1], c_min=0)
    assert s["status"] == "ok" and s["window"]["n_points"] == 40
    assert any("dropped 1" in m for m in s["messages"]) and any("averaged" in m for m in s["messages"])
    t = s["target"]
    assert t["extrapolated"] and t["pi"][0] < t["pass_rate"] < t["pi"][1]
    assert abs(t["pass_rate"] - law.sigmoid(8 * row[1], row[3], row[2], row[1], cal.R0)) < 0.03
