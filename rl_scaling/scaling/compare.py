"""Sigmoid versus power law, fit-early-predict-late, and recipe comparison (the paper's rule and more)."""

from __future__ import annotations

import itertools

import numpy as np

from rl_scaling.scaling import law
from rl_scaling.scaling.fit import MIN_POINTS, lm_solve
from rl_scaling.scaling.errors import ScalingDataError

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
    """Compare both laws on the whole window (AIC) and by extrapolation (fit early, predict late).

    sigmoid_fit_fn(c, y) -> Fit, so the sigmoid uses the same R0 handling as the main fit.
    """
    c, y = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
    sig, pw = sigmoid_fit_fn(c, y), fit_power_law(c, y, a_bounds)
    out = {"sigmoid": {"aic": aic(sig.ssr, sig.n, sig.n_free), "ssr": sig.ssr},
           "power_law": {**pw, "aic": aic(pw["ssr"], pw["n"], pw["n_free"])}}
    early, cut = split_at(c, until)
    out["fit_until"] = cut
    if early.sum() >= MIN_POINTS and (~early).any():
        s_e, p_e = sigmoid_fit_fn(c[early], y[early]), fit_power_law(c[early], y[early], a_bounds)
        out["sigmoid"]["heldout"] = holdout_errors(s_e.predict(c[~early]), y[~early])
        out["power_law"]["heldout"] = holdout_errors(predict_power_law(c[~early], p_e), y[~early])
        out["power_law"]["heldout"]["A"] = p_e["A"]
        out["sigmoid"]["heldout"]["A"] = s_e.A
    out["preferred_by_aic"] = "sigmoid" if out["sigmoid"]["aic"] <= out["power_law"]["aic"] else "power_law"
    return out


# ---------------------------------------------------------------- recipes

def compare_pair(a, b, margin=0.02):
    """The paper's rule for two results (api.Result): if their A are within the margin, refit both with
    the mean A and compare B (higher B = at least as scalable); otherwise the higher A wins.

    Also gives the bootstrap probability that a's A exceeds b's (independent replicates).
    """
    dA = a.fit.A - b.fit.A
    pa, pb = a.boot.params()["A"], b.boot.params()["A"]
    m = min(pa.size, pb.size)
    out = {"a": a.name, "b": b.name, "A_diff": float(dA), "p_A_greater": float(np.mean(pa[:m] > pb[:m]))}
    if abs(dA) <= margin:
        mean_A = (a.fit.A + b.fit.A) / 2.0
        Ba, Bb = (r.refit_fixed({"A": mean_A}).B for r in (a, b))
        out.update(rule="A within margin: refit with mean A, compare B", mean_A=float(mean_A),
                   B_a=float(Ba), B_b=float(Bb), winner=a.name if Ba >= Bb else b.name)
    else:
        out.update(rule="A differs by more than the margin", winner=a.name if dA > 0 else b.name)
    if not (a.identifiable and b.identifiable):
        out["warning"] = "at least one A is only a lower bound; the comparison is provisional"
    return out


def compare_recipes(results, margin=0.02):
    """Table of A, B, C_mid with intervals, all pairwise comparisons, and a ranking by wins
    (ties broken by A)."""
    table = []
    for r in results:
        s = r.summary()
        table.append({k: s[k] for k in ("name", "A", "A_lower_bound", "A_fit", "B", "C_mid", "R0", "ci",
                                        "identifiable", "n_seeds")})
    pairs = [compare_pair(a, b, margin) for a, b in itertools.combinations(results, 2)]
    wins = {r.name: 0 for r in results}
    for p in pairs:
        wins[p["winner"]] += 1
    order = sorted(results, key=lambda r: (-wins[r.name], -r.fit.A))
    ranking = [{"rank": i + 1, "name": r.name, "wins": wins[r.name]} for i, r in enumerate(order)]
    return {"margin": margin, "table": table, "pairs": pairs, "ranking": ranking}


def budget_table(results, budgets):
    """Predicted pass rate of each result at each compute budget (rows: results, columns: budgets)."""
    budgets = np.asarray(budgets, dtype=float)
    return np.stack([r.fit.predict(budgets) for r in results]) if results else np.zeros((0, budgets.size))
