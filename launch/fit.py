"""Fit the sigmoid compute law to eval curves; write fit.json and figures.

    python launch/fit.py WORKDIR_OR_FILE... [--out=DIR] [--axis=flops|accel_hours|steps]
        [--method=direct|grid] [--c-min=C] [--c-max=C] [--start-samples=N] [--r0=measured|fit|VALUE] [--n-boot=1000]
        [--holdout=0.5] [--budgets=C1,C2,...] [--predict-at=C1,...]

Inputs: trainer workdirs (metrics.jsonl, searched recursively; seeds of one recipe are fitted together),
TensorBoard event directories, or CSV files with columns compute,pass_rate[,run,seed].
Writes DIR/fit.json (per recipe: A, B, C_mid, R0 with 95% intervals, window, identifiability,
fit-early-predict-late error, sigmoid vs power law; a recipe comparison when there are several) and
DIR/fit_<recipe>.png, DIR/asymptotes.png, DIR/heatmap.png. DIR defaults to the first input's `fit/`
(`RUN/fit` for a workdir RUN, local or gs://; a file's folder + `/fit` for a file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys


import numpy as np

from rl_scaling import paths as files  # local or gs://
from rl_scaling.scaling import api, compare, io, noise, plots
from rl_scaling.scaling.errors import ScalingDataError


def _floats(text):
    return [float(v) for v in text.split(",") if v.strip()] if text else []


def _grid(text, kind):
    """'lo:hi:step' for A, 'lo:hi:n' for C_mid."""
    if not text:
        return None
    lo, hi, k = (float(v) for v in text.split(":"))
    return np.round(np.arange(lo, hi + k / 2, k), 6) if kind == "a" else np.linspace(lo, hi, int(k))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="workdirs, metrics.jsonl, event dirs or CSV files (globs allowed)")
    ap.add_argument("--out", default=None, help="output directory (default: FIRST_INPUT/fit; for a file input, "
                                                  "its folder's fit/)")
    ap.add_argument("--axis", choices=io.AXES, default="flops", help="compute axis of metrics/event inputs")
    ap.add_argument("--method", choices=("direct", "grid"), default="direct",
                    help="direct: fast bounded least squares; grid: the paper's grid search + curve_fit")
    ap.add_argument("--c-min", type=float, default=None,
                    help="window start; default drops compute below 1.5/16 of the largest "
                         "(the paper's early phase); 0 keeps all")
    ap.add_argument("--c-max", type=float, default=None, help="window end (default: the largest compute)")
    ap.add_argument("--start-samples", type=float, default=None,
                    help="start every run's window at its first eval after this many generated samples "
                         "(metrics.jsonl inputs), instead of 1.5/16 of each recipe's compute: a shared start "
                         "for runs of different lengths or sizes, as the paper starts every run after 1.5k GPU-hours")
    ap.add_argument("--r0", default="measured", help="'measured' (eval at compute 0), 'fit', or a value")
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--boot", choices=("residual", "parametric", "pairs", "seeds"), default=None,
                    help="bootstrap; default: seeds when a recipe has several, else residual")
    ap.add_argument("--holdout", type=float, default=0.5,
                    help="fit up to this fraction of the window's compute (<= 1) or this compute (> 1), "
                         "predict the rest; 0 skips the check")
    ap.add_argument("--predict-at", default="", help="comma-separated compute values to predict")
    ap.add_argument("--budgets", default="", help="heat-map budgets; default 0.25x..8x the largest compute")
    ap.add_argument("--margin", default="auto",
                    help="margin on A for comparisons: a number, or 'auto' = the larger of the paper's 0.02 and the "
                         "margin the seed-to-seed spread supports")
    ap.add_argument("--noise", default="", help="eval-to-eval noise measured by launch/eval_noise.py (noise.json): "
                                                "the lack-of-fit and late-dip checks use it instead of the binomial bound")
    ap.add_argument("--a-grid", default="", help="grid method: A grid lo:hi:step (default 0.45:0.8:0.005)")
    ap.add_argument("--cmid-grid", default="", help="grid method: C_mid grid lo:hi:n (default the paper's, rescaled)")
    ap.add_argument("--grid-unit", default=None,
                    help="'gpu_hours': use the paper's absolute C_mid grid [100, 40000]; otherwise it is "
                         "rescaled by (largest compute / 16000)")
    ap.add_argument("--log-x", action="store_true", help="log compute axis in the per-run figures")
    ap.add_argument("--seed", type=int, default=0, help="root seed of the bootstrap: each recipe draws from its own "
                                                          "stream spawned from it (recorded in fit.json)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = default_out(args.inputs[0])
    if args.margin != "auto":
        try:
            if float(args.margin) < 0:
                raise ValueError
        except ValueError:
            ap.error(f"--margin={args.margin!r}: give 'auto' or a number >= 0")
    return args


def default_out(first_input: str) -> str:
    """FIRST_INPUT/fit for a workdir or folder (local or gs://), the folder's fit/ for a file, and for a
    glob the fit/ of the folder before its first wildcard."""
    wild = min((i for i in (first_input.find(c) for c in "*?[") if i >= 0), default=-1)
    if wild >= 0:
        head = first_input[:wild]
        folder = head if head.endswith("/") else (head.rsplit("/", 1)[0] + "/" if "/" in head else "")
        return files.join(folder or ".", "fit")
    is_file = (first_input.endswith((".csv", ".jsonl")) if files.is_gcs(first_input)  # no storage call here
               else files.isfile(first_input))
    if is_file:
        return files.join(files.dirname(first_input), "fit")
    return files.join(first_input, "fit")


def _slug(name):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


def run(args):
    runs = io.load_inputs(args.inputs, args.axis)
    files.makedirs(args.out)
    r0 = args.r0 if args.r0 in ("measured", "fit") else float(args.r0)
    grid = {k: v for k, v in (("a_grid", _grid(args.a_grid, "a")), ("cmid_grid", _grid(args.cmid_grid, "c")))
            if v is not None}
    eval_sd = _eval_sd(args)
    opts = api.Options(c_min=args.c_min, c_max=args.c_max, start_samples=args.start_samples, method=args.method,
                       r0=r0, n_boot=args.n_boot,
                       boot_method=args.boot, holdout=args.holdout or None, unit=args.grid_unit or runs[0].axis,
                       grid=grid, eval_sd=eval_sd, eval_sd_source=args.noise if eval_sd else "")
    groups = io.group_runs(runs)
    # one random stream per recipe, spawned from the root seed: replicate i of two recipes never shares
    # draws, so P(A_a > A_b) over replicate pairs is what it claims to be
    streams = api.streams(args.seed, len(groups))
    out = {"settings": {**vars(args), "root_seed": args.seed,
                        "streams": {name: {"root_seed": args.seed, "spawn_key": list(ss.spawn_key)}
                                    for name, ss in zip(groups, streams)}},
           "recipes": {}}
    results, failed = [], []
    for (recipe, group), stream in zip(groups.items(), streams):
        try:
            res = api.fit_runs(group, name=recipe, opts=dataclasses.replace(opts, seed=stream))
        except ScalingDataError as e:
            print(f"error: {e}", file=sys.stderr)
            out["recipes"][recipe] = {"name": recipe, "status": "error", "message": str(e)}
            failed.append(recipe)
            continue
        s = res.summary()
        preds = _floats(args.predict_at)
        if preds:
            p, (blo, bhi), (plo, phi) = res.predict(preds)
            s["predictions"] = [{"compute": c, "pass_rate": float(p[i]), "band": [float(blo[i]), float(bhi[i])],
                                 "pi": [float(plo[i]), float(phi[i])]} for i, c in enumerate(preds)]
        out["recipes"][recipe] = s
        results.append(res)
        _figure(plots.plot_fit, files.join(args.out, f"fit_{_slug(recipe)}.png"), res, log_x=args.log_x)
        _report(s)
    if results:
        top = max(r.c.max() for r in results)
        budgets = _floats(args.budgets) or [top * m for m in (0.25, 0.5, 1, 2, 4, 8)]
        table, lo, hi, shown = compare.budget_bands(results, budgets)
        out["budgets"] = {"compute": budgets, "pass_rate": {r.name: table[i].tolist() for i, r in enumerate(results)},
                          "band": {r.name: [lo[i].tolist(), hi[i].tolist()] for i, r in enumerate(results)},
                          "shown": {r.name: shown[i].tolist() for i, r in enumerate(results)}}
        _figure(plots.plot_asymptotes, files.join(args.out, "asymptotes.png"), results)
        _figure(plots.plot_heatmap, files.join(args.out, "heatmap.png"), results, budgets)
    out["noise"] = _noise(args, io.group_runs(runs))
    if len(results) >= 2:
        cmp_ = compare.compare_recipes(results, out["noise"]["margin_used"])
        out["comparison"] = cmp_
        for p in cmp_["pairs"]:
            print(f"{p['a']} vs {p['b']}: {p['winner']} ({p['rule']})")
        if cmp_["ranking"]:
            print("ranking: " + ", ".join(f"{r['rank']}. {r['name']}" for r in cmp_["ranking"]))
        if cmp_.get("ranking_note"):
            print(cmp_["ranking_note"])
    files.write_text(files.join(args.out, "fit.json"), json.dumps(out, indent=1, default=_json_default))
    print(f"wrote {files.join(args.out, 'fit.json')}")
    return out, failed


def _eval_sd(args):
    """The measured eval-to-eval sd from --noise (noise.json), or None."""
    if not args.noise:
        return None
    ev = json.loads(files.read_text(files.resolve(args.noise)))
    return float(ev["sd_measured_pooled"])


def _noise(args, groups):
    """Seed-to-seed spread, eval-to-eval noise (--noise) and the margin on A they support."""
    spread = noise.seed_spread(groups)
    margin, why = noise.choose_margin(args.margin, spread)
    out = {"seed_sd": spread["sd"], "seed_df": spread["df"], "plateau_tail": spread["tail"],
           "per_recipe": spread["per_recipe"], "margin_paper": noise.PAPER_MARGIN, "margin_used": margin,
           "margin_source": why, "margin_from_seeds": None}
    if spread["sd"] is not None:
        out["margin_from_seeds"] = noise.margin_from_seeds(spread["sd"], spread["seeds_per_recipe"])
        print(f"seed-to-seed sd of the plateaus (last {spread['tail']:.0%} of compute): {spread['sd']:.4f} "
              f"({spread['df']} df); margin on A from {spread['seeds_per_recipe']} seeds: {out['margin_from_seeds']:.4f}")
    if args.noise:
        ev = json.loads(files.read_text(files.resolve(args.noise)))
        out["eval_sd_measured"], out["eval_sd_binomial"] = ev["sd_measured_pooled"], ev["sd_binomial_pooled"]
        print(f"eval-to-eval sd on the fixed prompt set: {ev['sd_measured_pooled']:.4f} measured "
              f"(binomial {ev['sd_binomial_pooled']:.4f}; {args.noise})")
    print(f"margin on A: {margin:.4f} ({why}; the paper's {noise.PAPER_MARGIN})")
    return out


def _figure(plot, path, *args, **kw):
    """A plot saved as PNG to a local or gs:// path (matplotlib writes into the open file)."""
    with files.open_file(path, "wb") as f:
        plot(*args, path=f, **kw)


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"not JSON serializable: {type(v)}")


