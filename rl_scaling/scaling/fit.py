"""Fitting the sigmoid law: the paper's grid search and a fast direct fit.

- `fit_grid`: paper-faithful. A on a grid, C_mid on a grid, B by `scipy.optimize.curve_fit` (default
  init B = 1) for each pair; the pair with the smallest sum of squared residuals wins.
- `fit_direct`: bounded A, log-parametrized C_mid, several starts solved together by one batched
  Levenberg-Marquardt (`lm_solve`). The same solver, warm-started, refits thousands of bootstrap
  replicates at once, which is what makes honest intervals cheap.

Compute enters the solvers as z = ln C. R0 is fixed (the measured pass rate at C = 0) or fitted.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from rl_scaling.scaling import law
from rl_scaling.scaling.errors import ScalingDataError

# The paper's grid (GPU-hours): A in {0.450, 0.455, ..., 0.800}, C_mid at 100 values in [100, 40000].
PAPER_A_GRID = np.round(np.arange(0.450, 0.8001, 0.005), 3)
PAPER_CMID_GRID = np.linspace(100.0, 40000.0, 100)
# Its ablation runs used 16k GPU-hours; for other axes the C_mid grid keeps the same ratio to the budget.
PAPER_BUDGET = 16000.0
# The paper drops the early near-linear phase: ~1.5k of its 16k GPU-hours.
PAPER_SKIP_FRACTION = 1.5 / 16.0
MIN_POINTS = 4


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted sigmoid: parameters, residuals and what was held fixed."""

    A: float
    B: float
    C_mid: float
    R0: float
    ssr: float
    n: int  # points in the fit
    n_free: int  # fitted parameters
    method: str
    r0_fixed: bool
    bounds: tuple  # (lo, hi) over (A, B, ln C_mid, R0)

    @property
    def theta(self):
        return np.array([self.A, self.B, np.log(self.C_mid), self.R0])

    @property
    def sigma(self):
        """Residual sd with the small-sample (n - p) correction."""
        return float(np.sqrt(self.ssr / max(self.n - self.n_free, 1)))

    def predict(self, c):
        return law.sigmoid(c, self.A, self.B, self.C_mid, self.R0)

    def params(self):
        return {"A": self.A, "B": self.B, "C_mid": self.C_mid, "R0": self.R0}


# ---------------------------------------------------------------- checks and window

def check_curve(compute, pass_rate, source="input", where=None, columns=("compute", "pass_rate")):
    """Validate one run's curve; raise ScalingDataError naming the point at fault.

    where: optional label per point (e.g. 'metrics.jsonl:17') used in messages instead of 'point i';
    columns: the names of the compute and pass-rate columns in the source.
    """
    c = np.asarray(compute, dtype=float)
    y = np.asarray(pass_rate, dtype=float)
    if c.ndim != 1 or c.shape != y.shape:
        raise ScalingDataError(f"{source}: compute and pass_rate must be 1-D of equal length, "
                               f"got {c.shape} and {y.shape}")
    at = (lambda i: where[i]) if where is not None else (lambda i: f"{source}: point {i}")
    for name, v in zip(columns, (c, y)):
        bad = np.flatnonzero(~np.isfinite(v))
        if bad.size:
            raise ScalingDataError(f"{at(bad[0])}: column '{name}' is {v[bad[0]]} (NaN or infinite)")
    if (c < 0).any():
        i = int(np.flatnonzero(c < 0)[0])
        raise ScalingDataError(f"{at(i)}: column '{columns[0]}' is negative ({c[i]})")
    outside = (y < 0) | (y > 1)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        if (y >= 0).all() and (y <= 100).all():
            raise ScalingDataError(f"{at(i)}: column '{columns[1]}' is {y[i]:g}: pass rates look like a percent "
                                   f"scale (values in [0, 100], largest {y.max():g}); give them as fractions "
                                   "in [0, 1] (divide by 100)")
        raise ScalingDataError(f"{at(i)}: column '{columns[1]}' is {y[i]:g}, outside [0, 1] (a pass rate)")
    if c.size > 1 and (np.diff(c) <= 0).any():
        i = int(np.flatnonzero(np.diff(c) <= 0)[0]) + 1
        what = "compute 0 appears twice" if c[i] == 0 else "compute does not increase"
        raise ScalingDataError(f"{at(i)}: column '{columns[0]}': {what} ({c[i - 1]:g} then {c[i]:g}); "
                               "each eval needs more compute than the one before (a resumed run may have "
                               "logged a step twice)")
    return c, y


