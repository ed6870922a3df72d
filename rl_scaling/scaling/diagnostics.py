"""Checks that refuse curves the sigmoid law does not describe, each with a named reason.

- `runs_test`: Wald-Wolfowitz runs test on the signs of the residuals, per seed and combined. A law of
  the wrong shape leaves long stretches of residuals of one sign (too few runs).
- `noise_test`: residuals against the eval noise. With n samples behind each eval (prompts x samples
  per prompt), the binomial sd sqrt(p (1 - p) / n) bounds the eval-to-eval noise on a fixed prompt set;
  residuals far above it are structure (or training noise) the law does not explain.
- `decline_test`: the law is monotone, so a curve that rises then falls, or dips late, is not sigmoidal.
  The statistic is the largest drop of a block mean below an earlier block mean, in units of the noise
  sd estimated from the curve itself; its p-value comes from the same statistic on i.i.d. noise (a flat
  curve, the hardest monotone case), so it holds whatever the number of points.
- `flags`: the findings as (code, message) pairs; codes in FLAG_CODES.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy import stats

from rl_scaling.scaling import law

# named findings; BLOCKING ones make a fit unusable for ranking recipes
FLAG_CODES = ("not_identifiable", "not_sigmoidal", "still_rising", "lack_of_fit", "no_saturation",
              "holdout_missed", "wide_interval")
BLOCKING = ("not_identifiable", "not_sigmoidal", "still_rising")
ALPHA = 0.01  # significance level of every check
NULL_DRAWS = 4000  # Monte Carlo draws of the decline statistic's null distribution


# ---------------------------------------------------------------- residual runs

def runs_test(residuals, groups=None):
    """Too few sign runs in the residuals (ordered by compute within each group).

    Groups (seeds) are independent sequences: their run counts, expectations and variances add.
    Exact zeros carry no sign and are dropped. Returns runs, expected, z (with continuity correction)
    and the lower-tail p-value (normal approximation), or p_value None with fewer than 2 signs of each kind.
    """
    r = np.asarray(residuals, dtype=float)
    g = np.zeros(r.size, int) if groups is None else np.asarray(groups)
    runs = mean = var = 0.0
    for label in np.unique(g):
        s = np.sign(r[g == label])
        s = s[s != 0]
        if s.size == 0:
            continue
        n1, n2 = float((s > 0).sum()), float((s < 0).sum())
        n = n1 + n2
        runs += 1 + np.count_nonzero(s[1:] != s[:-1])
        mean += 1 + 2 * n1 * n2 / n
        var += 2 * n1 * n2 * (2 * n1 * n2 - n) / (n * n * (n - 1)) if n > 1 else 0.0
    out = {"runs": int(runs), "expected": float(mean), "z": None, "p_value": None}
    if var > 0:
        z = (runs - mean + 0.5) / np.sqrt(var)
        out.update(z=float(z), p_value=float(stats.norm.cdf(z)))
    return out


# ---------------------------------------------------------------- residuals against the eval noise

def binomial_sd(pass_rate, eval_samples):
    """sd of an eval that averages eval_samples Bernoulli outcomes at pass rate p."""
    p = np.clip(np.asarray(pass_rate, dtype=float), 1e-6, 1 - 1e-6)
    return np.sqrt(p * (1 - p) / eval_samples)


def noise_test(residuals, sd, dof):
    """Chi-square of residuals in noise units with dof degrees of freedom: rmse, the noise rmse, their
    ratio and the upper-tail p-value (residuals too large for the eval noise)."""
    r, sd = np.asarray(residuals, dtype=float), np.broadcast_to(np.asarray(sd, dtype=float), np.shape(residuals))
    chi2 = float(np.sum((r / sd) ** 2))
    dof = max(int(dof), 1)
    return {"rmse": float(np.sqrt(np.mean(r * r))), "noise_rmse": float(np.sqrt(np.mean(sd * sd))),
            "ratio": float(np.sqrt(chi2 / dof)), "chi2": chi2, "dof": dof, "p_value": float(stats.chi2.sf(chi2, dof))}


# ---------------------------------------------------------------- monotonicity

def robust_sd(y):
    """Noise sd from second differences (the trend cancels), median-based so a collapse does not inflate
    it: e_i - 2 e_{i+1} + e_{i+2} has variance 6 sd^2. Works along the last axis."""
    d2 = np.diff(np.asarray(y, dtype=float), n=2, axis=-1)
    mad = np.median(np.abs(d2 - np.median(d2, axis=-1, keepdims=True)), axis=-1)
    return 1.4826 * mad / np.sqrt(6.0)


def block_sizes(n):
    """A short block (a late dip of a few evals) and a long one (a slow collapse)."""
    return sorted({3, max(3, n // 4)})


def mad_sd(e):
    """Noise sd from residuals around a fitted curve, median-based so a dip does not inflate it."""
    e = np.asarray(e, dtype=float)
    return 1.4826 * np.median(np.abs(e - np.median(e, axis=-1, keepdims=True)), axis=-1)


def decline_stat(y, k, sd=None):
    """Largest drop of a k-point block mean below an earlier, non-overlapping one, in units of the sd of
    a difference of two block means (sd * sqrt(2 / k); sd defaults to robust_sd(y)). y (..., n) ->
    (stat, index of the later block's start, index of the earlier block's start); the indices are for
    the last row."""
    y = np.asarray(y, dtype=float)
    m = np.lib.stride_tricks.sliding_window_view(y, k, axis=-1).mean(axis=-1)  # (..., n - k + 1)
    peak = np.maximum.accumulate(m, axis=-1)
    drop = peak[..., :-k] - m[..., k:]  # later block j = i + k against the best block up to i
    sd = np.maximum(robust_sd(y) if sd is None else sd, 1e-12) * np.sqrt(2.0 / k)
    z = drop.max(axis=-1) / sd
    j = int(np.argmax(drop.reshape(-1, drop.shape[-1])[-1]))
    return z, j + k, int(np.argmax(m.reshape(-1, m.shape[-1])[-1][: j + 1]))


@functools.lru_cache(maxsize=64)
def _null_max_stat(n, draws=NULL_DRAWS, seed=0):
    """The decline statistic (max over the block sizes) on i.i.d. normal sequences of length n."""
    e = np.random.default_rng(seed).normal(size=(draws, n))
    return np.max([decline_stat(e, k)[0] for k in block_sizes(n)], axis=0)


def decline_test(compute, pass_rate, groups=None):
    """Is there a drop no monotone curve plus noise explains? Per group (seed) in compute order; the
    p-value is Bonferroni-combined over groups. Groups with fewer than 6 points are skipped."""
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    g = np.zeros(c.size, int) if groups is None else np.asarray(groups)
    worst, tested = None, 0
    for label in np.unique(g):
        ii = np.flatnonzero(g == label)
        ii = ii[np.argsort(c[ii], kind="stable")]
        if ii.size < 6:
            continue
        tested += 1
        yy = y[ii]
        best = max((decline_stat(yy, k) + (k,) for k in block_sizes(ii.size)), key=lambda t: float(t[0]))
        z, j, i, k = float(best[0]), best[1], best[2], best[3]
        p = float((np.sum(_null_max_stat(ii.size) >= z) + 1) / (NULL_DRAWS + 1))
        if worst is None or p < worst["p_value"]:
            worst = {"p_value": p, "z": z, "block": int(k), "group": label.item() if hasattr(label, "item") else label,
                     "peak_compute": float(c[ii][i]), "peak": float(yy[i:i + k].mean()),
                     "low_compute": float(c[ii][j]), "low": float(yy[j:j + k].mean())}
    if worst is None:
        return {"status": "skipped", "message": "fewer than 6 points per seed"}
    return {"status": "ok", **worst, "p_value": min(1.0, worst["p_value"] * tested), "n_groups": tested}


LATE_DIP_BLOCKS = (2, 3, 4)


def _mean_prediction_var(f, c_fit, c_new, sd):
    """Variance of the fit's mean prediction over c_new (linearized: a (J'J)^-1 a' sd^2, J the Jacobian of
    the fitted parameters at c_fit, a the mean Jacobian row at c_new)."""
    free = [True, True, True, not f.r0_fixed]
    J = law.sigmoid_theta(np.log(c_fit), f.theta[None])[1][0][:, free]
    a = law.sigmoid_theta(np.log(c_new), f.theta[None])[1][0][:, free].mean(axis=0)
    cov = np.linalg.pinv(J.T @ J)
    return float(a @ cov @ a) * sd * sd


def late_dip_test(compute, pass_rate, groups, fit_fn, noise_sd=None):
    """Do a seed's last k evals fall below what its earlier evals predict? For k in LATE_DIP_BLOCKS: fit
    the law (fit_fn(c, y) -> Fit) to the seed's points before its last k, and z = the mean residual of
    the last k against that fit over the sd of a mean of k new evals around it (eval noise plus the fit's
    own linearized prediction error), the noise sd being the earlier residuals' (at least noise_sd, the
    measured eval noise, when given). One-sided normal p-value, Bonferroni over k and
    seeds. The decline test compares raw blocks, so on a curve still rising it misses dips of 0.015-0.03
    at an eval noise of 0.003; against the law's own extrapolation they stand out."""
    c, y, g = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float), np.asarray(groups)
    worst, tests = None, 0
    for label in np.unique(g):
        ii = np.flatnonzero(g == label)
        ii = ii[np.argsort(c[ii], kind="stable")]
        for k in LATE_DIP_BLOCKS:
            if ii.size - k < 8:
                continue
            early, late = ii[:-k], ii[-k:]
            try:
                f = fit_fn(c[early], y[early])
            except ValueError:
                continue
            tests += 1
            sd = max(f.sigma, noise_sd or 0.0, 1e-12)
            gap = float(np.mean(y[late] - f.predict(c[late])))
            z = gap / np.sqrt(sd * sd / k + _mean_prediction_var(f, c[early], c[late], sd))
            if worst is None or z < worst["z"]:
                worst = {"z": z, "gap": gap, "k": k, "sd": sd, "from_compute": float(c[late].min()),
                         "group": label.item() if hasattr(label, "item") else label}
    if worst is None:
        return {"status": "skipped", "message": "fewer than 10 points per seed"}
    return {"status": "ok", **worst, "p_value": min(1.0, float(stats.norm.cdf(worst["z"])) * tests), "n_tests": tests}


