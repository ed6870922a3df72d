"""Sigmoid versus a power law and straight-line baselines, fit-early-predict-late, and recipe comparison
(the paper's rule, undecided where an A is not measured)."""

from __future__ import annotations

import itertools

import numpy as np

from rl_scaling.scaling import diagnostics, law
from rl_scaling.scaling.fit import MIN_POINTS, lm_solve
from rl_scaling.scaling.errors import ScalingDataError
from rl_scaling.scaling.uncertainty import resample_index

# ---------------------------------------------------------------- power law

def fit_power_law(compute, pass_rate, a_bounds=(0.0, 1.0)):
    """Least-squares R = A - D / C^B (B > 0, D > 0, A bounded like the sigmoid's). Returns a dict."""
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    if c.size < MIN_POINTS:
        raise ScalingDataError(f"{c.size} points, the power law needs at least {MIN_POINTS}")
    z = np.log(c)
    Bs = np.array([0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.5, 2.5, 4.0])
    # for a fixed B the law is linear in (A, D): solve those exactly for the starts
    X = np.stack([np.ones((Bs.size, c.size)), -np.exp(-Bs[:, None] * z)], axis=-1)
    coefs = np.stack([np.linalg.lstsq(X[k], y, rcond=None)[0] for k in range(Bs.size)])
    A0 = np.clip(coefs[:, 0], *a_bounds)
    v0 = np.log(np.maximum(coefs[:, 1], 1e-12))
    theta0 = np.stack([A0, Bs, v0], axis=1)
    lo = np.array([a_bounds[0], 1e-3, -200.0])
    hi = np.array([a_bounds[1], 20.0, 200.0])
    ys = np.broadcast_to(y, (Bs.size, y.size))
    theta, ssr, _ = lm_solve(law.power_theta, z, ys, theta0, np.ones(3, bool), lo, hi)
    k = int(np.nanargmin(ssr))
    return {"A": float(theta[k, 0]), "B": float(theta[k, 1]), "D": float(np.exp(theta[k, 2])),
            "ssr": float(ssr[k]), "n": int(c.size), "n_free": 3,
            "A_at_bound": bool(theta[k, 0] >= a_bounds[1] - 1e-6)}


def predict_power_law(c, p):
    return law.power_law(c, p["A"], p["D"], p["B"])


def own_power(c, y, a_bounds):
    """A seed's own power-law fit, or None when it has too few points."""
    try:
        return fit_power_law(c, y, a_bounds)
    except ScalingDataError:
        return None


def power_bootstrap(c, y, groups, n_boot, rng, a_bounds=(0.0, 1.0), block=None):
    """Pooled power-law fit and its replicates (R, 3) = (A, B, ln D), drawn as the sigmoid's 'seeds'
    bootstrap draws them: a Gaussian multiplier per seed on the seed's own curve minus the pooled
    one, plus residuals within seeds (in moving blocks of `block` evals when given); one residual is
    kept per replicate as new-eval noise. Returns (pooled fit dict, theta, noise draws, residual dof)."""
    rng = np.random.default_rng(rng)
    pooled = fit_power_law(c, y, a_bounds)
    yhat = predict_power_law(c, pooled)
    labels = np.unique(groups)
    dev, noise = np.zeros_like(y), np.zeros_like(y)
    for g in labels:
        ii = groups == g
        own = own_power(c[ii], y[ii], a_bounds) if labels.size > 1 else pooled
        f_g = predict_power_law(c[ii], own) if own else yhat[ii] + (y[ii] - yhat[ii]).mean()
        dev[ii] = f_g - yhat[ii]
        noise[ii] = (y[ii] - f_g) * np.sqrt(ii.sum() / max(ii.sum() - 3, 1))
    e = noise - noise.mean()
    ystar = yhat + e[resample_index(e.size, n_boot, rng, block)]
    if labels.size > 1:
        S = labels.size
        v = rng.normal(size=(n_boot, S))[:, np.searchsorted(labels, groups)]
        ystar = ystar + np.sqrt(S / (S - 1.0)) * v * dev
    theta0 = np.tile([pooled["A"], pooled["B"], np.log(pooled["D"])], (n_boot, 1))
    lo, hi = np.array([a_bounds[0], 1e-3, -200.0]), np.array([a_bounds[1], 20.0, 200.0])
    theta, _, _ = lm_solve(law.power_theta, np.log(c), ystar, theta0, np.ones(3, bool), lo, hi, max_iter=100)
    return pooled, theta, e[rng.integers(0, e.size, n_boot)], max(c.size - 3, 1)