def window_mask(compute, c_min=None, c_max=None):
    """Points inside [c_min, c_max]; C = 0 is never inside (it only gives R0).

    c_min=None drops the early near-linear phase the way the paper does: compute below 1.5/16 of the
    window's largest compute.
    """
    c = np.asarray(compute, dtype=float)
    hi = c.max() if c_max is None else c_max
    lo = PAPER_SKIP_FRACTION * min(hi, c.max()) if c_min is None else c_min
    return (c > 0) & (c >= lo) & (c <= hi)


def measured_r0(compute, pass_rate):
    """Mean pass rate at C = 0, or None when no run has an initial eval."""
    c, y = np.asarray(compute), np.asarray(pass_rate)
    return float(y[c == 0].mean()) if (c == 0).any() else None


def _check_window(c, y, source, n_min=MIN_POINTS):
    if c.size < n_min:
        raise ScalingDataError(f"{source}: {c.size} points in the fit window, at least {n_min} are needed")
    if np.ptp(y) == 0:
        raise ScalingDataError(f"{source}: pass rate is constant ({y[0]}) in the fit window; no curve to fit")


def default_bounds(z, r0=None, a_bounds=(0.0, 1.0)):
    """Box for (A, B, ln C_mid, R0): C_mid within 1000x of the data either side, B in [0.05, 20]."""
    lo = np.array([a_bounds[0], 0.05, z.min() - np.log(1e3), 0.0 if r0 is None else r0])
    hi = np.array([a_bounds[1], 20.0, z.max() + np.log(1e3), 1.0 if r0 is None else r0])
    return lo, hi


# ---------------------------------------------------------------- the batched solver

def lm_solve(model, z, y, theta0, free, lo, hi, w=None, max_iter=200, rtol=1e-10):
    """Levenberg-Marquardt with box constraints over a batch of independent problems.

    model(z, theta (R, P)) -> (f (R, N), jac (R, N, P)); y (R, N); w (R, N) non-negative weights
    (bootstrap multiplicities; None = 1); free (P,) bool marks fitted parameters; lo, hi (P,) or (R, P)
    bounds (a parameter held fixed per row sits in equal bounds or outside `free`). Bounds are kept by
    freezing a parameter that sits on its bound while the gradient pushes outward, then clipping.
    Returns theta (R, P), ssr (R,), converged (R,).
    """
    y = np.atleast_2d(y)
    R = y.shape[0]
    w = np.ones_like(y) if w is None else np.broadcast_to(w, y.shape)
    z = np.broadcast_to(z, y.shape)
    free = np.asarray(free, dtype=bool)
    theta = np.array(theta0, dtype=float).reshape(R, -1)
    lo, hi = (np.broadcast_to(np.asarray(b, dtype=float), theta.shape) for b in (lo, hi))
    theta = np.clip(theta, lo, hi)
    f, jac = model(z, theta)
    res = y - f
    ssr = np.einsum("rn,rn->r", w, res * res)
    H, g = _normal_equations(jac, res, w, free)  # cached: a rejected step leaves them unchanged
    lam = np.full(R, 1e-3)
    done = np.zeros(R, dtype=bool)
    eye = np.eye(free.sum())
    for _ in range(max_iter):
        act = np.flatnonzero(~done)
        if act.size == 0:
            break
        Ha, ga, tf = H[act], g[act], theta[act][:, free]
        lf, hf = lo[act][:, free], hi[act][:, free]
        pinned = ((tf <= lf) & (ga < 0)) | ((tf >= hf) & (ga > 0))  # +g is the descent direction
        keep = ~pinned
        Ha = Ha * keep[:, :, None] * keep[:, None, :] + eye * pinned[:, :, None]
        ga = ga * keep
        d = np.maximum(np.einsum("rii->ri", Ha), 1e-12)
        step = np.linalg.solve(Ha + lam[act, None, None] * eye * d[:, :, None], ga[..., None])[..., 0]
        cand = theta[act]
        cand[:, free] = np.clip(tf + step, lf, hf)
        fc, jc = model(z[act], cand)
        rc = y[act] - fc
        sc = np.einsum("rn,rn->r", w[act], rc * rc)
        better = sc < ssr[act]
        small = (ssr[act] - sc) <= rtol * ssr[act] + 1e-30
        idx = act[better]
        theta[idx], res[idx], ssr[idx] = cand[better], rc[better], sc[better]
        if idx.size:
            H[idx], g[idx] = _normal_equations(jc[better], rc[better], w[idx], free)
        done[act] = (better & small) | (lam[act] > 1e12)
        lam[act] = np.where(better, np.maximum(lam[act] / 3.0, 1e-12), lam[act] * 4.0)
    return theta, ssr, done


