"""Freeze predictions before the runs that test them, then score the runs against the frozen file.

    python launch/preregister.py freeze --runs=notebooks/results --recipes=scalerl,dapo,minimax \\
        --multiples=2,3,4 --out=notebooks/results/preregistered.json
    python launch/preregister.py score --prereg=notebooks/results/preregistered.json \\
        --runs=notebooks/results/extension --out=notebooks/results/extension.md

`freeze` fits each recipe's shipped seeds (metrics.jsonl) with both shapes (scaling/shapes.py) and
writes, per recipe, the predicted pass rate with 95% prediction intervals at each multiple of the
recipe's shipped compute (the mean over seeds of their last logged compute). Commit the file before
the extension runs write their first metrics line: the git history is the proof that the numbers came
first. `score` reads the extension runs and compares each seed's eval at those computes (linear in
ln C between the two evals around it) and the seed mean with the frozen intervals, per shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess

import numpy as np

from rl_scaling.scaling import api, io, shapes

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
                       "samples": samples, "coverage": coverage}, f, indent=1)
        print(f"wrote {args.out} and its .json")
    print(text)
    return coverage


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
    s = sub.add_parser("score")
    s.add_argument("--prereg", required=True)
    s.add_argument("--runs", required=True)
    s.add_argument("--out", default="")
    args = ap.parse_args(argv)
    (freeze if args.cmd == "freeze" else score)(args)


if __name__ == "__main__":
    main()
