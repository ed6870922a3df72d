"""Diagnostics that refuse bad curves: each stress curve is flagged or rejected with a named reason,
clean sigmoid curves are not, and the tests' statistics match independent references."""

import itertools

import numpy as np
import pytest
from scipy import stats

from rl_scaling.scaling import api, calibration as cal, compare, diagnostics, law
from rl_scaling.scaling.errors import ScalingDataError


def _codes(res):
    return {code for code, _ in res.flags}


def _table1(row=cal.TABLE1[0], noise=0.01, seed=0, n=40):
    c, y = cal.table1_curve(row, n=n)
    return c, y + np.random.default_rng(seed).normal(0, noise, y.size)


# ---------------------------------------------------------------- the statistics against references

def test_runs_test_matches_exact_enumeration():
    """Expected runs and the lower tail against all C(12, 5) sign arrangements."""
    n1, n = 5, 12
    counts = []
    for pos in itertools.combinations(range(n), n1):
        s = -np.ones(n)
        s[list(pos)] = 1
        counts.append(1 + np.count_nonzero(s[1:] != s[:-1]))
    counts = np.array(counts)
    signs = np.array([1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1.0])  # 2 runs: the fewest possible
    out = diagnostics.runs_test(signs * 0.01)
    assert out["runs"] == 2 and out["expected"] == pytest.approx(counts.mean())
    assert out["p_value"] == pytest.approx(np.mean(counts <= 2), abs=0.01)
    mid = np.array([1, -1, -1, 1, 1, -1, -1, -1, 1, 1, -1, -1.0])  # 6 runs, near the mean
    assert diagnostics.runs_test(mid)["p_value"] == pytest.approx(np.mean(counts <= 6), abs=0.05)
    # independent groups add: two copies have twice the expected runs
    two = diagnostics.runs_test(np.concatenate([mid, mid]), np.repeat([0, 1], n))
    assert two["expected"] == pytest.approx(2 * counts.mean()) and two["runs"] == 12


def test_noise_test_is_a_chi_square_in_noise_units():
    r = np.random.default_rng(1).normal(0, 0.02, 50)
    out = diagnostics.noise_test(r, 0.01, 47)
    chi2 = float(np.sum((r / 0.01) ** 2))
    assert out["chi2"] == pytest.approx(chi2) and out["p_value"] == pytest.approx(stats.chi2.sf(chi2, 47))
    assert out["ratio"] == pytest.approx(np.sqrt(chi2 / 47)) and out["p_value"] < 1e-6
    np.testing.assert_allclose(diagnostics.binomial_sd(0.3, 1024), np.sqrt(0.3 * 0.7 / 1024))


def test_robust_sd_recovers_the_noise_of_a_trending_curve():
    c, y = _table1(noise=0.02, seed=3, n=400)
    assert diagnostics.robust_sd(y[1:]) == pytest.approx(0.02, rel=0.15)


def test_decline_test_rarely_flags_monotone_curves():
    """False alarms at alpha = 0.01 on 200 noisy Table-1 curves and 200 flat noise sequences."""
    rng = np.random.default_rng(5)
    flagged = []
    for i in range(200):
        row = cal.TABLE1[i % len(cal.TABLE1)]
        c, y = cal.table1_curve(row)
        flagged.append(diagnostics.decline_test(c[1:], y[1:] + rng.normal(0, 0.01, 40))["p_value"] < 0.01)
        flat = 0.5 + rng.normal(0, 0.01, 40)
        flagged.append(diagnostics.decline_test(np.arange(1.0, 41), flat)["p_value"] < 0.01)
    # 400 tests at 1%: 4 expected; more than 12 has binomial probability < 1e-3
    assert sum(flagged) <= 12, sum(flagged)


# ---------------------------------------------------------------- stress curves through the fit

def test_clean_sigmoid_raises_no_shape_flags():
    for seed in range(3):
        c, y = _table1(seed=seed)
        res = api.fit_arrays(c, y, c_min=0, n_boot=200, unit="gpu_hours")
        assert not _codes(res) & {"not_sigmoidal", "lack_of_fit", "no_saturation", "not_identifiable"}, res.flags