def _normal_equations(jac, res, w, free):
    J = jac[..., free]
    JW = J * w[..., None]
    return np.einsum("rni,rnj->rij", JW, J), np.einsum("rni,rn->ri", JW, res)


# ---------------------------------------------------------------- the direct fit

def _linear_amplitudes(s, y, r0):
    """Least-squares A (and R0 when r0 is None) for fixed sigmoid shapes s (K, N): the law is linear in them."""
    if r0 is not None:
        den = np.einsum("kn,kn->k", s, s)
        return r0 + np.einsum("kn,n->k", s, y - r0) / np.maximum(den, 1e-300), np.full(s.shape[0], r0)
    X = np.stack([s, 1.0 - s], axis=-1)  # y = A s + R0 (1 - s)
    XtX = np.einsum("kni,knj->kij", X, X) + 1e-12 * np.eye(2)
    coef = np.linalg.solve(XtX, np.einsum("kni,n->ki", X, y)[..., None])[..., 0]
    return coef[:, 0], coef[:, 1]


def fit_direct(compute, pass_rate, r0=None, a_bounds=(0.0, 1.0), source="input"):
    """Least-squares sigmoid with bounded A, ln C_mid and many starts in one batched solve.

    compute/pass_rate: the points of the fit window (C > 0). r0: fixed R0, or None to fit it.
    """
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    _check_window(c, y, source)
    z = np.log(c)
    lo, hi = default_bounds(z, r0, a_bounds)
    # starts: a (B, ln C_mid) grid, with the amplitudes solved exactly for each shape
    Bs, us = np.meshgrid([0.5, 1.0, 2.0, 4.0], np.linspace(z.min() - 1.0, z.max() + 1.5, 9))
    Bs, us = Bs.ravel(), us.ravel()
    s = law.gain_fraction(c[None, :], Bs[:, None], np.exp(us)[:, None])
    A0, R00 = _linear_amplitudes(s, y, r0)
    theta0 = np.stack([A0, Bs, us, R00], axis=1)
    free = np.array([True, True, True, r0 is None])
    ys = np.broadcast_to(y, (theta0.shape[0], y.size))
    theta, ssr, _ = lm_solve(law.sigmoid_theta, z, ys, theta0, free, lo, hi)
    best = int(np.nanargmin(ssr))
    return _make_fit(theta[best], ssr[best], c.size, free, "direct", (lo, hi))


def fit_fixed(compute, pass_rate, fixed, start, r0=None, a_bounds=(0.0, 1.0)):
    """Refit with some of A, B, C_mid held at given values (the paper's 'refit with the mean A')."""
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    z = np.log(c)
    lo, hi = default_bounds(z, r0, a_bounds)
    theta0 = np.array(start.theta, dtype=float)
    free = np.array([True, True, True, r0 is None])
    for name, val in fixed.items():
        i = law.PARAMS.index(name)
        theta0[i] = np.log(val) if name == "C_mid" else val
        lo[i] = hi[i] = theta0[i]
        free[i] = False
    theta, ssr, _ = lm_solve(law.sigmoid_theta, z, y[None], theta0[None], free, lo, hi)
    return _make_fit(theta[0], ssr[0], c.size, free, "direct-fixed", (lo, hi))