def _report(s):
    ci = s["ci"]
    if s["identifiable"]:
        a = f"A={s['A']:.3f} [{ci['A'][0]:.3f}, {ci['A'][1]:.3f}]"
    else:
        a = f"A>={s['A_lower_bound']:.3f} (not identifiable)"
    print(f"{s['name']}: {a}  B={s['B']:.2f} [{ci['B'][0]:.2f}, {ci['B'][1]:.2f}]  "
          f"C_mid={s['C_mid']:.4g}  R0={s['R0']:.3f}  ({s['window']['n_points']} points, {s['n_seeds']} seed(s))")
    ex = s.get("extrapolation", {})
    if ex.get("status") == "ok":
        lp = ex["last_point"]
        print(f"  fit to {ex['fit_until']:.4g}, predict the rest: RMSE {ex['rmse']:.4f}, last point "
              f"{lp['predicted']:.3f} vs {lp['observed']:.3f} (95% PI [{lp['pi'][0]:.3f}, {lp['pi'][1]:.3f}])")
    sh = s.get("shape", {})
    if sh.get("status") == "ok":
        pw = sh["power_law"]
        print(f"  power law: A={pw['A']:.3f} [{pw['ci_A'][0]:.3f}, {pw['ci_A'][1]:.3f}]"
              f"{' (at its bound)' if pw['A_at_bound'] else ''}; preferred by AIC: {sh['preferred_by_aic']}, "
              f"by the held-out half: {sh['preferred_by_heldout']}"
              + ("; A depends on the assumed shape by more than its interval" if sh["A_depends_on_shape"] else ""))
    noise_d = s.get("diagnostics", {}).get("noise")
    if noise_d:
        print(f"  residuals {noise_d['ratio']:.1f}x the eval noise ({noise_d['source']})")
    for f in s.get("flags", []):
        print(f"  warning [{f['code']}]: {f['message']}")
    for m in s.get("notes", []):
        print(f"  note: {m}")


def main(argv=None):
    args = parse_args(argv)
    try:
        _, failed = run(args)
    except ScalingDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except files.StorageError as e:  # names the gs:// path, the operation and the endpoint
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
