"""Recipes x seeds, --jobs at a time, then the comparison table and figures.

    python launch/sweep.py --config=configs/tiny.py --recipes=scalerl,minimax,dapo,grpo,magistral \\
        --seeds=3 --workdir=DIR [--jobs=2] [--prune] [--extra="--config.eval.num_prompts=128"] [--dry_run]

A recipe spec is a name from configs/common.py RECIPES, or a leave-one-out ablation
`NAME+section.field=value[+...]` (e.g. `scalerl+rl.no_positive_resampling=False`), labelled
by the spec itself. The config arg after ':' reaches the config file (tiny: samples=, evals=:
`--config=configs/tiny.py:samples=76800` is a compute-matched short sweep); `--extra` passes
more `--config.` overrides to every run.

Layout: DIR/warmstart (one supervised warm start, shared by every run: the "base model"; skip
with --init_checkpoint=PATH), DIR/<label>/seed<k> (one launch/run.py workdir each, log in
run.log; a finished run is skipped when the sweep is re-run, an interrupted one resumes, and a
finished one whose config now plans more steps, a larger `samples=`, resumes from its last
checkpoint to the new budget: one curve, as the learning rate is constant after warm-up),
DIR/fit (launch/fit.py: fit.json, per-recipe fits, asymptotes.png, heatmap.png),
DIR/curves.png (raw held-out pass rate against compute), DIR/comparison.md (the table),
DIR/sweep.json (commands, wall times, exit codes). With --name=NAME these four are fit_NAME/,
curves_NAME.png, comparison_NAME.md and sweep_NAME.json: comparisons that share runs (ScaleRL's
seeds are the reference of the leave-one-out table and of the batch-size axis) share one DIR.
A spec's `+key=value` without a dot is a config-file arg (tiny: `scalerl+prompts=64`).
--dry_run prints the commands (warm start first, then the runs, which are independent and can
go to a cluster in parallel, then the fit) and runs nothing.
--jobs=N runs N at once, each pinned to its share of the cores (on 2 cores, 2 one-core runs
give 1.5x the throughput of one two-core run: small matmuls do not scale over threads). A run's
numerics depend on its thread count, so keep N fixed across a sweep's invocations.
--prune uses the law as a scheduler: at every new eval each recipe is refitted (seeds pooled);
once a recipe's A has a 95% upper bound below the best identifiable recipe's lower bound, its
runs get SIGTERM (they checkpoint and exit 75) and its queued seeds are not started. A pruned
run's directory gets `sweep_pruned` (why, at which evals): a later sweep with --prune skips it,
one without --prune resumes it. sweep.json records why and the compute saved.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

from configs import common  # no jax: --dry_run stays fast
from rl_scaling import paths
from rl_scaling.scaling import sweep_report  # the table and the curves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DONE = "sweep_done"
PRUNED = "sweep_pruned"  # a run --prune stopped: skipped by later --prune sweeps, resumed by others


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.py", help="config file, optionally with ':arg=value,...'")
    ap.add_argument("--recipes", default="scalerl,minimax,dapo,grpo,magistral",
                    help="comma-separated recipe names or NAME+section.field=value ablations")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per recipe")
    ap.add_argument("--first_seed", type=int, default=0,
                    help="seeds FIRST..FIRST+N-1 instead: fresh seeds for a confirmation of earlier runs")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--extra", default="", help="more --config.* overrides for every run (one string)")
    ap.add_argument("--init_checkpoint", default="", help="params to start every run from (default: a shared warm start)")
    ap.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--name", default="", help="a name for this comparison: its outputs are fit_NAME/, comparison_NAME.md, "
                    "sweep_NAME.json, curves_NAME.png, so several comparisons share the runs of one DIR")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each pinned to its share of the CPU cores")
    ap.add_argument("--prune", action="store_true",
                    help="refit at every eval; stop a recipe once its A's 95%% upper bound is below the best's lower bound")
    ap.add_argument("--prune_boot", type=int, default=200, help="bootstrap replicates of each --prune refit")
    ap.add_argument("--poll_s", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--axis", default="flops", choices=("flops", "accel_hours", "steps"), help="compute axis of the fit")
    ap.add_argument("--fit_args", default="", help="more launch/fit.py flags (one string), e.g. '--n-boot=300'")
    ap.add_argument("--python", default=sys.executable)
    return ap.parse_args(argv)


def parse_recipes(text):
    """[(label, name, [--config.* overrides])]; unknown names fail listing the valid ones."""
    specs = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        name, *fields = spec.split("+")
        if name not in common.RECIPES:
            raise SystemExit(f"--recipes: unknown recipe {name!r}; valid recipes: {', '.join(sorted(common.RECIPES))}")
        overrides, config_args = [], {}
        for f in fields:
            if "=" not in f:
                raise SystemExit(f"--recipes: ablation {f!r} in {spec!r} must look like section.field=value "
                                 "(a config override) or key=value (a config-file arg, e.g. prompts=64)")
            key, value = f.split("=", 1)
            if "." in key:
                overrides.append(f"--config.{f}")
            else:
                config_args[key] = value
        if fields:
            overrides.append(f"--config.recipe={spec}")  # the label the fitter groups seeds by
        specs.append((spec, name, overrides, config_args))
    labels = [s[0] for s in specs]
    if not specs or len(set(labels)) != len(labels):
        raise SystemExit(f"--recipes: give distinct recipes, got {text!r}")
    return specs


def _config_flag(config, **args):
    path, _, arg = config.partition(":")
    merged = dict(common.parse_arg(arg))
    merged.update({k: str(v) for k, v in args.items()})
    return f"--config={path}:" + ",".join(f"{k}={v}" for k, v in merged.items())


def _check_config_arg(flag, label):
    """Build the config of `--config=PATH:ARGS` (ml_collections only, no jax) to surface bad args.
    Returns its planned steps."""
    import importlib.util

    path, _, arg = flag.removeprefix("--config=").partition(":")
    spec = importlib.util.spec_from_file_location("sweep_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config(arg)
    except (ValueError, KeyError, AttributeError) as e:
        raise SystemExit(f"--recipes: {label!r} gives {path} the config args {arg!r}: {e}") from None
    return config.get("steps")


def _steps_override(flags):
    """The last `--config.steps=N` among a run's flags, else None."""
    found = [f.split("=", 1)[1] for f in flags if f.startswith("--config.steps=")]
    return int(found[-1]) if found else None