def _make_fit(theta, ssr, n, free, method, bounds):
    p = law.theta_to_params(theta)
    return Fit(A=float(p["A"]), B=float(p["B"]), C_mid=float(p["C_mid"]), R0=float(p["R0"]),
               ssr=float(ssr), n=int(n), n_free=int(np.sum(free)), method=method,
               r0_fixed=not bool(free[3]), bounds=bounds)


# ---------------------------------------------------------------- the paper's grid fit

def paper_cmid_grid(c_max, unit="gpu_hours"):
    """The paper's C_mid grid; on other axes scaled by (largest compute / the paper's 16k GPU-hours)."""
    return PAPER_CMID_GRID if unit == "gpu_hours" else PAPER_CMID_GRID * (c_max / PAPER_BUDGET)


def fit_grid(compute, pass_rate, r0=None, a_grid=None, cmid_grid=None, unit="gpu_hours",
             inner="curve_fit", source="input"):
    """The paper's procedure. inner='curve_fit' calls scipy for B at every grid pair (faithful, ~7k
    calls); inner='batched' solves the same 1-D (or 2-D with R0) problems in one batched LM from the
    same start B = 1 (same optimum, ~10x faster)."""
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    _check_window(c, y, source)
    a_grid = PAPER_A_GRID if a_grid is None else np.asarray(a_grid, dtype=float)
    cmid_grid = paper_cmid_grid(c.max(), unit) if cmid_grid is None else np.asarray(cmid_grid, dtype=float)
    Ag, Cg = (v.ravel() for v in np.meshgrid(a_grid, cmid_grid, indexing="ij"))
    z = np.log(c)
    if inner == "batched":
        free = np.array([False, True, False, r0 is None])  # A and C_mid stay at their grid values
        r0_init = y.min() if r0 is None else r0
        theta0 = np.stack([Ag, np.ones_like(Ag), np.log(Cg), np.full_like(Ag, r0_init)], axis=1)
        ys = np.broadcast_to(y, (Ag.size, y.size))
        theta, ssr, _ = lm_solve(law.sigmoid_theta, z, ys, theta0, free, np.full(4, -np.inf), np.full(4, np.inf))
        Bs, R0s = theta[:, 1], theta[:, 3]
    else:
        Bs, R0s, ssr = _grid_curve_fit(c, y, Ag, Cg, r0)
    ssr = np.where(np.isfinite(ssr), ssr, np.inf)
    k = int(np.argmin(ssr))
    bounds = default_bounds(z, r0)
    theta = np.array([Ag[k], Bs[k], np.log(Cg[k]), R0s[k]])
    fit = _make_fit(theta, ssr[k], c.size, np.array([True, True, True, r0 is None]), "grid", bounds)
    edge = (Ag[k] in (a_grid.min(), a_grid.max())) or (Cg[k] in (cmid_grid.min(), cmid_grid.max()))
    return fit, {"at_grid_edge": bool(edge), "a_grid": [float(a_grid.min()), float(a_grid.max()), a_grid.size],
                 "cmid_grid": [float(cmid_grid.min()), float(cmid_grid.max()), cmid_grid.size]}


def _grid_curve_fit(c, y, Ag, Cg, r0):
    Bs, R0s, ssr = np.full(Ag.size, np.nan), np.full(Ag.size, np.nan), np.full(Ag.size, np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, (a, cm) in enumerate(zip(Ag, Cg)):
            try:
                if r0 is not None:
                    (b,), _ = curve_fit(lambda x, b: law.sigmoid(x, a, b, cm, r0), c, y)
                    rr = r0
                else:
                    (b, rr), _ = curve_fit(lambda x, b, q: law.sigmoid(x, a, b, cm, q), c, y)
            except (RuntimeError, ValueError):
                continue
            Bs[i], R0s[i] = b, rr
            ssr[i] = np.sum((y - law.sigmoid(c, a, b, cm, rr)) ** 2)
    return Bs, R0s, ssr
