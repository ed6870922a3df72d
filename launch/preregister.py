"""Freeze predictions before the runs that test them, then score the runs against the frozen file.

    python launch/preregister.py freeze --runs=notebooks/results --recipes=scalerl,dapo,minimax \\
        --multiples=2,3,4 --out=notebooks/results/preregistered.json
    python launch/preregister.py score --prereg=notebooks/results/preregistered.json \\
        --runs=notebooks/results/extension --out=notebooks/results/extension.md
    python launch/preregister.py freeze-ceiling --fit=notebooks/results/fit_sizes_start/fit.json \\
        --recipe=scalerl+size=l --reference=scalerl --out=notebooks/results/preregistered_sizes.json
    python launch/preregister.py score-ceiling --prereg=notebooks/results/preregistered_sizes.json \\
        --runs=notebooks/results/sizes/l_confirm --noise=notebooks/results/noise.json \\
        --out=notebooks/results/sizes_confirmation.md
    python launch/preregister.py freeze-stability --baseline=notebooks/results/sizes/l/scalerl+size=l \\
        --recipe=scalerl+size=l+optim.lr=0.0001 --reference-fit=notebooks/results/fit_sizes/fit.json \\
        --spread-below=0.015 --out=notebooks/results/preregistered_l_lr.json
    python launch/preregister.py score-stability --prereg=notebooks/results/preregistered_l_lr.json \\
        --runs=notebooks/results/sizes/l_lr --noise=notebooks/results/noise.json \\
        --out=notebooks/results/sizes_lr.md
    python launch/preregister.py freeze-plateau --reference-runs=notebooks/results/sizes/l_lr_long \\
        --sizes=s:scalerl+optim.lr=0.0001,m:scalerl+size=m+optim.lr=0.0001 --samples=3072000 \\
        --out=notebooks/results/preregistered_sizes_lr.json
    python launch/preregister.py score-plateau --prereg=notebooks/results/preregistered_sizes_lr.json \\
        --runs=notebooks/results/sizes/sm_lr --out=notebooks/results/sizes_one_lr.md
    python launch/preregister.py freeze-plateau \\
        --reference-runs=notebooks/results/sizes/l_lr_long,notebooks/results/sizes/l_lr_confirm \\
        --sizes=s:scalerl+optim.lr=0.0001 --samples=3072000 --out=notebooks/results/preregistered_s_lr_fresh.json

`freeze` fits each recipe's shipped seeds (metrics.jsonl) with both shapes (scaling/shapes.py) and
writes, per recipe, the predicted pass rate with 95% prediction intervals at each multiple of the
recipe's shipped compute (the mean over seeds of their last logged compute). Commit the file before
the extension runs write their first metrics line: the git history is the proof that the numbers came
first. `freeze-ceiling` does the same for a ceiling: what fresh seeds of one recipe will show under a
shipped --start-samples fit's window (identifiable, A in that fit's interval widened by sqrt(2), not
above a reference's), and `score-ceiling` fits the fresh seeds the same way and checks each claim.
`freeze-stability` freezes what a changed recipe will do to a plateau that wanders (each seed's
second-half spread, diagnostics.plateau_jitter, below a bound; an identifiable ceiling under the default
window; no ceiling separable from a reference's), and `score-stability` measures and fits the new seeds.
`freeze-plateau` freezes a size test at one learning rate (the largest size's plateaus as they ran, from
one sweep or several holding other seeds of one recipe, and the t-test that will compare them with the
smaller sizes' once those have run), `score-plateau` decides it.
`score` reads the extension runs and compares each seed's eval at those computes (linear in
ln C between the two evals around it) and the seed mean with the frozen intervals, per shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess

import numpy as np
from scipy import stats

from rl_scaling.scaling import api, diagnostics, io, noise, shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROOT_SEED = 20261204


def _git_head():
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def freeze(args):
    recipes = args.recipes.split(",")
    multiples = [float(m) for m in args.multiples.split(",")]
    groups = io.group_runs(io.load_inputs([args.runs], "flops"))
    missing = [r for r in recipes if r not in groups]
    if missing:
        raise SystemExit(f"{args.runs}: no runs for recipe(s) {missing}; found {sorted(groups)}")
    root = np.random.SeedSequence(args.seed)
    streams = api.streams(root, len(recipes))
    out = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code_commit": _git_head(), "root_seed": args.seed, "level": 0.95, "axis": "flops",
           "source": args.runs, "multiples": multiples,
           "how": "fit with launch/fit.py's defaults (window drops the first ~9% of compute, R0 measured), "
                  "seeds pooled; sigmoid and power law each with a seeds bootstrap of 1000 replicates; "
                  "pi_seed: one seed's eval, pi_mean: the mean of the same seeds' evals (scaling/shapes.py)",
           "recipes": {}}
    for name, ss in zip(recipes, streams):
        runs = groups[name]
        shipped = float(np.mean([r.compute.max() for r in runs]))
        targets = [m * shipped for m in multiples]
        pred = shapes.predict_both(runs, targets, ss)
        pred.update(shipped_compute=shipped, seeds=[r.seed for r in runs],
                    sources=[os.path.relpath(r.source, ROOT) for r in runs])
        out["recipes"][name] = pred
        for shape in shapes.SHAPES:
            row = " ".join(f"{a['pass_rate']:.3f} [{a['pi_seed'][0]:.3f}, {a['pi_seed'][1]:.3f}]" for a in pred[shape]["at"])
            print(f"{name} {shape}: A={pred[shape]['A']:.3f} at {args.multiples}x: {row}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


def score(args):
    with open(args.prereg) as f:
        pre = json.load(f)
    groups = io.group_runs(io.load_inputs([args.runs], "flops"))
    lines = ["# Pre-registered predictions against the extension runs",
             "",
             f"Predictions: `{os.path.relpath(args.prereg, ROOT)}` (created {pre['created']} from the shipped runs at "
             f"commit {str(pre['code_commit'])[:9]}; {pre['how']}). Observed: `{os.path.relpath(args.runs, ROOT)}`, "
             "each seed's eval at the target compute, linear in ln C between the two evals around it.",
             "", "| recipe | shape | x | compute | predicted | 95% PI one seed | observed seeds | covered | "
             "seed mean | 95% PI mean | covered |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    tally = {s: [0, 0, 0, 0] for s in shapes.SHAPES}  # seeds covered, seeds scored, means covered, means scored
    errors = {s: [] for s in shapes.SHAPES}  # seed mean - prediction
    rows = []
    for name, pred in pre["recipes"].items():
        runs = groups.get(name, [])
        for shape in shapes.SHAPES:
            for m, at in zip(pre["multiples"], pred[shape]["at"]):
                obs = [shapes.observed_at(r, at["compute"]) for r in runs]
                obs = [o for o in obs if o is not None]
                lo, hi = at["pi_seed"]
                cov = sum(lo <= o <= hi for o in obs)
                mean = float(np.mean(obs)) if len(obs) == len(pred["seeds"]) else None
                mcov = mean is not None and at["pi_mean"][0] <= mean <= at["pi_mean"][1]
                t = tally[shape]
                t[0] += cov
                t[1] += len(obs)
                t[2] += int(mcov)
                t[3] += int(mean is not None)
                if mean is not None:
                    errors[shape].append(mean - at["pass_rate"])
                rows.append({"recipe": name, "shape": shape, "multiple": m, "compute": at["compute"],
                             "predicted": at["pass_rate"], "pi_seed": [lo, hi], "pi_mean": at["pi_mean"],
                             "observed": obs, "mean": mean})
                obs_s = ", ".join(f"{o:.3f}" for o in obs) or "not reached"
                lines.append(f"| {name} | {shape} | {m:g} | {at['compute']:.3g} | {at['pass_rate']:.3f} | "
                             f"[{lo:.3f}, {hi:.3f}] | {obs_s} | {cov}/{len(obs)} | "
                             f"{'' if mean is None else f'{mean:.3f}'} | [{at['pi_mean'][0]:.3f}, {at['pi_mean'][1]:.3f}] | "
                             f"{'' if mean is None else ('yes' if mcov else 'no')} |")
    lines += ["", "Coverage of the 95% prediction intervals:", ""]
    for shape, (c1, n1, c2, n2) in tally.items():
        lines.append(f"- {shape}: one-seed intervals {c1}/{n1}, seed-mean intervals {c2}/{n2}")
    for shape, err in errors.items():
        if err:
            lines.append(f"- {shape}: seed mean minus prediction {', '.join(f'{e:+.3f}' for e in err)} "
                         f"(mean abs {np.mean(np.abs(err)):.3f})")
    text = "\n".join(lines) + "\n"
    coverage = {s: {"seed_covered": t[0], "seed_scored": t[1], "mean_covered": t[2], "mean_scored": t[3],
                    "mean_abs_error": float(np.mean(np.abs(errors[s]))) if errors[s] else None,
                    "errors": errors[s]} for s, t in tally.items()}
    samples = max((v for g in groups.values() for r in g if (v := _samples(r)) is not None), default=None)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"prereg": os.path.relpath(args.prereg, ROOT), "runs": os.path.relpath(args.runs, ROOT),
                       "samples": samples, "coverage": coverage, "rows": rows}, f, indent=1)
        print(f"wrote {args.out} and its .json")
    print(text)
    return coverage


def freeze_ceiling(args):
    """Freeze what fresh seeds of one recipe will show under the window rule of a shipped fit: an
    identifiable ceiling, inside that fit's 95% interval of A widened by sqrt(2) (a new pair of seeds
    carries its own sampling error as large as the old pair's), not separated above a reference's."""
    fit = json.loads(open(args.fit).read())
    rec, ref = fit["recipes"][args.recipe], fit["recipes"][args.reference]
    start = rec["window"].get("start_samples")
    if rec["A"] is None or start is None:
        raise SystemExit(f"{args.fit}: {args.recipe} needs an identified A and a --start-samples window "
                         f"(A {rec['A']}, start_samples {start})")
    a, (lo, hi) = rec["A"], rec["ci"]["A"]
    band = [a - np.sqrt(2.0) * (a - lo), a + np.sqrt(2.0) * (hi - a)]
    ref_hi = ref["ci"]["A"][1]
    out = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code_commit": _git_head(), "fit": os.path.relpath(args.fit, ROOT), "recipe": args.recipe,
           "start_samples": start, "root_seed": args.seed, "level": 0.95,
           "fitted": {"A": a, "ci": [lo, hi], "seeds": rec["seeds"]},
           "reference": {"recipe": args.reference, "A": ref["A"], "ci": ref["ci"]["A"]},
           "claims": {
               "identifiable": f"fresh seeds of {args.recipe}, fitted together from {start:g} samples, have an "
                               "identifiable ceiling (no not_identifiable, still_rising or not_sigmoidal flag)",
               "ceiling_in_band": f"their A lies in [{band[0]:.3f}, {band[1]:.3f}]",
               "not_above_reference": f"the lower end of their A's 95% interval is at or below {args.reference}'s "
                                      f"upper end, {ref_hi:.3f}: no higher ceiling than {args.reference}'s"},
           "band": band}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{args.recipe}: A {a:.3f} [{lo:.3f}, {hi:.3f}] from {start:g} samples; fresh seeds: A in "
          f"[{band[0]:.3f}, {band[1]:.3f}], lower end <= {ref_hi:.3f}\nwrote {args.out}")


def _write_claims(args, lines, claims, observed, held, record):
    """The claims table after `lines`, printed and, with --out, written to OUT (.md) and its .json."""
    lines = lines + [f"| {k} | {claims[k]} | {observed[k]} | {'yes' if held[k] else 'no'} |" for k in claims]
    text = "\n".join(lines + ["", f"{sum(held.values())} of {len(held)} claims held."]) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"prereg": os.path.relpath(args.prereg, ROOT), "runs": os.path.relpath(args.runs, ROOT),
                       "held": held, **record}, f, indent=1)
        print(f"wrote {args.out} and its .json")
    print(text)


def _flag_codes(summary):
    """A fit's warning codes, each once, in the order raised (two checks can raise the same code)."""
    return list(dict.fromkeys(f["code"] for f in summary["flags"]))


