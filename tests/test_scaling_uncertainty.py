"""Bootstrap intervals and the identifiability flag (reduced versions of launch/bench_fit.py)."""

import numpy as np
import pytest

from rl_scaling.scaling import api, calibration as cal, fit, law, uncertainty as unc


def _noisy(row, seed):
    c, y = cal.table1_curve(row)
    return c, y + np.random.default_rng(seed).normal(0, 0.01, y.size)


def test_bootstrap_recovers_spread_and_is_batched():
    c, y = _noisy(cal.TABLE1[0], 0)
    f = fit.fit_direct(c[1:], y[1:], r0=y[0])
    for method in ("residual", "parametric", "pairs"):
        b = unc.bootstrap(f, c[1:], y[1:], 300, method, rng=0, r0_evals=1)
        assert b.theta.shape == (300, 4)
        ci = unc.param_intervals(b)
        assert ci["A"][0] < f.A < ci["A"][1]
        assert 0.003 < (ci["A"][1] - ci["A"][0]) / 2 < 0.05
        lo, hi = unc.curve_band(b, [1000.0, 5000.0])
        assert np.all(lo < hi)


def test_seed_bootstrap_uses_seed_spread():
    row = cal.TABLE1[0]
    c, y0 = cal.table1_curve(row)
    rng = np.random.default_rng(1)
    runs = []
    for s, off in enumerate((-0.02, 0.0, 0.02)):  # seeds whose ceilings differ
        y = law.sigmoid(c, row[3] + off, row[2], row[1], cal.R0) + rng.normal(0, 0.005, c.size)
        runs.append(api.Run(name=f"r/seed{s}", recipe="r", seed=str(s), compute=c, pass_rate=y,
                            source=f"seed{s}", axis="gpu_hours"))
    seeds = api.fit_runs(runs, c_min=0, n_boot=400)
    resid = api.fit_runs(runs, c_min=0, n_boot=400, boot_method="residual")
    assert seeds.boot.method == "seeds" and seeds.summary()["n_seeds"] == 3
    wa = np.diff(seeds.summary()["ci"]["A"])[0]
    wr = np.diff(resid.summary()["ci"]["A"])[0]
    assert wa > wr  # the seed-to-seed spread of A is real uncertainty


def test_noise_free_rows_are_identifiable():
    for row in cal.TABLE1:
        c, y = cal.table1_curve(row)
        r = api.fit_arrays(c, y, c_min=0, n_boot=100, holdout=None)
        assert r.identifiable, (row, r.reasons)


def test_b109_row_is_flagged_and_reported_as_a_lower_bound():
    row = cal.TABLE1[9]
    assert row[2] == 1.09
    flagged = 0
    for seed in range(8):
        c, y = _noisy(row, seed)
        s = api.fit_arrays(c, y, c_min=0, n_boot=300, holdout=None).summary()
        if not s["identifiable"]:
            flagged += 1
            assert s["A"] is None and s["A_lower_bound"] == s["ci"]["A"][0]
            assert "not identifiable" in s["messages"][0]
    assert flagged >= 7


def test_window_before_c_mid_is_flagged():
    row = cal.TABLE1[0]
    c, y = _noisy(row, 2)
    keep = c <= 0.8 * row[1]
    s = api.fit_arrays(c[keep], y[keep], c_min=0, n_boot=300, holdout=None).summary()
    assert not s["identifiable"] and s["A"] is None
    assert any("before C_mid" in m or "reaches" in m for m in s["messages"])


@pytest.mark.parametrize("row", [cal.TABLE1[0], cal.TABLE1[5]], ids=["ScaleRL 8B", "Scout MoE"])
def test_coverage_smoke(row):
    """A few replicates: intervals cover the truth most of the time (the full study is slow-marked)."""
    r = cal.noisy(row, replicates=12, n_boot=300, seed=11, grid_checks=1)
    assert r["coverage_A"] >= 0.75 and r["pi_coverage_last"] >= 0.75
    assert r["median_abs_A_err"] < 0.015
    assert r["max_ssr_direct_over_grid"] <= 1 + 1e-9


def test_expanded_level_widens_for_small_samples():
    assert unc.expanded_level(0.95, 37) > 0.95
    assert unc.expanded_level(0.95, 10_000) == pytest.approx(0.95, abs=1e-3)
