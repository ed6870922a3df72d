"""One call from runs to a fit summary: window, fit, bootstrap, identifiability, extrapolation check,
and the diagnostics that refuse bad curves (diagnostics.py), each a named flag.

`fit_runs(runs)` fits the seeds of one configuration together and returns a `Result`; its `summary()`
is the JSON-ready dict that `launch/fit.py` writes to fit.json. With method='grid' every number and
message comes from the paper's grid fit (the bootstrap is drawn around it and refitted by the batched
solver). `refit(records)` is the eval-and-fit loop's entry point: it never raises on data problems, it
returns a status.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rl_scaling.scaling import compare, diagnostics, fit as fitlib, uncertainty as unc
from rl_scaling.scaling.errors import ScalingDataError
from rl_scaling.scaling.io import Run


@dataclasses.dataclass(frozen=True)
class Options:
    c_min: float | None = None  # None: drop the early phase as the paper does (fit.window_mask)
    c_max: float | None = None  # None: the largest compute
    # the window starts at the first eval after this many generated samples in every run (metrics.jsonl
    # 'samples'), instead of a fraction of each run's compute: the paper starts each window after the
    # same 1.5k GPU-hours however long the run, so runs of different lengths or sizes share a start
    start_samples: float | None = None
    method: str = "direct"  # or 'grid' (the paper's)
    r0: object = "measured"  # 'measured' (mean eval at C = 0, fitted when absent), 'fit', or a number
    n_boot: int = 1000
    boot_method: str | None = None  # None: 'seeds' for >= 2 seeds, else 'residual'
    level: float = 0.95
    holdout: float | None = 0.5  # fit early, predict late: fraction of the window's compute, or a value
    a_bounds: tuple = (0.0, 1.0)
    unit: str = "flops"  # axis name; 'gpu_hours' makes the grid fit use the paper's absolute C_mid grid
    grid: dict = dataclasses.field(default_factory=dict)  # a_grid, cmid_grid, inner for fit_grid
    seed: object = 0  # int or np.random.SeedSequence: this fit's own random stream (see streams)
    eval_sd: float | None = None  # measured eval-to-eval noise (launch/eval_noise.py); None: binomial bound
    eval_sd_source: str = ""  # where eval_sd came from, for the messages


def streams(seed, n):
    """n independent child streams of a fit's seed (an int or a SeedSequence): every bootstrap draws
    from its own, so replicate i of two fits never shares draws (sharing them correlates the replicate
    A's of two recipes and makes P(A_a > A_b) overconfident)."""
    root = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    # children by spawn key, not root.spawn(): the same seed gives the same streams on every call
    return [np.random.SeedSequence(root.entropy, spawn_key=root.spawn_key + (i,)) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    runs: tuple
    opts: Options
    c: np.ndarray  # window points, all seeds pooled
    y: np.ndarray
    groups: np.ndarray
    fit: fitlib.Fit
    boot: unc.Bootstrap
    center: fitlib.Fit  # the fit the bootstrap replicates were drawn around (the main fit)
    identifiable: bool
    reasons: tuple
    warnings: tuple
    extras: dict
    flags: tuple = ()  # (code, message) findings, codes in diagnostics.FLAG_CODES
    power_A: np.ndarray | None = None  # the power law's A over its bootstrap replicates (None: not fitted)

    def refit_fixed(self, fixed):
        return fitlib.fit_fixed(self.c, self.y, fixed, self.fit, self._r0(), self.opts.a_bounds)

    def _r0(self):
        return self.fit.R0 if self.fit.r0_fixed else None

    def predict(self, c):
        """Point prediction, confidence band and prediction interval at compute values c."""
        c = np.atleast_1d(np.asarray(c, dtype=float))
        band = unc.curve_band(self.boot, c, self.opts.level)
        pi = unc.prediction_interval(self.fit, self.boot, c, self.opts.level, self.center)
        return self.fit.predict(c), band, pi

    def summary(self):
        f, level = self.fit, self.opts.level
        ci = unc.param_intervals(self.boot, level)
        out = {
            "name": self.name, "status": "ok", "n_seeds": len(self.runs),
            "seeds": [r.seed for r in self.runs], "sources": [r.source for r in self.runs],
            "axis": self.runs[0].axis if self.runs else self.opts.unit, "method": f.method,
            "A": f.A if self.identifiable else None,
            "A_lower_bound": None if self.identifiable else ci["A"][0],
            "A_fit": f.A, "B": f.B, "C_mid": f.C_mid, "R0": f.R0, "R0_fixed": f.r0_fixed,
            "ci": {k: list(v) for k, v in ci.items() if k != "R0" or not f.r0_fixed},
            "level": level, "identifiable": self.identifiable,
            "flags": [{"code": k, "message": m} for k, m in self.flags],
            "messages": list(self.reasons) + [f"{k}: {m}" for k, m in self.flags if k != "not_identifiable"],
            "window": {"c_min": float(self.c.min()), "c_max": float(self.c.max()), "n_points": int(self.c.size),
                       "requested": [self.opts.c_min, self.opts.c_max], "start_samples": self.opts.start_samples},
            "ssr": f.ssr, "rmse": float(np.sqrt(f.ssr / f.n)), "sigma": f.sigma,
            "bootstrap": {"method": self.boot.method, "n_boot": int(self.boot.theta.shape[0])},
        }
        if not self.identifiable:
            out["messages"].insert(0, _not_identifiable(ci, f, level))
        out.update(self.extras)
        return out


def _not_identifiable(ci, f, level):
    return (f"A is not identifiable from this window; report A >= {ci['A'][0]:.3f} "
            f"(lower end of the {level:.0%} interval), not A = {f.A:.3f}")


def _pool(runs):
    c = np.concatenate([r.compute for r in runs])
    y = np.concatenate([r.pass_rate for r in runs])
    g = np.concatenate([np.full(r.compute.size, i) for i, r in enumerate(runs)])
    return c, y, g


def _window(runs, c_all, opts):
    """The pooled points inside the fit window: fit.window_mask's rule, or with opts.start_samples the
    evals at or after that many generated samples in each run (and inside [c_min, c_max] when given)."""
    if opts.start_samples is None:
        return fitlib.window_mask(c_all, opts.c_min, opts.c_max)
    missing = [r.source for r in runs if r.samples is None]
    if missing:
        raise ScalingDataError(f"a window from {opts.start_samples:g} samples needs the generated samples at "
                               f"each eval (metrics.jsonl 'samples'); {', '.join(missing)} has none")
    s_all = np.concatenate([r.samples for r in runs])
    return fitlib.window_mask(c_all, opts.c_min or 0.0, opts.c_max) & (s_all >= opts.start_samples)


def _r0_stderr(runs):
    """Standard error of the measured R0 (mean of the runs' step-0 evals) from the logged eval stderr,
    or None when any of those evals lacks one."""
    se = [r.stderr[r.compute == 0] for r in runs if r.stderr is not None and (r.compute == 0).any()]
    k = sum(int((r.compute == 0).sum()) for r in runs)
    if not se or sum(v.size for v in se) != k or not all(np.isfinite(v).all() for v in se):
        return None
    return float(np.sqrt(np.sum(np.concatenate(se) ** 2)) / k)


def _resolve_r0(r0, c, y):
    if r0 == "fit":
        return None, "R0 fitted"
    if r0 == "measured":
        m = fitlib.measured_r0(c, y)
        return (m, "R0 fixed to the measured pass rate at compute 0") if m is not None else \
            (None, "no eval at compute 0: R0 fitted")
    return float(r0), "R0 fixed by the caller"


def fit_runs(runs, name=None, opts: Options | None = None, **kw):
    """Fit the seeds of one configuration (a list of io.Run) together."""
    opts = dataclasses.replace(opts or Options(), **kw)
    runs = tuple(runs)
    if not runs:
        raise ScalingDataError("no runs to fit")
    name = name or runs[0].recipe
    for r in runs:
        fitlib.check_curve(r.compute, r.pass_rate, r.source)
    c_all, y_all, g_all = _pool(runs)
    r0, r0_note = _resolve_r0(opts.r0, c_all, y_all)
    r0_n = int((c_all == 0).sum()) if opts.r0 == "measured" and r0 is not None else None
    r0_se = _r0_stderr(runs) if r0_n else None
    m = _window(runs, c_all, opts)
    c, y, g = c_all[m], y_all[m], g_all[m]
    if c.size < fitlib.MIN_POINTS:
        raise ScalingDataError(f"{name}: {c.size} points in the fit window [{opts.c_min}, {opts.c_max}] "
                               f"(sources: {', '.join(r.source for r in runs)}); "
                               f"at least {fitlib.MIN_POINTS} are needed")
    fit_info = _fitter(opts, r0, name)
    fit_one = lambda cc, yy: fit_info(cc, yy)[0]  # noqa: E731
    main, grid_info = fit_info(c, y)
    extras = {"notes": [n for r in runs for n in r.notes] + [r0_note]}
    if r0_n:
        extras["notes"].append("its noise enters the intervals (from " +
                               ("the logged eval stderr)" if r0_se is not None else "the residuals)"))
    if grid_info is not None:
        extras["grid"] = grid_info
        extras["notes"].append("intervals: bootstrap replicates drawn around the grid fit, refitted by the "
                               "batched solver")
    bm = opts.boot_method or ("seeds" if len(runs) >= 2 else "residual")
    main_rng, early_rng, power_rng = streams(opts.seed, 3)
    fit_free_r0 = lambda cc, yy: _fitter(opts, None, name)(cc, yy)[0]  # noqa: E731
    own = _own_fits(c, y, g, main, fit_free_r0)
    auto = diagnostics.autocorrelation(y - own, g)
    block = diagnostics.block_length(c.size // max(np.unique(g).size, 1)) if auto["p_value"] < diagnostics.ALPHA else None
    extras["autocorrelation"] = {**auto, "block_bootstrap": block is not None, "block": block}
    if block:
        extras["notes"].append(f"residuals autocorrelated (lag-1 r = {auto['lag1']:.2f}, p = {auto['p_value']:.2g}): "
                               f"moving-block bootstrap, blocks of {block} evals")
    boot = unc.bootstrap(main, c, y, opts.n_boot, bm, groups=g, rng=main_rng, r0_evals=r0_n, r0_se=r0_se,
                         block=block)
    ok, reasons, warns = unc.identifiability(main, boot, float(c.max()), opts.level)
    if grid_info is not None and grid_info["at_grid_edge"]:
        reasons.append(f"the grid fit sits at the edge of its grid (A = {main.A:.3f} in "
                       f"[{grid_info['a_grid'][0]:.3f}, {grid_info['a_grid'][1]:.3f}], C_mid = {main.C_mid:.4g} in "
                       f"[{grid_info['cmid_grid'][0]:.4g}, {grid_info['cmid_grid'][1]:.4g}])")
        ok = False
    if opts.holdout:
        extras["extrapolation"] = _early_late(c_all, y_all, g_all, c, opts, r0, (r0_n, r0_se), fit_one, early_rng)
    try:
        extras["sigmoid_vs_power_law"] = compare.sigmoid_vs_power(c, y, fit_one, opts.holdout or 0.5,
                                                                  opts.a_bounds)
    except ScalingDataError as e:
        extras["sigmoid_vs_power_law"] = {"status": "skipped", "message": str(e)}
    power_A = _power_law_shape(c, y, g, main, boot, opts, power_rng, block, extras)
    extras["diagnostics"] = _diagnose(runs, c, y, g, main, own, fit_free_r0, extras, opts)
    flags = []
    if not ok:
        ci = unc.param_intervals(boot, opts.level)
        flags.append(("not_identifiable", _not_identifiable(ci, main, opts.level) + ": " + "; ".join(reasons)))
    flags += [("wide_interval", w) for w in warns] + diagnostics.flags(extras["diagnostics"])
    if ok and any(k == "still_rising" for k, _ in flags):
        ok = False  # the data outrun the fit's flattening: A is a lower bound
        reasons.append("the last quarter of the window still rises faster than the fit implies")
    return Result(name=name, runs=runs, opts=opts, c=c, y=y, groups=g, fit=main, boot=boot, center=main,
                  identifiable=ok, reasons=tuple(reasons), warnings=tuple(warns), extras=extras,
                  flags=tuple(flags), power_A=power_A)


def _power_law_shape(c, y, g, main, boot, opts, rng, block, extras):
    """The power law R = A - D / C^B on the same window with its own bootstrap, and the shape verdict:
    extras['shape'] holds both ceilings with intervals, the AIC and held-out preferences, and whether A
    moves with the assumed shape by more than the sigmoid's own interval. Returns the power law's A
    replicates (None when it cannot be fitted)."""
    try:
        pooled, theta, _, dof = compare.power_bootstrap(c, y, g, opts.n_boot, rng, opts.a_bounds, block)
    except ScalingDataError as e:
        extras["shape"] = {"status": "skipped", "message": str(e)}
        return None
    a_lo, a_hi = unc.interval(theta[:, 0], opts.level, dof)
    s_lo, s_hi = unc.param_intervals(boot, opts.level)["A"]
    sp = extras.get("sigmoid_vs_power_law", {})
    gap = pooled["A"] - main.A
    extras["shape"] = {
        "status": "ok",
        "sigmoid": {"A": main.A, "ci_A": [s_lo, s_hi], "aic": compare.aic(main.ssr, main.n, main.n_free)},
        "power_law": {"A": pooled["A"], "B": pooled["B"], "D": pooled["D"], "ci_A": [float(a_lo), float(a_hi)],
                      "A_at_bound": pooled["A_at_bound"], "aic": compare.aic(pooled["ssr"], pooled["n"], 3)},
        "preferred_by_aic": "sigmoid" if compare.aic(main.ssr, main.n, main.n_free) <= compare.aic(pooled["ssr"], pooled["n"], 3)
        else "power_law",
        "preferred_by_heldout": {"sigmoid": "sigmoid", "power_law": "power_law"}.get(sp.get("preferred_by_heldout"),
                                                                                  sp.get("preferred_by_heldout")),
        "A_gap": float(gap),
        "A_depends_on_shape": bool(abs(gap) > (s_hi - s_lo) / 2.0),
    }
    return theta[:, 0]


def _fitter(opts, r0, name):
    """(c, y) -> (Fit, grid info or None) for the chosen method."""
    if opts.method == "direct":
        return lambda c, y: (fitlib.fit_direct(c, y, r0, opts.a_bounds, name), None)
    if opts.method == "grid":
        return lambda c, y: fitlib.fit_grid(c, y, r0, unit=opts.unit, source=name, **opts.grid)
    raise ValueError(f"unknown fit method {opts.method!r} (direct or grid)")


def _own_fits(c, y, g, main, fit_free_r0):
    """Each seed's own fit with R0 free, evaluated at its points (seeds differ by smooth curves, and a
    fixed R0 by the noise of one eval: neither is a lack of fit of the law's shape; with a pinned R0 the
    false alarms were 3-6% at alpha 0.01 on log-spaced binomial curves, < 0.5% with it free)."""
    fitted = np.empty_like(y)
    for label in np.unique(g):
        ii = g == label
        try:
            f = fit_free_r0(c[ii], y[ii])
        except ScalingDataError:  # too few points or flat: the pooled curve stands in
            f = main
        fitted[ii] = f.predict(c[ii])
    return fitted


def _diagnose(runs, c, y, g, main, fitted, fit_free_r0, extras, opts):
    """Inputs of diagnostics.flags: runs test and eval-noise test on each seed's residuals around its own
    fit (`fitted`), the decline and late-dip tests, the still-rising test of the last quarter against the
    pooled fit, the best straight-line baseline and a missed hold-out prediction."""
    res = y - fitted
    n_free = 4 * np.unique(g).size  # each seed's own fit: A, B, C_mid, R0
    out = {"runs": diagnostics.runs_test(res, g),
           "decline": diagnostics.decline_test(c, y, g),
           "late_dip": diagnostics.late_dip_test(c, y, g, fit_free_r0, opts.eval_sd),
           "tail": diagnostics.tail_slope(c, y, main.predict(c), g)}
    sizes = [r.eval_samples for r in runs]
    if opts.eval_sd:
        out["noise"] = {**diagnostics.noise_test(res, opts.eval_sd, c.size - n_free),
                        "source": f"measured eval noise{' (' + opts.eval_sd_source + ')' if opts.eval_sd_source else ''}"}
    elif all(sizes):
        sd = diagnostics.binomial_sd(fitted, np.asarray(sizes)[g])
        out["noise"] = {**diagnostics.noise_test(res, sd, c.size - n_free), "eval_samples": sizes,
                        "source": f"binomial bound over {sizes[0]} samples per eval, no measured noise given "
                                  "(an upper bound on a fixed prompt set: pass --noise)"}
    sp = extras.get("sigmoid_vs_power_law", {})
    base = compare.best_baseline(sp)
    if base:
        out["baseline"] = base
    ex = extras.get("extrapolation", {})
    level = opts.level
    if ex.get("status") == "ok" and not ex["last_point"]["covered"]:
        lp = ex["last_point"]
        out["holdout"] = {"fit_until": ex["fit_until"], "compute": lp["compute"], "observed": lp["observed"],
                          "predicted": lp["predicted"], "pi": lp["pi"], "level": level}
    return out


def _early_late(c_all, y_all, g_all, c_win, opts, r0, r0_noise, fit_one, rng):
    """Fit the window's points up to `holdout` (with the main fit's method), predict every later point;
    errors and the last point's prediction interval."""
    cut = opts.holdout * c_win.max() if opts.holdout <= 1.0 else opts.holdout
    lo = c_win.min()
    early = (c_all >= lo) & (c_all <= cut) & (c_all > 0)
    late = c_all > cut
    out = {"fit_until": float(cut), "n_fit": int(early.sum()), "n_heldout": int(late.sum())}
    if early.sum() < fitlib.MIN_POINTS or not late.any():
        out.update(status="skipped", message=f"{int(early.sum())} points before {cut:.4g} and "
                                              f"{int(late.sum())} after: nothing to check")
        return out
    ce, ye = c_all[early], y_all[early]
    try:
        fe = fit_one(ce, ye)
    except ScalingDataError as e:
        out.update(status="skipped", message=str(e))
        return out
    ge = g_all[early]
    bm = opts.boot_method or ("seeds" if np.unique(ge).size >= 2 else "residual")
    be = unc.bootstrap(fe, ce, ye, opts.n_boot, bm, groups=ge, rng=rng,
                       r0_evals=r0_noise[0], r0_se=r0_noise[1])
    cl, yl = c_all[late], y_all[late]
    order = np.argsort(cl, kind="stable")
    cl, yl = cl[order], yl[order]
    err = compare.holdout_errors(fe.predict(cl), yl)
    last = cl[-1]
    pi_lo, pi_hi = unc.prediction_interval(fe, be, [last], opts.level)
    obs_last = float(yl[cl == last].mean())
    out.update(status="ok", A_early=fe.A, B_early=fe.B, C_mid_early=fe.C_mid, rmse=err["rmse"],
               last_point={"compute": float(last), "observed": obs_last, "predicted": float(fe.predict(last)),
                           "error": float(fe.predict(last) - obs_last),
                           "pi": [float(pi_lo[0]), float(pi_hi[0])],
                           "covered": bool(pi_lo[0] <= obs_last <= pi_hi[0])})
    return out


def fit_arrays(compute, pass_rate, name="curve", **kw):
    """fit_runs for one curve given as arrays."""
    c, y = fitlib.check_curve(compute, pass_rate, name)
    run = Run(name=name, recipe=name, seed=None, compute=c, pass_rate=y, source=name, axis=kw.get("unit", "compute"))
    return fit_runs([run], name=name, **kw)


def refit(records, target_compute=None, **kw):
    """Fit summary from the (compute, pass_rate) eval records accumulated so far (the eval-and-fit loop).

    records: (compute, pass_rate) pairs or dicts with those keys, any order; repeated computes are
    averaged and non-finite records dropped (both noted). Returns the summary dict with 'status':
    'ok', 'too_few_points' (< 4 in the window) or 'error' (other bad data); never raises on data.
    With target_compute: 'target' gives the predicted pass rate there, its band and prediction interval.
    """
    kw.setdefault("n_boot", 500)
    out = {"status": "ok", "n_records": len(records), "messages": []}
    try:
        pts = [(r["compute"], r["pass_rate"]) if isinstance(r, dict) else tuple(r) for r in records]
        arr = np.array(pts, dtype=float).reshape(-1, 2)
    except (KeyError, TypeError, ValueError) as e:
        return {**out, "status": "error", "message": f"records must be (compute, pass_rate) pairs: {e}"}
    good = np.isfinite(arr).all(axis=1) & (arr[:, 0] >= 0)
    if (~good).any():
        out["messages"].append(f"dropped {int((~good).sum())} records with NaN/inf or negative compute")
    arr = arr[good]
    cs, inv = np.unique(arr[:, 0], return_inverse=True)
    ys = np.bincount(inv, weights=arr[:, 1], minlength=cs.size) / np.maximum(np.bincount(inv, minlength=cs.size), 1)
    if cs.size < arr.shape[0]:
        out["messages"].append("averaged records that share a compute value")
    n_win = int(fitlib.window_mask(cs, kw.get("c_min"), kw.get("c_max")).sum()) if cs.size else 0
    if n_win < fitlib.MIN_POINTS:
        return {**out, "status": "too_few_points", "n_points": n_win,
                "message": f"{n_win} eval points in the fit window, {fitlib.MIN_POINTS} needed; keep training"}
    try:
        res = fit_arrays(cs, ys, name=kw.pop("name", "live"), **kw)
    except ScalingDataError as e:
        return {**out, "status": "error", "message": str(e)}
    s = res.summary()
    s["messages"] = out["messages"] + s["messages"]
    s["n_records"] = out["n_records"]
    if target_compute is not None:
        p, (blo, bhi), (plo, phi) = res.predict([target_compute])
        s["target"] = {"compute": float(target_compute), "pass_rate": float(p[0]),
                       "band": [float(blo[0]), float(bhi[0])], "pi": [float(plo[0]), float(phi[0])],
                       "extrapolated": bool(target_compute > res.c.max())}
    return s
