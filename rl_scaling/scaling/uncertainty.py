"""Bootstrap intervals for the sigmoid fit, and the check that the data can pin A down at all.

Replicates are drawn from the fitted model (a model-based bootstrap) and refitted together by the
batched solver, warm-started at the point estimate, so 1,000 replicates cost well under a second.

- 'residual' (default): y* = f(theta_hat) + e*, e* resampled from the centred residuals scaled by
  sqrt(n / (n - p)). Without that small-sample scaling, residuals are too small by the p fitted
  parameters and 40-point intervals under-cover. This is the bootstrap over evaluation points.
- 'parametric': e* ~ N(0, SSR / (n - p)).
- 'pairs': resample the evaluation points themselves (multinomial weights); under-covers on short
  curves, kept for comparison.
- 'seeds': with several seeds of one configuration, resample whole seeds (the seed-to-seed spread is
  real variance the residuals do not see), and residuals within each drawn seed.

Which one is calibrated was measured, not assumed: `launch/bench_fit.py` runs the coverage study.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats

from rl_scaling.scaling import law
from rl_scaling.scaling.fit import Fit, lm_solve

LEVEL = 0.95
# The paper's comparison margin on A: a ceiling known only to worse than +-0.02 cannot rank recipes.
A_MARGIN = 0.02
# Share of the gain A - R0 the window must reach (lower interval end) before a wide A counts as measured.
MIN_GAIN_REACHED = 0.85


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """Refitted parameters of the replicates: theta (R, 4) = (A, B, ln C_mid, R0), and their noise scale."""

    theta: np.ndarray
    sigma: np.ndarray  # (R,) residual sd of each replicate refit, for prediction intervals
    noise: np.ndarray  # (R,) one new-observation noise draw per replicate
    method: str
    dof: int  # residual degrees of freedom of the fit, for the small-sample widening of intervals

    def params(self):
        return law.theta_to_params(self.theta)

    def predict(self, c):
        """(R, len(c)) replicate curves."""
        c = np.atleast_1d(np.asarray(c, dtype=float))
        p = self.params()
        return law.sigmoid(c[None, :], *(p[k][:, None] for k in law.PARAMS))


def bootstrap(fit: Fit, compute, pass_rate, n_boot=1000, method="residual", groups=None, rng=None):
    """Refit n_boot replicates of the window's points around `fit`.

    compute/pass_rate: the window points the fit used; groups: seed label per point (for 'seeds').
    """
    rng = np.random.default_rng(rng)
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    n, p = c.size, fit.n_free
    z = np.log(c)
    yhat = fit.predict(c)
    res = y - yhat
    scale = np.sqrt(n / max(n - p, 1))
    w = None
    if method == "residual":
        e = (res - res.mean()) * scale
        ystar = yhat + e[rng.integers(0, n, (n_boot, n))]
        new = e[rng.integers(0, n, n_boot)]
    elif method == "parametric":
        ystar = yhat + rng.normal(0.0, fit.sigma, (n_boot, n))
        new = rng.normal(0.0, fit.sigma, n_boot)
    elif method == "pairs":
        ystar = np.broadcast_to(y, (n_boot, n))
        w = rng.multinomial(n, np.full(n, 1.0 / n), n_boot).astype(float)
        e = res * scale
        new = e[rng.integers(0, n, n_boot)]
    elif method == "seeds":
        ystar, w, new = _seed_replicates(yhat, res, groups, n_boot, scale, rng)
    else:
        raise ValueError(f"unknown bootstrap method {method!r}")
    lo, hi = fit.bounds
    free = np.array([True, True, True, not fit.r0_fixed])
    theta0 = np.tile(fit.theta, (n_boot, 1))
    theta, ssr, _ = lm_solve(law.sigmoid_theta, z, ystar, theta0, free, lo, hi, w=w, max_iter=100)
    dof = max(n - p, 1) if w is None else np.maximum(w.sum(axis=1) - p, 1)
    return Bootstrap(theta=theta, sigma=np.sqrt(ssr / dof), noise=new, method=method, dof=max(n - p, 1))


def _seed_replicates(yhat, res, groups, n_boot, scale, rng):
    """Cluster bootstrap: draw whole seeds with replacement, each keeping its observed curve.

    A seed's deviation from the pooled fit is scaled by sqrt(S / (S - 1)), the cluster-level analogue
    of the residual scaling: with few seeds the spread between them is otherwise underestimated.
    """
    groups = np.asarray(groups)
    labels = np.unique(groups)
    S = labels.size
    if S < 2:
        raise ValueError("the seed bootstrap needs at least 2 seeds")
    ystar = yhat + res * np.sqrt(S / (S - 1.0)) * scale
    counts = rng.multinomial(S, np.full(S, 1.0 / S), n_boot)
    member = (groups[None, :] == labels[:, None]).astype(float)  # (S, N)
    w = counts.astype(float) @ member
    # a new eval comes from a new seed: a whole-curve offset plus point noise, both from the residuals
    e = res * np.sqrt(S / (S - 1.0)) * scale
    new = e[rng.integers(0, e.size, n_boot)]
    return np.broadcast_to(ystar, (n_boot, yhat.size)), w, new


# ---------------------------------------------------------------- intervals

def expanded_level(level, dof):
    """Percentile level widened for small samples (Hesterberg's 'expanded percentile' interval).

    Bootstrap percentiles behave like z-intervals: they ignore that sigma itself is estimated from
    n - p residuals. Taking the percentiles at the level whose z equals the t quantile with n - p degrees
    of freedom restores the coverage (measured: 40 points, p = 3, ~93% -> ~95%).
    """
    if dof is None or not np.isfinite(dof):
        return level
    t = stats.t.ppf(0.5 + level / 2.0, dof)
    return float(1.0 - 2.0 * stats.norm.sf(t))


def interval(samples, level=LEVEL, dof=None):
    """Percentile interval of bootstrap samples along axis 0 (expanded when dof is given)."""
    a = (1.0 - expanded_level(level, dof)) / 2.0
    return np.quantile(samples, [a, 1.0 - a], axis=0)


def param_intervals(boot: Bootstrap, level=LEVEL):
    """{'A': (lo, hi), 'B': ..., 'C_mid': ..., 'R0': ...}."""
    p = boot.params()
    return {k: tuple(float(v) for v in interval(p[k], level, boot.dof)) for k in law.PARAMS}


def curve_band(boot: Bootstrap, c, level=LEVEL):
    """Confidence band of the mean pass rate at compute c: (lo, hi) arrays."""
    lo, hi = interval(boot.predict(c), level, boot.dof)
    return lo, hi


def prediction_interval(fit: Fit, boot: Bootstrap, c, level=LEVEL):
    """Interval for a new noisy eval at compute c: parameter uncertainty plus eval noise.

    Uses the bootstrap prediction error f*(c) + e_new - f_hat(c), so a biased bootstrap distribution
    does not shift the interval (Davison & Hinkley 1997, alg. 6.4 style).
    """
    c = np.atleast_1d(np.asarray(c, dtype=float))
    delta = boot.predict(c) + boot.noise[:, None] - fit.predict(c)[None, :]
    lo, hi = interval(delta, level, boot.dof)
    return fit.predict(c) + lo, fit.predict(c) + hi


# ---------------------------------------------------------------- identifiability

def identifiability(fit: Fit, boot: Bootstrap, c_max, level=LEVEL, margin=A_MARGIN,
                    min_gain=MIN_GAIN_REACHED):
    """Can the window pin A down? Returns (identifiable, reasons, warnings).

    A is reported as a lower bound, not a value, when any of these holds:
    - the window ends before the fitted C_mid (the inflection was never seen);
    - the upper end of A's interval reaches the bound on A, or C_mid's interval reaches its bounds;
    - A's interval is wider than +-margin (the paper's 0.02) while the window has not clearly reached
      saturation: the lower end of the interval of the gain share reached at c_max,
      1 / (1 + (C_mid / c_max)^B), is below min_gain. Then A is an extrapolation, not a measurement.
      (On the Table-1 curves with noise 0.01 to 4x C_mid this flags the B = 1.09 row, whose window
      reaches ~82% of the gain, and leaves the rows with B >= 1.65, ~91%+, alone: launch/bench_fit.py.)
    A wide interval alone (noisy evals of a saturated curve) is only a warning.
    """
    reasons, warns = [], []
    if c_max < fit.C_mid:
        reasons.append(f"the fit window ends at {c_max:.4g}, before C_mid = {fit.C_mid:.4g}")
    ci = param_intervals(boot, level)
    lo, hi = fit.bounds
    if ci["A"][1] >= hi[0] - 1e-6:
        reasons.append(f"the {level:.0%} interval of A reaches its bound {hi[0]:g}")
    if np.log(ci["C_mid"][1]) >= hi[2] - 1e-6 or np.log(ci["C_mid"][0]) <= lo[2] + 1e-6:
        reasons.append("the interval of C_mid reaches its bounds")
    half = (ci["A"][1] - ci["A"][0]) / 2.0
    p = boot.params()
    reached = float(interval(law.gain_fraction(c_max, p["B"], p["C_mid"]), level, boot.dof)[0])
    if half > margin and reached < min_gain:
        reasons.append(f"A is known only to +-{half:.3f} (margin {margin}) and the window reaches only "
                       f"{reached:.0%} of the gain A - R0 (lower {level:.0%} bound): A is extrapolated")
    elif half > margin:
        warns.append(f"A is known only to +-{half:.3f}, wider than the comparison margin {margin}")
    return not reasons, reasons, warns