def plan(args):
    """The warm-start command (or None), the runs [(label, seed, workdir, cmd)], the init path and
    each run's planned steps {workdir: steps or None}."""
    specs = parse_recipes(args.recipes)
    if args.seeds < 1 or args.first_seed < 0:
        raise SystemExit("--seeds must be >= 1 and --first_seed >= 0")
    workdir = paths.resolve(args.workdir)  # local, or gs:// for --dry_run's cluster commands
    run_py = os.path.join(ROOT, "launch", "run.py")
    extra = shlex.split(args.extra)
    warm, init = None, args.init_checkpoint
    if not init:
        ws_dir = paths.join(workdir, "warmstart")
        init = paths.join(ws_dir, "warmstart", "params")
        warm = [args.python, run_py, _config_flag(args.config, recipe=specs[0][1], seed=0), f"--workdir={ws_dir}",
                *extra, "--config.steps=1", "--config.eval_every=1", "--config.checkpoint_every=1"]
    steps = {}
    for label, name, overrides, config_args in specs:  # a bad config-file arg fails here, not runs later
        steps[label] = _check_config_arg(_config_flag(args.config, recipe=name, seed=0, **config_args), label)
        steps[label] = _steps_override(overrides + extra) or steps[label]
    runs, planned = [], {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):  # seed-major: a complete comparison first
        for label, name, overrides, config_args in specs:
            wd = paths.join(workdir, label, f"seed{seed}")
            cmd = [args.python, run_py, _config_flag(args.config, recipe=name, seed=seed, **config_args), f"--workdir={wd}",
                   f"--config.init_checkpoint={init}", *overrides, *extra]
            runs.append((label, seed, wd, cmd))
            planned[wd] = steps[label]
    return warm, runs, init, planned


def output(args, filename):
    """DIR/filename, or DIR/stem_NAME.ext for a named comparison (--name)."""
    stem, ext = os.path.splitext(filename)
    return paths.join(paths.resolve(args.workdir), f"{stem}_{args.name}{ext}" if args.name else filename)