# ---------------------------------------------------------------- baselines without a ceiling

BASELINES = ("linear", "log_linear")  # R = a + b C and R = a + b ln C


def fit_baseline(compute, pass_rate, kind):
    """Least-squares straight line in C ('linear') or in ln C ('log_linear'). Returns a dict."""
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    x = _baseline_x(c, kind)
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), y, rcond=None)
    ssr = float(np.sum((y - a - b * x) ** 2))
    return {"kind": kind, "a": float(a), "b": float(b), "ssr": ssr, "n": int(c.size), "n_free": 2}


def predict_baseline(c, p):
    return p["a"] + p["b"] * _baseline_x(np.asarray(c, dtype=float), p["kind"])


def _baseline_x(c, kind):
    if kind not in BASELINES:
        raise ValueError(f"unknown baseline {kind!r} ({', '.join(BASELINES)})")
    return c if kind == "linear" else np.log(c)


def aic(ssr, n, k):
    """Gaussian AIC with the noise variance counted as a parameter; lower is better."""
    return float(n * np.log(max(ssr, 1e-300) / n) + 2 * (k + 1))


# ---------------------------------------------------------------- fit early, predict late

def split_at(compute, until):
    """Boolean mask of the 'early' points: until in (0, 1] is a fraction of the largest compute,
    larger values are a compute value."""
    c = np.asarray(compute, dtype=float)
    cut = until * c.max() if until <= 1.0 else until
    return c <= cut, float(cut)


def holdout_errors(predicted, observed):
    """RMSE over the held-out points and the signed error at the last one."""
    d = np.asarray(predicted) - np.asarray(observed)
    return {"rmse": float(np.sqrt(np.mean(d * d))), "last_error": float(d[-1]), "n_heldout": int(d.size)}


def sigmoid_vs_power(compute, pass_rate, sigmoid_fit_fn, until=0.5, a_bounds=(0.0, 1.0)):
    """Compare the sigmoid with the power law and the linear and log-linear baselines on the whole window
    (AIC) and by extrapolation (fit early, predict late).

    sigmoid_fit_fn(c, y) -> Fit, so the sigmoid uses the same fit method and R0 handling as the main fit.
    """
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    sig, pw = sigmoid_fit_fn(c, y), fit_power_law(c, y, a_bounds)
    out = {"sigmoid": {"aic": aic(sig.ssr, sig.n, sig.n_free), "ssr": sig.ssr},
           "power_law": {**pw, "aic": aic(pw["ssr"], pw["n"], pw["n_free"])}}
    for kind in BASELINES:
        b = fit_baseline(c, y, kind)
        out[kind] = {**b, "aic": aic(b["ssr"], b["n"], b["n_free"])}
    early, cut = split_at(c, until)
    out["fit_until"] = cut
    if early.sum() >= MIN_POINTS and (~early).any():
        s_e, p_e = sigmoid_fit_fn(c[early], y[early]), fit_power_law(c[early], y[early], a_bounds)
        out["sigmoid"]["heldout"] = holdout_errors(s_e.predict(c[~early]), y[~early])
        out["power_law"]["heldout"] = holdout_errors(predict_power_law(c[~early], p_e), y[~early])
        out["power_law"]["heldout"]["A"] = p_e["A"]
        out["sigmoid"]["heldout"]["A"] = s_e.A
        for kind in BASELINES:
            b_e = fit_baseline(c[early], y[early], kind)
            out[kind]["heldout"] = holdout_errors(predict_baseline(c[~early], b_e), y[~early])
    models = ("sigmoid", "power_law") + BASELINES
    out["preferred_by_aic"] = min(models, key=lambda m: (out[m]["aic"], models.index(m)))
    if "heldout" in out["sigmoid"]:
        out["preferred_by_heldout"] = min(models, key=lambda m: (out[m]["heldout"]["rmse"], models.index(m)))
    return out


