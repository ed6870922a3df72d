"""Both curve shapes side by side: the sigmoid law and the power law R = A - D / C^B, each fitted to the
same window, each with a bootstrap, so a ceiling can be read under either shape and a prediction
beyond the data carries an interval for each.

Why both: on short windows the two shapes fit about equally well and their ceilings differ by more
than either interval, so which shape holds is itself a result (AIC on the window, and the
out-of-sample check of a pre-registered prediction, notebooks/results/preregistered.json).

Prediction intervals at a compute c beyond the data, for a new eval:
- `pi_seed`: one seed's eval: parameter uncertainty (the seeds bootstrap) + that seed's deviation from
  the pooled curve (sd over the seeds' own fits at c) + eval noise (resampled residuals);
- `pi_mean`: the mean of the same S seeds' evals: parameter uncertainty + eval noise / sqrt(S) (the
  seeds bootstrap already carries the uncertainty of the pooled mean).
"""

from __future__ import annotations

import numpy as np

from rl_scaling.scaling import api, compare, fit as fitlib, law, uncertainty as unc
from rl_scaling.scaling.errors import ScalingDataError

SHAPES = ("sigmoid", "power_law")


def _seed_sd_at(own_predictions, n_targets):
    """sd over seeds of their own fits' predictions (S, K) at K computes; zeros with one seed."""
    own = np.asarray(own_predictions, dtype=float)
    return own.std(axis=0, ddof=1) if len(own) > 1 else np.zeros(n_targets)


def _intervals(point, reps, new_noise, seed_sd, n_seeds, dof, level, rng):
    """pi_seed and pi_mean from replicate curves reps (R, K) around the point prediction (K,)."""
    base = reps - point[None, :]
    seed_dev = rng.normal(size=base.shape) * seed_sd[None, :]
    one = interval_pairs(base + seed_dev + new_noise[:, None], level, dof)
    mean = interval_pairs(base + new_noise[:, None] / np.sqrt(n_seeds), level, dof)
    return ([point[k] + one[k][0], point[k] + one[k][1]] for k in range(point.size)), \
        ([point[k] + mean[k][0], point[k] + mean[k][1]] for k in range(point.size))


def interval_pairs(samples, level, dof):
    lo, hi = unc.interval(samples, level, dof)
    return list(zip(lo.tolist(), hi.tolist()))


def predict_both(runs, targets, seed_seq, opts: api.Options | None = None):
    """Fit the seeds `runs` (io.Run) with both shapes and predict at compute `targets`.

    seed_seq: a np.random.SeedSequence (this fit's own random stream). Returns a JSON-ready dict:
    per shape the parameters, the window's AIC, and at each target the point prediction, pi_seed and
    pi_mean (see the module docstring)."""
    opts = opts or api.Options()
    targets = np.asarray(targets, dtype=float)
    sig_ss, pow_ss, dev_ss = api.streams(seed_seq, 3)
    res = api.fit_runs(runs, opts=api.Options(**{**opts.__dict__, "seed": sig_ss}))
    c, y, g = res.c, res.y, res.groups
    S = np.unique(g).size
    level = opts.level
    rng = np.random.default_rng(dev_ss)
    out = {"n_seeds": int(S), "window": [float(c.min()), float(c.max())], "n_points": int(c.size)}
    # sigmoid: the main fit's bootstrap
    sig_own = []
    for lab in np.unique(g):
        ii = g == lab
        try:
            sig_own.append(fitlib.fit_direct(c[ii], y[ii], res.fit.R0 if res.fit.r0_fixed else None).predict(targets))
        except ScalingDataError:
            pass
    point = res.fit.predict(targets)
    one, mean = _intervals(point, res.boot.predict(targets), res.boot.noise,
                           _seed_sd_at(sig_own, targets.size), S,
                           res.boot.dof, level, rng)
    s = res.summary()
    out["sigmoid"] = {"A": res.fit.A, "B": res.fit.B, "C_mid": res.fit.C_mid, "R0": res.fit.R0,
                      "ci": s["ci"], "identifiable": s["identifiable"],
                      "aic": compare.aic(res.fit.ssr, res.fit.n, res.fit.n_free),
                      "at": _rows(targets, point, one, mean)}
    # power law: its own bootstrap on the same window
    pooled, theta, new, dof = compare.power_bootstrap(c, y, g, opts.n_boot, pow_ss, opts.a_bounds)
    reps = law.power_law(targets[None, :], theta[:, :1], np.exp(theta[:, 2:3]), theta[:, 1:2])
    pw_own = [compare.predict_power_law(targets, p) for p in (compare.own_power(c[g == lab], y[g == lab], opts.a_bounds)
                                                   for lab in np.unique(g)) if p]
    point = compare.predict_power_law(targets, pooled)
    one, mean = _intervals(point, reps, new, _seed_sd_at(pw_own, targets.size),
                           S, dof, level, rng)
    a_ci = unc.interval(theta[:, 0], level, dof)
    out["power_law"] = {"A": pooled["A"], "B": pooled["B"], "D": pooled["D"], "ci": {"A": a_ci.tolist()},
                        "A_at_bound": pooled["A_at_bound"],
                        "aic": compare.aic(pooled["ssr"], pooled["n"], pooled["n_free"]),
                        "at": _rows(targets, point, one, mean)}
    out["preferred_by_aic"] = min(SHAPES, key=lambda k: out[k]["aic"])
    return out


def _rows(targets, point, one, mean):
    return [{"compute": float(t), "pass_rate": float(p), "pi_seed": [float(v) for v in o],
             "pi_mean": [float(v) for v in m]} for t, p, o, m in zip(targets, point, one, mean)]


# A run's budget in samples rounds to whole steps, so its last eval can fall a step short of an exact
# multiple of another run's compute (DAPO at 4x: 906 steps against 4 x 227): within this share past
# the last eval, the last eval stands for the target.
LAST_EVAL_SLACK = 0.01


def observed_at(run, c):
    """A run's eval pass rate at compute c, linear in ln C between the two evals around it; None before
    its first eval or more than LAST_EVAL_SLACK past its last."""
    cc, yy = np.asarray(run.compute, dtype=float), np.asarray(run.pass_rate, dtype=float)
    ok = cc > 0
    cc, yy = cc[ok], yy[ok]
    if cc.size == 0 or c > cc.max() * (1.0 + LAST_EVAL_SLACK) or c < cc.min():
        return None
    return float(np.interp(np.log(c), np.log(cc), yy))