def fit_cmd(args, workdirs):
    noise_json = paths.join(paths.resolve(args.workdir), "noise.json")  # launch/eval_noise.py's, when measured
    return [args.python, os.path.join(ROOT, "launch", "fit.py"), *workdirs,
            f"--out={output(args, 'fit')}", f"--axis={args.axis}",
            *([f"--noise={noise_json}"] if os.path.exists(noise_json) else []),
            *shlex.split(args.fit_args)]


def _start(cmd, log_path, cores=None):
    """One run as a child process logging to log_path, pinned to `cores` (a set of CPU ids) if given."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = open(log_path, "a")
    log.write("$ " + shlex.join(cmd) + "\n")
    log.flush()
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=pin,
                            env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")))
    log.close()  # the child holds its own copy
    return proc


def _run(cmd, log_path):
    t0 = time.time()
    rc = _start(cmd, log_path).wait()
    return rc, time.time() - t0


def _core_sets(jobs):
    """CPU ids per job slot: the cores this process may use, dealt out round-robin."""
    if jobs <= 1 or not hasattr(os, "sched_getaffinity"):
        return [None] * max(jobs, 1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < jobs:
        return [None] * jobs
    return [set(cores[i::jobs]) for i in range(jobs)]


def _evals(workdir):
    """[(compute_flops, step)] of a run's held-out evals so far (a torn last line is skipped)."""
    path = os.path.join(workdir, "metrics.jsonl")
    out = []
    if os.path.exists(path):
        for line in open(path):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "eval/pass_rate" in rec:
                out.append((rec.get("compute_flops", 0.0), rec.get("step", 0)))
    return out


def prune_decision(workdirs_by_label, n_boot=200):
    """The law as a scheduler: refit each recipe's seeds so far; a recipe whose A's 95% upper bound
    is below the best identifiable recipe's lower bound cannot catch up at any budget.
    Returns ({label: (A_lo, A_hi, identifiable)}, {pruned label: reason})."""
    from rl_scaling.scaling import api, io

    bounds = {}
    for label, wds in workdirs_by_label.items():
        metrics = [os.path.join(wd, "metrics.jsonl") for wd in wds if len(_evals(wd)) >= 3]
        if not metrics:
            continue
        try:
            runs = [r for m in metrics for r in io.load_jsonl(m, recipe=label)]
            s = api.fit_runs(runs, name=label, n_boot=n_boot, holdout=None).summary()
        except (ValueError, RuntimeError):  # ScalingDataError included
            continue  # too few points in the window yet
        lo, hi = s["ci"]["A"]
        bounds[label] = (lo, hi, bool(s["identifiable"]))
    ident = {k: v for k, v in bounds.items() if v[2]}
    if not ident:
        return bounds, {}
    best = max(ident, key=lambda k: ident[k][0])
    lo_best = ident[best][0]
    pruned = {k: f"A <= {v[1]:.3f} (95% upper bound) < {best}'s A >= {lo_best:.3f} (95% lower bound)"
              for k, v in bounds.items() if k != best and v[1] < lo_best}
    return bounds, pruned


def _extends(workdir, planned_steps):
    """The steps a finished run ran, when this sweep plans more for it (else None)."""
    ran = _planned(workdir)[0]
    return ran if ran and planned_steps and ran < planned_steps else None


def _has_checkpoint(workdir):
    ckpts = os.path.join(workdir, "checkpoints")
    return os.path.isdir(ckpts) and any(d.isdigit() for d in os.listdir(ckpts))


