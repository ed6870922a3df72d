"""Loaders: metrics.jsonl workdirs, TensorBoard event directories, CSV. Each returns `Run`s.

Compute axes: 'flops' (model FLOPs), 'accel_hours' (accelerator-hours), 'steps' (trainer steps).
Seeds of one configuration share a recipe name: `config.json` {"recipe": ..., "seed": ...} at the top of
the workdir; otherwise a workdir named like 'seed3' takes its parent directory's name as the recipe
(results/<recipe>/seed<k>/metrics.jsonl), and any other workdir is its own recipe.
A directory searched recursively skips a `warmstart` below it and any directory below it holding its own
`sweep.json` or `sweep_NAME.json` (a nested study); name those explicitly to fit them.
Every error names the file, and the line and column where there is one.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import math
import os
import re

import numpy as np

from rl_scaling import paths as files  # local or gs://
from rl_scaling.scaling.errors import ScalingDataError
from rl_scaling.scaling.fit import check_curve

AXES = ("flops", "accel_hours", "steps")
PASS_KEY = "eval/pass_rate"
STDERR_KEY = "eval/pass_rate_stderr"
# metrics.jsonl key and scale per axis
_JSONL_AXIS = {"flops": ("compute_flops", 1.0), "accel_hours": ("accel_seconds", 1.0 / 3600.0), "steps": ("step", 1.0)}
# TensorBoard tags that may carry the compute (the step axis is the event step itself)
_TB_AXIS = {"flops": (("compute/flops", "compute_flops"), 1.0),
            "accel_hours": (("compute/accel_seconds", "accel_seconds"), 1.0 / 3600.0)}
_SEED_DIR = re.compile(r"^seed[_-]?(\d+)$")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run's eval curve on one compute axis."""

    name: str
    recipe: str
    seed: str | None
    compute: np.ndarray
    pass_rate: np.ndarray
    source: str
    axis: str
    stderr: np.ndarray | None = None
    eval_samples: int | None = None  # prompts x samples per eval (config.json 'eval'), for the binomial noise
    samples: np.ndarray | None = None  # generated RL samples before each eval (metrics.jsonl 'samples')
    notes: tuple = ()  # what the loader repaired (re-logged evals, sorted rows)


def _check_axis(axis):
    if axis not in AXES:
        raise ValueError(f"unknown compute axis {axis!r}; choose one of {AXES}")


def _eval_samples(cfg):
    """Samples behind one eval (num_prompts x samples_per_prompt of the config's 'eval'), or None."""
    ev = cfg.get("eval") if isinstance(cfg, dict) else None
    n, k = (ev.get("num_prompts"), ev.get("samples_per_prompt")) if isinstance(ev, dict) else (None, None)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, k))
    return n * k if ok else None