def score_ceiling(args):
    """Fit the fresh seeds as the frozen fit was fitted and check each claim; writes OUT (.md and .json)."""
    pre = json.loads(open(args.prereg).read())
    runs = io.group_runs(io.load_inputs([args.runs], "flops")).get(pre["recipe"], [])
    fresh = [r for r in runs if r.seed not in pre["fitted"]["seeds"]]
    if len(fresh) < 2 or len(fresh) != len(runs):
        raise SystemExit(f"{args.runs}: {pre['recipe']} needs 2 or more seeds other than the frozen fit's "
                         f"{pre['fitted']['seeds']}; found {[r.seed for r in runs]}")
    eval_sd = float(json.loads(open(args.noise).read())["sd_measured_pooled"]) if args.noise else None
    opts = api.Options(start_samples=pre["start_samples"], eval_sd=eval_sd, eval_sd_source=args.noise or "",
                       seed=np.random.SeedSequence(pre["root_seed"]))
    s = api.fit_runs(fresh, name=pre["recipe"], opts=opts).summary()
    codes = _flag_codes(s)
    blocking = [c for c in codes if c in diagnostics.BLOCKING]
    a = s["A"] if s["A"] is not None else s["A_lower_bound"]
    lo, hi = s["ci"]["A"]
    held = {"identifiable": not blocking,
            "ceiling_in_band": not blocking and pre["band"][0] <= a <= pre["band"][1],
            "not_above_reference": lo <= pre["reference"]["ci"][1]}
    observed = {"identifiable": "yes" if not blocking else f"no ({', '.join(blocking)})",
                "ceiling_in_band": f"A {'>= ' if s['A'] is None else ''}{a:.3f}" + (" (not a measured ceiling)" if blocking else ""),
                "not_above_reference": f"A's interval [{lo:.3f}, {hi:.3f}]"}
    lines = [f"# Pre-registered: {pre['recipe']}'s ceiling on fresh seeds", "",
             f"Frozen in `{os.path.relpath(args.prereg, ROOT)}` (created {pre['created']}, commit "
             f"{str(pre['code_commit'])[:9]}) from `{pre['fit']}`: A {pre['fitted']['A']:.3f} "
             f"[{pre['fitted']['ci'][0]:.3f}, {pre['fitted']['ci'][1]:.3f}] on seeds {', '.join(pre['fitted']['seeds'])}, "
             f"window from {pre['start_samples']:g} samples. Observed: seeds {', '.join(r.seed for r in fresh)} in "
             f"`{os.path.relpath(args.runs, ROOT)}`, fitted the same way.", "",
             "| claim | frozen | observed | held |", "|---|---|---|---|"]
    _write_claims(args, lines, pre["claims"], observed, held,
                  {"A": s["A"], "A_lower_bound": s["A_lower_bound"], "ci": [lo, hi], "flags": codes})
    return held