def test_straight_line_is_flagged_no_saturation():
    c = np.linspace(0, 1000, 41)
    y = 0.2 + 0.0003 * c + np.random.default_rng(2).normal(0, 0.01, c.size)
    res = api.fit_arrays(c, y, c_min=0, n_boot=200)
    assert {"no_saturation", "not_identifiable"} <= _codes(res), res.flags
    msg = dict(res.flags)["no_saturation"]
    assert "baseline fits as well as the sigmoid" in msg
    sp = res.summary()["sigmoid_vs_power_law"]
    assert sp["preferred_by_aic"] in compare.BASELINES and "heldout" in sp["linear"]


def test_rise_then_collapse_is_not_sigmoidal():
    c = np.linspace(0, 4000, 41)
    rise = law.sigmoid(c, 0.6, 3.0, 1000.0, 0.2)
    y = np.where(c < 2000, rise, rise - 0.25 * (c - 2000) / 2000)  # peaks at 0.6, falls to ~0.35
    y = y + np.random.default_rng(0).normal(0, 0.01, c.size)
    res = api.fit_arrays(c, y, c_min=0, n_boot=200)
    assert "not_sigmoidal" in _codes(res), res.flags
    assert "rises then falls" in dict(res.flags)["not_sigmoidal"]
    d = res.summary()["diagnostics"]["decline"]
    assert d["peak"] > d["low"] + 0.1 and d["peak_compute"] < d["low_compute"]


def test_late_dip_is_not_sigmoidal():
    c, y = _table1(seed=4)
    y[-4:] -= 0.06  # the last 4 of 40 evals dip by 6 noise sd
    res = api.fit_arrays(c, y, c_min=0, n_boot=200, unit="gpu_hours")
    assert "not_sigmoidal" in _codes(res), res.flags
    assert res.summary()["diagnostics"]["decline"]["low_compute"] >= c[-4]
    assert not res.identifiable or "not_sigmoidal" in _codes(res)


def test_two_stage_curve_is_a_lack_of_fit():
    """Skills switching on in two steps: monotone, but one sigmoid leaves long runs of residual signs."""
    c = np.linspace(0, 4000, 61)
    y = 0.2 + 0.2 * law.gain_fraction(c, 8.0, 800.0) + 0.2 * law.gain_fraction(c, 8.0, 2600.0)
    y = y + np.random.default_rng(1).normal(0, 0.005, c.size)
    res = api.fit_arrays(c, y, c_min=0, n_boot=200)
    assert "lack_of_fit" in _codes(res), res.flags
    assert "runs test" in dict(res.flags)["lack_of_fit"]


def test_residuals_far_above_the_binomial_noise_are_a_lack_of_fit():
    c, y0 = cal.table1_curve(cal.TABLE1[0])
    y = y0 + np.random.default_rng(6).normal(0, 0.045, y0.size)  # 3x the noise of 1,024 samples per eval
    run = api.Run(name="r", recipe="r", seed=None, compute=c, pass_rate=y, source="r", axis="gpu_hours",
                  eval_samples=1024)
    res = api.fit_runs([run], c_min=0, n_boot=200)
    noise = res.summary()["diagnostics"]["noise"]
    assert noise["ratio"] > 2 and "lack_of_fit" in _codes(res)
    y_ok = y0 + np.random.default_rng(7).normal(0, 0.014, y0.size)  # the binomial sd at p ~ 0.5
    ok = api.fit_runs([api.Run(name="r", recipe="r", seed=None, compute=c, pass_rate=y_ok, source="r",
                               axis="gpu_hours", eval_samples=1024)], c_min=0, n_boot=200)
    assert ok.summary()["diagnostics"]["noise"]["p_value"] > 0.01 and "lack_of_fit" not in _codes(ok)