def schedule(args, runs, record, workdir, planned=None):
    """Run the planned runs, `args.jobs` at a time; with --prune, refit at every new eval and stop
    the recipes the law rules out (SIGTERM: they checkpoint and exit 75, so a later sweep without
    --prune resumes them). Returns the run entries and the pruning record."""
    slots = _core_sets(args.jobs)
    queue = list(enumerate(runs))
    running = {}  # slot -> (entry, proc, t0)
    entries, pruned = {}, {}
    seen_evals = {}
    by_label = {}
    for label, _, wd, _ in runs:
        by_label.setdefault(label, []).append(wd)

    def save():
        record["runs"] = [entries[i] for i in sorted(entries)]
        record["pruned"] = pruned
        _write_json(output(args, "sweep.json"), record)

    while queue or running:
        free = [k for k in range(len(slots)) if k not in running]
        while free and queue:
            i, (label, seed, wd, cmd) = queue.pop(0)
            entry = {"label": label, "seed": seed, "workdir": wd, "cmd": shlex.join(cmd)}
            entries[i] = entry
            done = os.path.exists(os.path.join(wd, DONE))
            ran = done and _extends(wd, (planned or {}).get(wd))
            if ran and not _has_checkpoint(wd):  # shipped results keep no checkpoints
                print(f"[{i + 1}/{len(runs)}] {label} seed {seed}: finished at {ran} steps; {planned[wd]} are "
                      f"planned but {wd}/checkpoints holds none to extend from: skipped (move the run away to "
                      "rerun it from the start)", flush=True)
                ran = None
            if ran:
                # the marker goes before the run starts: its config.json now plans the longer budget,
                # so a marker left behind would read an interrupted extension as finished
                os.remove(os.path.join(wd, DONE))
                entry["extended_from_steps"] = ran
                print(f"[{i + 1}/{len(runs)}] {label} seed {seed}: finished at {ran} steps, extended to "
                      f"{planned[wd]} from its last checkpoint", flush=True)
            elif done:
                entry.update(json.load(open(os.path.join(wd, DONE))), skipped=True)
                print(f"[{i + 1}/{len(runs)}] {label} seed {seed}: done before, skipped", flush=True)
                continue
            marker = os.path.join(wd, PRUNED)
            if args.prune and os.path.exists(marker):
                with open(marker) as f:
                    pruned.setdefault(label, json.load(f))
                entry.update(rc=75, pruned=True, skipped=True)
                print(f"[{i + 1}/{len(runs)}] {label} seed {seed}: pruned before, skipped", flush=True)
                continue
            if label in pruned:
                entry.update(rc=None, pruned=True)
                print(f"[{i + 1}/{len(runs)}] {label} seed {seed}: pruned, not started", flush=True)
                continue
            k = free.pop(0)
            print(f"[{i + 1}/{len(runs)}] {label} seed {seed}: started{'' if slots[k] is None else f' on cores {sorted(slots[k])}'}",
                  flush=True)
            running[k] = (i, _start(cmd, os.path.join(wd, "run.log"), slots[k]), time.time())
        time.sleep(args.poll_s if running else 0)
        for k, (i, proc, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            entry, wall = entries[i], time.time() - t0
            entry.update(rc=rc, wall_s=wall)
            print(f"[{i + 1}/{len(runs)}] {entry['label']} seed {entry['seed']}: exit {rc}, {wall / 60:.1f} min", flush=True)
            if rc == 0:
                with open(os.path.join(entry["workdir"], DONE), "w") as f:
                    json.dump({"rc": rc, "wall_s": wall}, f)
            del running[k]
            save()
        if args.prune:
            counts = {wd: len(_evals(wd)) for wds in by_label.values() for wd in wds}
            if counts != seen_evals:
                seen_evals = counts
                live = {lb: wds for lb, wds in by_label.items() if lb not in pruned}
                _, newly = prune_decision(live, n_boot=args.prune_boot)
                for label, why in newly.items():
                    pruned[label] = {"reason": why, "at_evals": {wd: counts[wd] for wd in by_label[label]}}
                    print(f"pruned {label}: {why}", flush=True)
                    for i, proc, _ in running.values():
                        if entries[i]["label"] == label:
                            entries[i]["pruned"] = True
                            _write_json(os.path.join(entries[i]["workdir"], PRUNED), pruned[label])
                            proc.send_signal(signal.SIGTERM)
                if newly:
                    save()
    if pruned:
        record["compute_saved"] = compute_saved(runs, pruned)
        print(f"pruning saved {record['compute_saved']['saved_frac']:.0%} of the sweep's planned compute "
              f"({record['compute_saved']['saved_flops']:.3g} of {record['compute_saved']['planned_flops']:.3g} FLOPs)",
              flush=True)
    save()
    return [entries[i] for i in sorted(entries)], pruned


def _planned(workdir):
    """(planned steps, compute per step so far) of a started run, from its config.json and metrics."""
    try:
        steps = json.load(open(os.path.join(workdir, "config.json")))["steps"]
    except (OSError, KeyError, json.JSONDecodeError):
        return None, None
    ev = _evals(workdir)
    done_flops, done_step = max(ev) if ev else (0.0, 0)
    return steps, (done_flops / done_step if done_step else None)


def compute_saved(runs, pruned):
    """Planned FLOPs of the whole sweep and what pruning left unspent: a run's planned compute is
    its steps times its (or its recipe's) FLOPs per step so far."""
    per_step, steps_of = {}, {}
    for label, _, wd, _ in runs:
        steps, fps = _planned(wd)
        if steps:
            steps_of.setdefault(label, steps)
        if fps:
            per_step.setdefault(label, fps)
    planned = saved = 0.0
    for label, _, wd, _ in runs:
        total = steps_of.get(label, 0) * per_step.get(label, 0.0)
        ev = _evals(wd)
        done = max(ev)[0] if ev else 0.0
        planned += total
        if label in pruned:
            saved += max(total - done, 0.0)
    return {"planned_flops": planned, "saved_flops": saved, "saved_frac": saved / planned if planned else 0.0}


def main(argv=None):
    args = parse_args(argv)
    warm, runs, init, planned = plan(args)
    if args.dry_run:
        if warm:
            print("# 1. the shared warm start (run first)")
            print(shlex.join(warm))
        print("# 2. the runs (independent of each other)")
        for *_, cmd in runs:
            print(shlex.join(cmd))
        print("# 3. the fit and the comparison table")
        print(shlex.join(fit_cmd(args, [wd for _, _, wd, _ in runs])))
        print("# (or this command without --dry_run once the runs are done: it skips finished runs, fits and "
              "writes comparison.md)")
        return 0
    workdir = paths.resolve(args.workdir)
    if paths.is_gcs(workdir):
        raise SystemExit(f"--workdir={workdir}: a sweep runs here and streams each run's log to local files, so "
                         "its workdir must be local; --dry_run prints the gs:// commands for a cluster")
    os.makedirs(workdir, exist_ok=True)
    record = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": []}
    if not os.path.exists(output(args, "sweep.json")):  # marks the directory as a sweep from the start (io.py)
        _write_json(output(args, "sweep.json"), record)
    t_start = time.time()
    if warm and not os.path.isdir(init):
        print("warm start ...", flush=True)
        rc, wall = _run(warm, os.path.join(workdir, "warmstart", "run.log"))
        record["warmstart"] = {"cmd": shlex.join(warm), "rc": rc, "wall_s": wall}
        if rc != 0 or not os.path.isdir(init):
            print(f"error: the warm start failed (exit {rc}); see {workdir}/warmstart/run.log", file=sys.stderr)
            return 1
    record["runs"], record["pruned"] = schedule(args, runs, record, workdir, planned)
    # pruned runs that had started keep their partial curves in the fit
    ok = [r["workdir"] for r in record["runs"] if r.get("rc") == 0 or (r.get("pruned") and _evals(r["workdir"]))]
    failed = [f"{r['label']}/seed{r['seed']}" for r in record["runs"] if r.get("rc") != 0 and not r.get("pruned")]
    fit = None
    if ok:
        cmd = fit_cmd(args, ok)
        rc, wall = _run(cmd, os.path.join(output(args, "fit"), "fit.log"))
        record["fit"] = {"cmd": shlex.join(cmd), "rc": rc, "wall_s": wall}
        fit_path = os.path.join(output(args, "fit"), "fit.json")
        fit = json.load(open(fit_path)) if os.path.exists(fit_path) else None
    record["wall_s"] = time.time() - t_start
    record["run_wall_s"] = sum(r.get("wall_s", 0.0) for r in record["runs"])
    _write_json(output(args, "sweep.json"), record)
    runs_info = [dict(r, metrics=sweep_report.run_summary(r["workdir"])) for r in record["runs"] if r["workdir"] in ok]
    sweep_report.write_curves(runs_info, args.axis, output(args, "curves.png"))
    files = {f: os.path.basename(output(args, f)) for f in ("fit", "curves.png", "sweep.json")}
    text = sweep_report.comparison_markdown(fit, runs_info, failed, record, args, files)
    with open(output(args, "comparison.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {output(args, 'comparison.md')}")
    return 1 if failed else 0


def _write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