def _jitters(runs):
    """{seed: (second-half spread, keep_frac)} of each run, from its metrics.jsonl (diagnostics.plateau_jitter)."""
    out = {}
    for r in runs:
        with open(r.source) as f:
            out[r.seed] = diagnostics.plateau_jitter([json.loads(ln) for ln in f])
    return out


def freeze_stability(args):
    """Freeze what a change to a recipe (a smaller step, say) will do to a wandering plateau: each seed's
    second-half spread below --spread-below (the baseline's seeds measured beside it), an identifiable
    ceiling under the default window, and an A whose interval overlaps the reference's (size s)."""
    base = io.group_runs(io.load_inputs([args.baseline], "flops"))
    if len(base) != 1:
        raise SystemExit(f"{args.baseline}: expected the seeds of one recipe, found {sorted(base) or 'none'}")
    (label, runs), = base.items()
    ref = json.loads(open(args.reference_fit).read())["recipes"][args.reference]
    lo, hi = ref["ci"]["A"]
    out = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code_commit": _git_head(), "recipe": args.recipe, "baseline": label,
           "baseline_spread": {k: round(v[0], 4) for k, v in _jitters(runs).items()},
           "spread_below": args.spread_below,
           "reference": {"recipe": args.reference, "fit": os.path.relpath(args.reference_fit, ROOT),
                         "ci": [round(lo, 3), round(hi, 3)]},
           "claims": {
               "steadier": "each seed's checkpoint-to-checkpoint spread of the held-out pass rate over its second "
                           "half (report.py's definition: sd of successive differences / sqrt 2) is below "
                           f"{args.spread_below:g}",
               "identifiable": "the two seeds fitted together with the default window (the first 1.5/16 of their "
                               "compute dropped, noise.json) carry no blocking flag (not_identifiable, "
                               "not_sigmoidal, still_rising)",
               "overlaps_s": f"their sigmoid A's 95% interval overlaps {args.reference}'s (size s) "
                             f"[{lo:.3f}, {hi:.3f}]: no ceiling separable from s's"}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{args.recipe}: frozen against {label}'s spread {out['baseline_spread']}\nwrote {args.out}")