def _identity(workdir):
    """(recipe, seed, eval samples) of a workdir: config.json first, then the directory names."""
    workdir = files.resolve(workdir)
    base, parent = files.basename(workdir), files.basename(files.dirname(workdir))
    m = _SEED_DIR.match(base)
    recipe, seed = (parent, m.group(1)) if m else (base, None)
    n_eval = None
    cfg_path = files.join(workdir, "config.json")
    if files.isfile(cfg_path):
        try:
            with files.open_file(cfg_path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ScalingDataError(f"{cfg_path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if isinstance(cfg, dict):
            recipe = str(cfg.get("recipe", recipe))
            seed = str(cfg["seed"]) if cfg.get("seed") is not None else seed
            n_eval = _eval_samples(cfg)
    return recipe, seed, n_eval


def _run(recipe, seed, c, y, err, source, axis, where, columns, eval_samples=None, notes=(), samples=None):
    c, y = check_curve(c, y, source, where=where, columns=columns)
    name = recipe if seed is None else f"{recipe}/seed{seed}"
    if err is not None and np.isnan(err).all():
        err = None
    if samples is not None and not np.isfinite(samples).all():
        samples = None
    return Run(name=name, recipe=recipe, seed=seed, compute=c, pass_rate=y, source=source, axis=axis,
               stderr=err, eval_samples=eval_samples, notes=tuple(notes), samples=samples)


def _last_per_step(steps, cols, source):
    """Keep the last record of each step (a resumed run logs the evals after its checkpoint again), in
    step order. steps: step per record (None: not known, kept as is); cols: per-record lists to filter.
    Returns the filtered lists and the notes."""
    last = {s: i for i, s in enumerate(steps) if s is not None}
    keep = [i for i, s in enumerate(steps) if s is None or last[s] == i]
    if len(keep) == len(steps):
        return cols, []
    again = sorted({s for i, s in enumerate(steps) if s is not None and last[s] != i})
    keep.sort(key=lambda i: (steps[i] is None, steps[i] if steps[i] is not None else 0, i))
    shown = ", ".join(f"{s:g}" for s in again[:8]) + (" ..." if len(again) > 8 else "")
    note = (f"{source}: {len(again)} step(s) have more than one eval record (a resumed run logs them "
            f"again): the last record of each is used (steps {shown})")
    return [[col[i] for i in keep] for col in cols], [note]


def _number(value, where, column):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ScalingDataError(f"{where}: column '{column}': not a number ({value!r})") from None
    return float(value)


def load_jsonl(path, axis="flops", recipe=None, seed=None):
    """The trainer's metrics.jsonl: eval records are the lines with 'eval/pass_rate'."""
    _check_axis(axis)
    key, scale = _JSONL_AXIS[axis]
    c, y, err, where, steps, samples = [], [], [], [], [], []
    with files.open_file(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.lstrip("\ufeff") if lineno == 1 else line  # a UTF-8 byte-order mark
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ScalingDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or PASS_KEY not in rec:
                continue
            at = f"{path}:{lineno}"
            if key not in rec:
                raise ScalingDataError(f"{at}: column '{key}' missing (needed for the '{axis}' compute axis)")
            c.append(_number(rec[key], at, key) * scale)
            y.append(_number(rec[PASS_KEY], at, PASS_KEY))
            e = rec.get(STDERR_KEY)
            err.append(math.nan if e is None else _number(e, at, STDERR_KEY))
            where.append(at)
            steps.append(_number(rec["step"], at, "step") if "step" in rec else None)
            samples.append(_number(rec["samples"], at, "samples") if "samples" in rec else math.nan)
    if not c:
        raise ScalingDataError(f"{path}: no eval records (no line has '{PASS_KEY}')")
    (c, y, err, where, samples), notes = _last_per_step(steps, (c, y, err, where, samples), str(path))
    r, s, n_eval = _identity(files.dirname(path))
    return [_run(recipe or r, seed if seed is not None else s, c, y, np.array(err), str(path), axis,
                 where, (key, PASS_KEY), n_eval, notes, np.array(samples))]


def load_tensorboard(logdir, axis="flops", recipe=None, seed=None):
    """Scalars of a TensorBoard event directory: 'eval/pass_rate' against the step or a compute tag."""
    _check_axis(axis)
    from tensorboard.backend.event_processing import event_accumulator as ea  # slow import: only here

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    if PASS_KEY not in tags:
        raise ScalingDataError(f"{logdir}: no scalar '{PASS_KEY}' in the event files (scalars: {sorted(tags)})")
    ev = acc.Scalars(PASS_KEY)
    steps = np.array([e.step for e in ev], dtype=float)
    y = np.array([e.value for e in ev], dtype=float)
    if axis == "steps":
        c, col = steps, "step"
    else:
        names, scale = _TB_AXIS[axis]
        col = next((t for t in names if t in tags), None)
        if col is None:
            raise ScalingDataError(f"{logdir}: no compute scalar {names} for the '{axis}' axis "
                                   f"(scalars: {sorted(tags)})")
        cev = acc.Scalars(col)
        cs, cv = np.array([e.step for e in cev], float), np.array([e.value for e in cev], float) * scale
        order = np.argsort(cs, kind="stable")
        # eval steps without their own compute record: compute grows with the step, so interpolate
        c = np.interp(steps, cs[order], cv[order])
    where = [f"{logdir}: step {int(s)}" for s in steps]
    # the trainer writes its events to WORKDIR/tb: the run's identity belongs to the workdir
    wd = files.dirname(logdir) if files.basename(logdir) == "tb" else logdir  # local or gs://
    r, s, n_eval = _identity(wd)
    return [_run(recipe or r, seed if seed is not None else s, c, y, None, str(logdir), axis, where,
                 (col, PASS_KEY), n_eval)]


def load_csv(path):
    """CSV with columns compute, pass_rate and optional run, seed, stderr; rows of a run in any order
    (sorted by compute, with a note); a UTF-8 byte-order mark is accepted."""
    with files.open_file(path, "r", newline="") as f:
        reader = csv.DictReader(f)
        bom = bool(reader.fieldnames) and reader.fieldnames[0].startswith("\ufeff")
        header = [_column(h) for h in (reader.fieldnames or [])]
        for col in ("compute", "pass_rate"):
            if col not in header:
                raise ScalingDataError(f"{path}: missing column '{col}' (header: {header})")
        stem = os.path.splitext(os.path.basename(path))[0]
        groups = {}
        for lineno, row in enumerate(reader, 2):
            row = {_column(k): v for k, v in row.items()}
            at = f"{path}:{lineno}"
            vals = []
            for col in ("compute", "pass_rate"):
                v = row.get(col)
                if v is None or str(v).strip() == "":
                    raise ScalingDataError(f"{at}: column '{col}' is empty")
                vals.append(_number(str(v).strip(), at, col))
            err = row.get("stderr")
            err = _number(err, at, "stderr") if err not in (None, "") else math.nan
            run = (row.get("run") or stem).strip()
            seed = (row.get("seed") or "").strip() or None
            g = groups.setdefault((run, seed), ([], [], [], []))
            for lst, v in zip(g, (vals[0], vals[1], err, at)):
                lst.append(v)
    if not groups:
        raise ScalingDataError(f"{path}: no data rows")
    extra = (f"{path}: a UTF-8 byte-order mark opens the file; skipped",) if bom else ()
    return [_csv_run(run, seed, cols, str(path), extra) for (run, seed), cols in groups.items()]


def _column(name):
    return (name or "").lstrip("\ufeff").strip()


def _csv_run(run, seed, cols, source, notes=()):
    """One CSV run with its rows sorted by compute (stable, so a repeated compute is still an error
    naming its line), as refit() sorts its records."""
    order = sorted(range(len(cols[0])), key=lambda i: cols[0][i])
    notes = list(notes)
    if order != list(range(len(order))):
        label = run if seed is None else f"{run}/seed{seed}"
        notes.append(f"{source}: the rows of '{label}' were not in compute order; sorted by compute")
    c, y, e, where = ([col[i] for i in order] for col in cols)
    return _run(run, seed, c, y, np.array(e), source, "compute", where, ("compute", "pass_rate"), None, notes)


def load_inputs(paths, axis="flops"):
    """Runs from any mix of workdirs (searched recursively), metrics.jsonl files, event dirs and CSVs."""
    runs = []
    for p in paths:
        hits = files.glob(p) if glob.has_magic(p) else [p]
        if not hits:
            raise ScalingDataError(f"{p}: no such file or directory")
        for h in hits:
            runs.extend(_load_one(h, axis))
    names = [r.name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ScalingDataError(f"the same run appears twice: {dup} (two workdirs with one recipe and seed?)")
    return runs


def _in_warmstart(found, root):
    """A `warmstart` directory below the searched root: a sweep's shared warm start (launch/sweep.py),
    the base model every run starts from, not a run to fit. Named explicitly, it still loads."""
    rel = os.path.relpath(str(found), str(root)) if "://" not in str(root) else str(found)[len(str(root)):]
    return "warmstart" in rel.strip("/").split("/")[:-1]


def _is_sweep(d):
    """launch/sweep.py's record marks its directory: sweep.json, or sweep_NAME.json for a sweep run
    only with --name (notebooks/results/sizes/sm_lr)."""
    return files.isfile(files.join(d, "sweep.json")) or bool(files.glob(files.join(d, "sweep_*.json")))


def _nested_sweeps(found, root):
    """Directories strictly below the searched root that hold a sweep record: another sweep's runs (a
    study nested in a results folder, like notebooks/results/extension), fitted only when named."""
    below = set()  # every directory between the root and a run, each looked at once (a listing on gs://)
    for d in {files.dirname(f) for f in found}:
        rel = os.path.relpath(str(d), str(root)) if "://" not in str(root) else str(d)[len(str(root)):].strip("/")
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        below.update(files.join(root, *parts[:k]) for k in range(1, len(parts)))
    return {sub for sub in below if _is_sweep(sub)}


def _outside(f, nested):
    return not any(str(f).startswith(str(n).rstrip("/") + "/") for n in nested)


def _load_one(path, axis):
    if files.isfile(path):
        if path.endswith(".csv"):
            return load_csv(path)
        if path.endswith(".jsonl"):
            return load_jsonl(path, axis)
        if "tfevents" in os.path.basename(path):
            return load_tensorboard(os.path.dirname(path) or ".", axis)
        raise ScalingDataError(f"{path}: unknown input type (expected .jsonl, .csv, a workdir or event files)")
    if not files.isdir(path):
        raise ScalingDataError(f"{path}: no such file or directory")
    if files.isfile(files.join(path, "metrics.jsonl")):
        return load_jsonl(files.join(path, "metrics.jsonl"), axis)
    if files.glob(files.join(path, "*tfevents*")):
        return load_tensorboard(path, axis)
    found = [f for f in files.glob(files.join(path, "**", "metrics.jsonl")) if not _in_warmstart(f, path)]
    nested = _nested_sweeps(found, path)
    found = [f for f in found if _outside(f, nested)]
    if found:
        return [r for f in found for r in load_jsonl(f, axis)]
    events = sorted({files.dirname(f) for f in files.glob(files.join(path, "**", "*tfevents*"))
                     if not _in_warmstart(f, path)})
    nested = _nested_sweeps([files.join(e, "x") for e in events], path)
    events = [e for e in events if _outside(files.join(e, "x"), nested)]
    if events:
        return [r for d in events for r in load_tensorboard(d, axis)]
    raise ScalingDataError(f"{path}: no metrics.jsonl, event files or CSV found under it")


def group_runs(runs):
    """{recipe: [runs]} in first-seen order: the seeds of one configuration fitted together."""
    out = {}
    for r in runs:
        out.setdefault(r.recipe, []).append(r)
    return out