# ---------------------------------------------------------------- autocorrelation and the tail

def autocorrelation(residuals, groups=None):
    """Lag-1 autocorrelation of the residuals, in compute order within each group (seed), pooled:
    r1 = sum e_t e_t+1 / sum e_t^2 over groups. Under independent residuals r1 ~ N(0, 1/n); p_value is
    the upper tail (eval points that drift together make the i.i.d. bootstrap too narrow)."""
    r = np.asarray(residuals, dtype=float)
    g = np.zeros(r.size, int) if groups is None else np.asarray(groups)
    num = den = 0.0
    for label in np.unique(g):
        e = r[g == label]
        e = e - e.mean()
        num += float(np.sum(e[1:] * e[:-1]))
        den += float(np.sum(e * e))
    lag1 = num / den if den > 0 else 0.0
    z = lag1 * np.sqrt(r.size)
    return {"lag1": lag1, "z": float(z), "p_value": float(stats.norm.sf(z)), "n": int(r.size)}


def block_length(n):
    """Moving-block length of the block bootstrap: about n^(1/3), at least 2."""
    return max(2, int(round(n ** (1.0 / 3.0))))


TAIL = 0.25  # the still-rising test looks at the last quarter of the window's compute


def tail_slope(compute, pass_rate, fitted, groups=None, tail=TAIL):
    """Does the curve still rise faster than its fit in the last `tail` of the window's compute?

    Slope of the residuals y - fit against ln C over those points, with a per-group (seed) offset removed,
    and its OLS standard error; z = slope / se. A positive z means the data outrun the fit's flattening:
    the fitted A is then a lower bound, not a ceiling."""
    c, y, f = (np.asarray(v, dtype=float) for v in (compute, pass_rate, fitted))
    g = np.zeros(c.size, int) if groups is None else np.asarray(groups)
    last = c >= c.min() + (1.0 - tail) * (c.max() - c.min())
    x, r = np.log(c[last]), (y - f)[last]
    gl = g[last]
    for label in np.unique(gl):  # seed offsets out
        ii = gl == label
        x[ii] -= x[ii].mean()
        r[ii] -= r[ii].mean()
    n_groups = np.unique(gl).size
    dof = x.size - n_groups - 1
    sxx = float(np.sum(x * x))
    if dof < 2 or sxx <= 0:
        return {"status": "skipped", "message": f"{int(last.sum())} points in the last {tail:.0%} of compute"}
    slope = float(np.sum(x * r) / sxx)
    se = float(np.sqrt(np.sum((r - slope * x) ** 2) / dof / sxx))
    z = slope / max(se, 1e-300)
    span = float(np.log(c[last].max()) - np.log(c[last].min()))
    return {"status": "ok", "slope": slope, "se": se, "z": z, "p_value": float(stats.t.sf(z, dof)),
            "climb": slope * span, "n_points": int(last.sum()), "from_compute": float(c[last].min()), "tail": tail}