def score_stability(args):
    """Measure each seed's spread and fit the seeds with the default window; check each frozen claim.
    Writes OUT (.md and .json)."""
    pre = json.loads(open(args.prereg).read())
    runs = io.group_runs(io.load_inputs([args.runs], "flops")).get(pre["recipe"], [])
    if len(runs) < 2:
        raise SystemExit(f"{args.runs}: {pre['recipe']} needs 2 or more seeds; found {[r.seed for r in runs]}")
    jit = _jitters(runs)
    eval_sd = float(json.loads(open(args.noise).read())["sd_measured_pooled"]) if args.noise else None
    opts = api.Options(eval_sd=eval_sd, eval_sd_source=args.noise or "",
                       seed=np.random.SeedSequence(pre.get("root_seed", ROOT_SEED)))
    s = api.fit_runs(runs, name=pre["recipe"], opts=opts).summary()
    codes = _flag_codes(s)
    blocking = [c for c in codes if c in diagnostics.BLOCKING]
    a = s["A"] if s["A"] is not None else s["A_lower_bound"]
    lo, hi = s["ci"]["A"]
    ref_lo, ref_hi = pre["reference"]["ci"]
    held = {"steadier": all(j < pre["spread_below"] for j, _ in jit.values()),
            "identifiable": s["A"] is not None and not blocking,
            "overlaps_s": lo <= ref_hi and ref_lo <= hi}
    spreads = ", ".join(f"seed {k} {j:.4f}" for k, (j, _) in jit.items())
    observed = {"steadier": spreads + " (baseline " + ", ".join(f"seed {k} {v:.4f}" for k, v in pre["baseline_spread"].items()) + ")",
                "identifiable": "yes" if not blocking and s["A"] is not None else
                                f"no ({', '.join(blocking) or 'not_identifiable'})",
                "overlaps_s": f"A {'>= ' if s['A'] is None else ''}{a:.3f} [{lo:.3f}, {hi:.3f}]"}
    lines = [f"# Pre-registered: {pre['recipe']} against {pre['baseline']}'s wandering plateau", "",
             f"Frozen in `{os.path.relpath(args.prereg, ROOT)}` (created {pre['created']}, commit "
             f"{str(pre['code_commit'])[:9]}). Observed: seeds {', '.join(r.seed for r in runs)} in "
             f"`{os.path.relpath(args.runs, ROOT)}`, fitted with the default window; flags: "
             f"{', '.join(f['code'] for f in s['flags']) or 'none'}.", "",
             "| claim | frozen | observed | held |", "|---|---|---|---|"]
    _write_claims(args, lines, pre["claims"], observed, held,
                  {"spread": {k: v[0] for k, v in jit.items()}, "keep_frac": {k: v[1] for k, v in jit.items()},
                   "A": s["A"], "A_lower_bound": s["A_lower_bound"], "ci": [lo, hi], "B": s["B"], "C_mid": s["C_mid"],
                   "flags": codes})
    return held


