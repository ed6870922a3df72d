"""Fits on synthetic Table-1 curves (exact and noisy) and input checks."""

import numpy as np
import pytest

from rl_scaling.scaling import api, calibration as cal, fit
from rl_scaling.scaling.errors import ScalingDataError


@pytest.mark.parametrize("row", cal.TABLE1, ids=[r[0] for r in cal.TABLE1])
def test_direct_fit_recovers_table1_exactly(row):
    _, cm, B, A = row
    c, y = cal.table1_curve(row)
    f = fit.fit_direct(c[1:], y[1:], r0=cal.R0)
    assert abs(f.A - A) <= 0.002
    assert abs(f.B / B - 1) <= 0.02
    assert abs(f.C_mid / cm - 1) <= 0.02


@pytest.mark.parametrize("row", cal.TABLE1, ids=[r[0] for r in cal.TABLE1])
def test_direct_never_worse_than_grid(row):
    c, y = cal.table1_curve(row)
    curves = [y[1:]]
    if row[0] in ("ScaleRL 8B", "Scout MoE", "math+code: code"):  # noisy too (the bench does all rows)
        curves.append(y[1:] + np.random.default_rng(7).normal(0, 0.01, 40))
    for yy in curves:
        d = fit.fit_direct(c[1:], yy, r0=cal.R0)
        g, info = fit.fit_grid(c[1:], yy, r0=cal.R0, unit="gpu_hours", inner="batched")
        assert d.ssr <= g.ssr * (1 + 1e-9) + 1e-15
        assert not info["at_grid_edge"]


def test_grid_curve_fit_is_the_paper_procedure():
    """The faithful inner loop (scipy curve_fit per grid pair) and the batched one agree."""
    row = cal.TABLE1[0]
    c, y = cal.table1_curve(row)
    a_grid, cmid_grid = np.arange(0.58, 0.641, 0.005), np.linspace(100, 40000, 100)[3:10]
    g1, _ = fit.fit_grid(c[1:], y[1:], r0=cal.R0, a_grid=a_grid, cmid_grid=cmid_grid, inner="curve_fit")
    g2, _ = fit.fit_grid(c[1:], y[1:], r0=cal.R0, a_grid=a_grid, cmid_grid=cmid_grid, inner="batched")
    assert (g1.A, g1.C_mid) == (g2.A, g2.C_mid)
    assert g1.B == pytest.approx(g2.B, rel=1e-5)
    assert g1.ssr == pytest.approx(g2.ssr, rel=1e-5)


def test_fitted_r0_and_grid_rescaling():
    row = cal.TABLE1[1]
    _, cm, B, A = row
    c, y = cal.table1_curve(row)
    f = fit.fit_direct(c[1:], y[1:], r0=None)
    assert f.R0 == pytest.approx(cal.R0, abs=1e-4) and not f.r0_fixed and f.n_free == 4
    assert f.A == pytest.approx(A, abs=1e-4)
    # on another axis (FLOPs) the C_mid grid scales with the budget
    flops = c[1:] * 3.6e18
    g, info = fit.fit_grid(flops, y[1:], r0=cal.R0, unit="flops", inner="batched")
    assert info["cmid_grid"][1] == pytest.approx(40000 * flops.max() / 16000)
    assert abs(g.C_mid / (cm * 3.6e18) - 1) < 0.05


def test_fixed_parameter_refit():
    c, y = cal.table1_curve(cal.TABLE1[0])
    f = fit.fit_direct(c[1:], y[1:], r0=cal.R0)
    g = fit.fit_fixed(c[1:], y[1:], {"A": 0.62}, f, r0=cal.R0)
    assert g.A == 0.62 and g.ssr > f.ssr and g.n_free == 2


def test_default_window_drops_the_early_phase():
    c = np.array([0, 100, 500, 1000, 2000, 4000, 8000, 16000.0])
    m = fit.window_mask(c)
    assert list(c[m]) == [2000, 4000, 8000, 16000]  # below 1.5k of 16k dropped, C = 0 never fitted
    assert list(c[fit.window_mask(c, c_min=0, c_max=4000)]) == [100, 500, 1000, 2000, 4000]


@pytest.mark.parametrize("c,y,msg", [
    ([0, 1, 2, 3, 4], [0.1, 0.2, np.nan, 0.3, 0.4], "point 2: column 'pass_rate' is nan"),
    ([0, 1, -2, 3, 4], [0.1, 0.2, 0.3, 0.3, 0.4], "point 2: column 'compute' is negative"),
    ([0, 1, 3, 2, 4], [0.1, 0.2, 0.3, 0.3, 0.4], "point 3: column 'compute': compute does not increase"),
    ([0, 0, 1, 2, 4], [0.1, 0.2, 0.3, 0.3, 0.4], "compute 0 appears twice"),
])
def test_bad_curves_are_named(c, y, msg):
    with pytest.raises(ScalingDataError, match=msg):
        fit.check_curve(c, y, "run")


def test_too_few_points_and_constant_curves():
    with pytest.raises(ScalingDataError, match="3 points in the fit window"):
        api.fit_arrays([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.35], c_min=0)
    with pytest.raises(ScalingDataError, match="constant"):
        api.fit_arrays([0, 1, 2, 3, 4, 5], [0.3] * 6, c_min=0)


def test_fit_early_predict_late_reports_errors():
    row = cal.TABLE1[0]
    c, y = cal.table1_curve(row)
    y = y + np.random.default_rng(3).normal(0, 0.01, y.size)
    s = api.fit_arrays(c, y, c_min=0, n_boot=300).summary()
    ex = s["extrapolation"]
    assert ex["status"] == "ok" and ex["n_fit"] + ex["n_heldout"] == 40
    assert ex["rmse"] < 0.03 and abs(ex["last_point"]["error"]) < 0.03
    assert ex["last_point"]["pi"][0] < ex["last_point"]["predicted"] < ex["last_point"]["pi"][1]
    # a compute value instead of a fraction
    s2 = api.fit_arrays(c, y, c_min=0, n_boot=100, holdout=3000.0).summary()
    assert s2["extrapolation"]["fit_until"] == 3000.0