def plateau_jitter(rows):
    """Over the second half of a run's steps (its metrics.jsonl rows, as dicts): the checkpoint-to-
    checkpoint spread of the held-out pass rate, sd of successive evals' differences / sqrt 2 (i.i.d.
    noise of sd s gives s; a slow trend barely moves it), and the mean fraction of samples the
    zero-variance filter kept for the update (None when the run logs none)."""
    half = max(r["step"] for r in rows) / 2
    y = np.array([r["eval/pass_rate"] for r in rows if "eval/pass_rate" in r and r["step"] >= half])
    if y.size < 3:
        raise ValueError(f"{y.size} evals in the second half of the run: the spread needs 3 or more")
    keep = [r["keep_frac"] for r in rows if "keep_frac" in r and r["step"] >= half]
    return float(np.std(np.diff(y), ddof=1) / np.sqrt(2)), (float(np.mean(keep)) if keep else None)


# a still-rising tail must also matter: the residuals climb at least this much over it (pass rate)
MIN_CLIMB = 0.005


# ---------------------------------------------------------------- the findings

def flags(diag, alpha=ALPHA):
    """(code, message) findings from the check results in `diag` (the keys fit_runs stores)."""
    out = []
    dec = diag.get("decline", {})
    if dec.get("status") == "ok" and dec["p_value"] < alpha:
        out.append(("not_sigmoidal",
                    f"the curve falls from {dec['peak']:.3f} (around compute {dec['peak_compute']:.4g}) to "
                    f"{dec['low']:.3f} (from {dec['low_compute']:.4g}), {dec['z']:.1f} noise sd "
                    f"(p = {dec['p_value']:.2g}): it rises then falls or dips late, which the monotone law "
                    "cannot describe"))
    ld = diag.get("late_dip", {})
    if ld.get("status") == "ok" and ld["p_value"] < alpha and not out:  # one not_sigmoidal finding
        out.append(("not_sigmoidal",
                    f"the last {ld['k']} evals (from compute {ld['from_compute']:.4g}) fall {-ld['gap']:.3f} below "
                    f"what the earlier evals of seed {ld['group']} predict, {-ld['z']:.1f} noise sd (p = "
                    f"{ld['p_value']:.2g}): a late dip the monotone law cannot describe"))
    ts = diag.get("tail", {})
    if ts.get("status") == "ok" and ts["p_value"] < alpha and ts["climb"] >= MIN_CLIMB:
        out.append(("still_rising", f"over the last {ts['tail']:.0%} of compute (from {ts['from_compute']:.4g}) the "
                                    f"curve rises faster than the fit implies: the residuals climb {ts['climb']:.3f} "
                                    f"({ts['slope']:.4f} per unit ln C, {ts['z']:.1f} standard errors, p = "
                                    f"{ts['p_value']:.2g}); A is a "
                                    "lower bound, not a ceiling"))
    rt = diag.get("runs", {})
    if rt.get("p_value") is not None and rt["p_value"] < alpha:
        out.append(("lack_of_fit", f"the residuals change sign in {rt['runs']} runs where {rt['expected']:.1f} "
                                   f"are expected (runs test p = {rt['p_value']:.2g}): the law misses the shape"))
    nt = diag.get("noise")
    if nt and nt["p_value"] < alpha:
        out.append(("lack_of_fit", f"the residual rmse {nt['rmse']:.4f} is {nt['ratio']:.1f}x the eval noise "
                                   f"{nt['noise_rmse']:.4f} ({nt['source']}; chi2 p = {nt['p_value']:.2g})"))
    base = diag.get("baseline")
    if base:
        out.append(("no_saturation", f"a {base['name'].replace('_', '-')} baseline fits as well as the sigmoid "
                                     f"(AIC {base['aic']:.1f} vs {base['sigmoid_aic']:.1f}): the window shows no "
                                     "ceiling, so A is not measured"))
    ho = diag.get("holdout")
    if ho:
        out.append(("holdout_missed", f"fit up to {ho['fit_until']:.4g}, the law predicts {ho['predicted']:.3f} "
                                      f"at the last eval ({ho['compute']:.4g}) where {ho['observed']:.3f} was "
                                      f"measured, outside the {ho['level']:.0%} prediction interval "
                                      f"[{ho['pi'][0]:.3f}, {ho['pi'][1]:.3f}]"))
    return out