def _plateaus(runs):
    """{seed: mean held-out pass rate over the last quarter of the run's compute} (scaling/noise.plateau)."""
    return {r.seed: noise.plateau(r) for r in runs}


def _at_budget(run, samples):
    """Whether a run's last logged sample count is its planned budget (within 1%)."""
    done = _samples(run)
    return done is not None and abs(done - samples) <= 0.01 * samples


def _size_test(mean_hi, mean_lo, n_hi, n_lo, sd, df):
    """One-sided t-test that the larger size's seed-mean plateau is above the smaller's, with the
    within-size sd pooled over every size: (difference, the margin it must exceed at 5%)."""
    return mean_hi - mean_lo, float(stats.t.ppf(0.95, df)) * sd * np.sqrt(1.0 / n_hi + 1.0 / n_lo)


def freeze_plateau(args):
    """Freeze a size test at one learning rate: the plateaus of the largest size's seeds as they ran
    (--reference-runs), and the rule that will decide, once the smaller sizes have run at the same rate
    and budget, whether a larger policy's plateau is above a smaller one's."""
    dirs = args.reference_runs.split(",")  # several sweeps of one recipe (other seeds) pool into one reference
    groups = io.group_runs(io.load_inputs(dirs, "flops"))
    if len(groups) != 1:
        raise SystemExit(f"{args.reference_runs}: expected the seeds of one recipe, found {sorted(groups) or 'none'}")
    (label, runs), = groups.items()
    short = [r.seed for r in runs if not _at_budget(r, args.samples)]
    if short:
        raise SystemExit(f"{args.reference_runs}: seeds {short} did not run to {args.samples:,} samples")
    pairs = [kv.split(":", 1) for kv in args.sizes.split(",")]
    if any(len(kv) != 2 or not all(kv) for kv in pairs):
        raise SystemExit(f"--sizes={args.sizes}: expected size:recipe pairs, e.g. s:scalerl+optim.lr=0.0001,m:...")
    sizes = dict(pairs)  # size -> recipe label
    out = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code_commit": _git_head(), "samples": args.samples, "tail": 0.25,
           "reference": {"size": args.reference_size, "recipe": label,
                         "runs": ",".join(os.path.relpath(d, ROOT) for d in dirs), "plateaus": _plateaus(runs)},
           "sizes": sizes,
           "rule": "per size, each seed's plateau is its mean held-out pass rate over the last quarter of its compute, "
                   f"every run at {args.samples:,} samples; a larger size is above a smaller one when the difference of "
                   "their seed-mean plateaus exceeds t(0.95, df) x sd x sqrt(1/n1 + 1/n2), sd the within-size sd of "
                   "the plateaus pooled over all sizes (df their seeds minus the number of sizes)"}
    order = [*sizes, args.reference_size]
    out["claims"] = {f"{hi}_above_{lo}": f"size {hi}'s plateau is above size {lo}'s at this learning rate"
                     for i, lo in enumerate(order) for hi in order[i + 1:]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{label}: plateaus {out['reference']['plateaus']}; claims {list(out['claims'])}\nwrote {args.out}")


def score_plateau(args):
    """Measure each size's plateaus (the smaller sizes' runs in --runs) and decide each frozen claim by the
    frozen rule. Writes OUT (.md and .json)."""
    pre = json.loads(open(args.prereg).read())
    groups = io.group_runs(io.load_inputs([args.runs], "flops"))
    plateaus = {}
    for size, label in pre["sizes"].items():
        runs = groups.get(label, [])
        short = [r.seed for r in runs if not _at_budget(r, pre["samples"])]
        if len(runs) < 2 or short:
            raise SystemExit(f"{args.runs}: {label} needs 2 or more seeds run to {pre['samples']:,} samples; "
                             f"found seeds {[r.seed for r in runs]}, not at that budget: {short}")
        plateaus[size] = _plateaus(runs)
    plateaus[pre["reference"]["size"]] = pre["reference"]["plateaus"]
    v = {z: np.array(list(p.values())) for z, p in plateaus.items()}
    sd, df = noise.pooled_sd(v)
    held, observed = {}, {}
    for claim in pre["claims"]:
        hi, lo = claim.split("_above_")
        diff, margin = _size_test(v[hi].mean(), v[lo].mean(), v[hi].size, v[lo].size, sd, df)
        held[claim] = bool(diff > margin)
        observed[claim] = f"{v[hi].mean():.3f} - {v[lo].mean():.3f} = {diff:+.3f} (needs > {margin:.3f})"
    lines = [f"# Pre-registered: policy size at one learning rate, {pre['samples']:,} samples per run", "",
             f"Frozen in `{os.path.relpath(args.prereg, ROOT)}` (created {pre['created']}, commit "
             f"{str(pre['code_commit'])[:9]}). Rule: {pre['rule']}.", "",
             "| size | recipe | plateau per seed | seed mean |", "|---|---|---|---|"]
    labels = {**pre["sizes"], pre["reference"]["size"]: pre["reference"]["recipe"]}
    lines += [f"| {z} | {labels[z]} | " + ", ".join(f"seed {k} {x:.3f}" for k, x in p.items()) + f" | {v[z].mean():.3f} |"
              for z, p in plateaus.items()]
    lines += ["", f"Pooled within-size sd {sd:.4f} ({df} df).", "", "| claim | frozen | observed | held |",
              "|---|---|---|---|"]
    _write_claims(args, lines, pre["claims"], observed, held, {"plateaus": plateaus, "sd": sd, "df": df,
                                                               "observed": observed})
    return held


def _samples(run):
    """Generated samples at a run's last metrics line (from its metrics.jsonl), or None."""
    if not run.source.endswith("metrics.jsonl"):
        return None
    last = None
    with open(run.source) as f:
        for line in f:
            if '"samples"' in line:
                last = json.loads(line).get("samples", last)
    return last


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("freeze")
    f.add_argument("--runs", required=True)
    f.add_argument("--recipes", default="scalerl,dapo,minimax")
    f.add_argument("--multiples", default="2,3,4")
    f.add_argument("--seed", type=int, default=ROOT_SEED)
    f.add_argument("--out", required=True)
    for name, needs_noise in (("score", False), ("score-ceiling", True), ("score-stability", True),
                              ("score-plateau", False)):
        sc = sub.add_parser(name)  # every scorer: the frozen file, the runs that test it, where to write
        sc.add_argument("--prereg", required=True)
        sc.add_argument("--runs", required=True)
        if needs_noise:
            sc.add_argument("--noise", default="", help="noise.json, as the frozen fit used")
        sc.add_argument("--out", default="")
    fc = sub.add_parser("freeze-ceiling")
    fc.add_argument("--fit", required=True, help="a fit.json made with --start-samples")
    fc.add_argument("--recipe", required=True)
    fc.add_argument("--reference", required=True, help="the recipe whose ceiling it should not exceed")
    fc.add_argument("--seed", type=int, default=ROOT_SEED)
    fc.add_argument("--out", required=True)
    fs = sub.add_parser("freeze-stability")
    fs.add_argument("--baseline", required=True, help="the seeds of the recipe as it ran, e.g. sizes/l/scalerl+size=l")
    fs.add_argument("--recipe", required=True, help="the changed recipe's label, e.g. scalerl+size=l+optim.lr=0.0001")
    fs.add_argument("--reference-fit", required=True, help="a fit.json holding the reference's A")
    fs.add_argument("--reference", default="scalerl")
    fs.add_argument("--spread-below", type=float, required=True)
    fs.add_argument("--out", required=True)
    fp = sub.add_parser("freeze-plateau")
    fp.add_argument("--reference-runs", required=True, help="the largest size's seeds at the learning rate under test (DIR[,DIR...])")
    fp.add_argument("--reference-size", default="l")
    fp.add_argument("--sizes", required=True, help="the smaller sizes to run, size:recipe,... smallest first")
    fp.add_argument("--samples", type=int, required=True, help="every run's budget, the reference's included")
    fp.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return {"freeze": freeze, "score": score, "freeze-ceiling": freeze_ceiling, "score-ceiling": score_ceiling,
            "freeze-stability": freeze_stability, "score-stability": score_stability,
            "freeze-plateau": freeze_plateau, "score-plateau": score_plateau}[args.cmd](args)


if __name__ == "__main__":
    main()