@pytest.mark.parametrize("scale,msg", [(100.0, "percent scale"), (-1.0, r"outside \[0, 1\]")])
def test_pass_rates_outside_unit_interval_are_named(scale, msg):
    c, y = cal.table1_curve(cal.TABLE1[0])
    with pytest.raises(ScalingDataError, match=msg):
        api.fit_arrays(c, y * scale)
    s = api.refit(list(zip(c, y * scale)))
    assert s["status"] == "error" and ("percent" in s["message"] if scale > 1 else "outside" in s["message"])


def test_missed_holdout_prediction_is_a_flag():
    """The flag is raised exactly when the last eval falls outside its prediction interval."""
    seen = set()
    for seed, bump in itertools.product(range(3), (0.0, 0.08)):
        c, y = _table1(seed=seed)
        y[-1] += bump
        res = api.fit_arrays(c, y, c_min=0, n_boot=200, unit="gpu_hours")
        lp = res.summary()["extrapolation"]["last_point"]
        assert ("holdout_missed" in _codes(res)) == (not lp["covered"])
        seen.add(lp["covered"])
    assert seen == {True, False}


# ---------------------------------------------------------------- comparison and ranking

def _result(name, A, B=2.0, cm=2500.0, hi=4.0, seed=0):
    c = np.concatenate([[0.0], np.linspace(0.1, hi, 40) * cm])
    y = law.sigmoid(c, A, B, cm, cal.R0) + np.random.default_rng(seed).normal(0, 0.005, c.size)
    return api.fit_arrays(c, y, name=name, c_min=0, n_boot=200, unit="gpu_hours")


def test_pairs_with_an_unmeasured_A_are_undecided_and_unranked():
    good, other = _result("good", 0.62, seed=1), _result("other", 0.52, seed=2)
    early = _result("early", 0.70, hi=0.4, seed=3)  # the window ends well before C_mid
    assert good.identifiable and other.identifiable and not early.identifiable
    cmp_ = compare.compare_recipes([good, other, early])
    pairs = {(p["a"], p["b"]): p for p in cmp_["pairs"]}
    assert pairs[("good", "other")]["winner"] == "good"
    for key in (("good", "early"), ("other", "early")):
        assert pairs[key]["winner"] == "undecided" and "early: A is only a lower bound" in pairs[key]["rule"]
    assert [r["name"] for r in cmp_["ranking"]] == ["good", "other"]
    assert "early" in cmp_["ranking_note"]
    none = compare.compare_recipes([early, _result("early2", 0.6, hi=0.4, seed=4)])
    assert none["ranking"] == [] and none["ranking_note"].startswith("no ranking")
    # the heat map's table hides the extrapolated cells of the unmeasured one
    _, lo, hi, shown = compare.budget_bands([good, early], [500.0, 1e5])
    assert shown.tolist() == [[True, True], [True, False]] and (lo <= hi).all()


def test_grid_method_reports_the_grid_fit_everywhere():
    c, y = _table1(seed=8)
    kw = dict(c_min=0, n_boot=100, unit="gpu_hours", method="grid",
              grid={"a_grid": np.round(np.arange(0.55, 0.7001, 0.005), 3), "cmid_grid": np.linspace(1000, 6000, 26),
                    "inner": "batched"})
    res = api.fit_arrays(c, y, **kw)
    s = res.summary()
    on_grid = lambda v: abs(v * 200 - round(v * 200)) < 1e-9  # noqa: E731  (multiples of 0.005)
    assert s["method"] == "grid" and on_grid(s["A_fit"]) and res.center is res.fit
    assert on_grid(s["extrapolation"]["A_early"])
    assert s["sigmoid_vs_power_law"]["sigmoid"]["ssr"] == pytest.approx(res.fit.ssr)
    assert on_grid(s["sigmoid_vs_power_law"]["sigmoid"]["heldout"]["A"])
    edge = api.fit_arrays(c, y, **{**kw, "grid": {**kw["grid"], "a_grid": np.arange(0.45, 0.5001, 0.005)}})
    assert not edge.identifiable and any("edge of its grid" in r for r in edge.reasons)