def best_baseline(comparison):
    """The straight-line baseline whose AIC is at or below the sigmoid's (the window shows no ceiling),
    or None."""
    if "sigmoid" not in comparison:
        return None
    kind = min(BASELINES, key=lambda k: comparison[k]["aic"])
    s_aic, b_aic = comparison["sigmoid"]["aic"], comparison[kind]["aic"]
    return {"name": kind, "aic": b_aic, "sigmoid_aic": s_aic} if b_aic <= s_aic else None


# ---------------------------------------------------------------- recipes

UNDECIDED = "undecided"
_WHY = {"not_identifiable": "A is only a lower bound", "not_sigmoidal": "the curve is not sigmoidal",
        "still_rising": "still rising past its fit, A is only a lower bound"}


def blocking(result):
    """Why a result's A cannot rank it: [(code, text)] for its blocking flags (diagnostics.BLOCKING)."""
    return [(code, _WHY.get(code, code)) for code, _ in result.flags if code in diagnostics.BLOCKING]


SEPARATED = 0.975  # P(x > y) from independent bootstrap replicates: a two-sided 95% call


def _p_greater(a, b, key):
    pa, pb = a.boot.params()[key], b.boot.params()[key]
    m = min(pa.size, pb.size)
    return float(np.mean(pa[:m] > pb[:m]))


def compare_pair(a, b, margin=0.02):
    """The paper's rule for two results (api.Result): if their A are within the margin, refit both with
    the mean A and compare B (higher B = at least as scalable); otherwise the higher A wins.
    Undecided when either A is only a lower bound (not identifiable) or either curve is not sigmoidal,
    and when the bootstrap does not separate the deciding parameter: the winner's A (or B) must exceed
    the other's in at least 97.5% of independent replicate pairs. (For B that is the free fits'
    replicates, a proxy for the fixed-A refit's.)"""
    dA = a.fit.A - b.fit.A
    out = {"a": a.name, "b": b.name, "A_diff": float(dA), "p_A_greater": _p_greater(a, b, "A")}
    why = sorted({f"{r.name}: {text}" for r in (a, b) for _, text in blocking(r)})
    if why:
        out.update(rule="; ".join(why), winner=UNDECIDED)
        return out
    if abs(dA) <= margin:
        mean_A = (a.fit.A + b.fit.A) / 2.0
        Ba, Bb = (r.refit_fixed({"A": mean_A}).B for r in (a, b))
        p = _p_greater(a, b, "B")
        out.update(rule="A within margin: refit with mean A, compare B", mean_A=float(mean_A),
                   B_a=float(Ba), B_b=float(Bb), p_B_greater=p)
        leader, p_leader = (a.name, p) if Ba >= Bb else (b.name, 1.0 - p)
    else:
        out.update(rule="A differs by more than the margin")
        leader, p_leader = (a.name, out["p_A_greater"]) if dA > 0 else (b.name, 1.0 - out["p_A_greater"])
    if p_leader >= SEPARATED:
        out["winner"] = leader
    else:
        out.update(winner=UNDECIDED, rule=out["rule"] + f", but the intervals do not separate them "
                                                         f"(P = {p_leader:.2f} < {SEPARATED} for {leader})")
    out.update(_under_power_law(a, b, out["winner"]))
    return out


def _under_power_law(a, b, winner):
    """Does a decided pair keep its winner when both curves are read as power laws? Their power-law A's
    are compared from independent replicate pairs, as the sigmoid's are."""
    if a.power_A is None or b.power_A is None:
        return {"power_law": None, "holds_under_both_shapes": None}
    pa, pb = a.power_A, b.power_A
    m = min(pa.size, pb.size)
    p = float(np.mean(pa[:m] > pb[:m]))
    at_bound = [r.name for r in (a, b) if r.extras.get("shape", {}).get("power_law", {}).get("A_at_bound")]
    pw_winner = UNDECIDED if at_bound else a.name if p >= SEPARATED else b.name if p <= 1 - SEPARATED else UNDECIDED
    holds = None if winner == UNDECIDED else pw_winner == winner
    return {"power_law": {"A_a": float(np.median(pa)), "A_b": float(np.median(pb)), "p_A_greater": p,
                          "winner": pw_winner, "at_bound": at_bound},
            "holds_under_both_shapes": holds}


def compare_recipes(results, margin=0.02):
    """Table of A, B, C_mid with intervals, all pairwise comparisons, and a ranking by wins (ties broken
    by A) of the results whose A can rank them; with fewer than two such results there is no ranking,
    and 'ranking_note' says why."""
    table = []
    for r in results:
        s = r.summary()
        table.append({k: s[k] for k in ("name", "A", "A_lower_bound", "A_fit", "B", "C_mid", "R0", "ci",
                                        "identifiable", "n_seeds")})
    pairs = [compare_pair(a, b, margin) for a, b in itertools.combinations(results, 2)]
    rankable = [r for r in results if not blocking(r)]
    out = {"margin": margin, "table": table, "pairs": pairs, "ranking": []}
    left_out = [f"{r.name} ({', '.join(t for _, t in blocking(r))})" for r in results if blocking(r)]
    if len(rankable) < 2:
        out["ranking_note"] = ("no ranking: fewer than two recipes have a measured A; left out: "
                               + "; ".join(left_out))
        return out
    names = {r.name for r in rankable}
    among = [p for p in pairs if p["a"] in names and p["b"] in names]
    out["supported"] = [f"{p['winner']} > {p['b'] if p['winner'] == p['a'] else p['a']}"
                        for p in among if p["winner"] != UNDECIDED]
    open_pairs = [f"{p['a']} vs {p['b']}" for p in among if p["winner"] == UNDECIDED]
    if open_pairs:  # a total order would claim what the intervals leave open
        out["ranking_note"] = ("no ranking: the intervals leave " + ", ".join(open_pairs) + " undecided; "
                               + ("supported: " + ", ".join(out["supported"]) if out["supported"]
                                  else "no pair is separated")
                               + (("; left out: " + "; ".join(left_out)) if left_out else ""))
        return out
    wins = {r.name: 0 for r in rankable}
    for p in among:
        wins[p["winner"]] += 1
    order = sorted(rankable, key=lambda r: (-wins[r.name], -r.fit.A))
    out["ranking"] = [{"rank": i + 1, "name": r.name, "wins": wins[r.name]} for i, r in enumerate(order)]
    if left_out:
        out["ranking_note"] = "left out of the ranking: " + "; ".join(left_out)
    return out


def budget_table(results, budgets):
    """Predicted pass rate of each result at each compute budget (rows: results, columns: budgets)."""
    budgets = np.asarray(budgets, dtype=float)
    return np.stack([r.fit.predict(budgets) for r in results]) if results else np.zeros((0, budgets.size))


def budget_bands(results, budgets):
    """Per result and budget: the predicted pass rate, its confidence band (lo, hi) and whether it is
    shown: a budget beyond the data of a result whose A is not measured (blocking flags) is hidden,
    since the prediction there only extrapolates an unknown ceiling."""
    budgets = np.asarray(budgets, dtype=float)
    pred, lo, hi, shown = (np.zeros((len(results), budgets.size)) for _ in range(4))
    for i, r in enumerate(results):
        p, (blo, bhi), _ = r.predict(budgets)
        pred[i], lo[i], hi[i] = p, blo, bhi
        shown[i] = (budgets <= r.c.max()) | (not blocking(r))
    return pred, lo, hi, shown.astype(bool)
