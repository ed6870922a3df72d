"""Measured noise of a comparison: the seed-to-seed spread of whole curves, and the margin on A
it supports (next to the paper's fixed 0.02). The eval-to-eval noise of one checkpoint is
measured by launch/eval_noise.py."""

from __future__ import annotations

import math

import numpy as np

PAPER_MARGIN = 0.02


def plateau(run, tail=0.25):
    """A run's mean pass rate over its evals in the last `tail` of its compute."""
    c, y = np.asarray(run.compute), np.asarray(run.pass_rate)
    return float(y[c >= c.max() * (1 - tail)].mean())


def pooled_sd(values):
    """(sd, df): the within-group standard deviation pooled over the groups ({name: [values]}) with at
    least two values (ddof 1 in each); sd None when none has."""
    ss, df = 0.0, 0
    for v in map(np.asarray, values.values()):
        if v.size >= 2:
            ss += float(((v - v.mean()) ** 2).sum())
            df += v.size - 1
    return (math.sqrt(ss / df) if df else None), df


def seed_spread(groups, tail=0.25):
    """Pooled within-recipe standard deviation (ddof 1) of the seeds' plateaus, over the recipes
    ({name: [io.Run]}) with at least two seeds; sd None when none has."""
    values = {name: [plateau(r, tail) for r in runs] for name, runs in groups.items() if len(runs) >= 2}
    per = {name: {"plateaus": v, "sd": float(np.std(v, ddof=1))} for name, v in values.items()}
    sd, df = pooled_sd(values)
    seeds = [len(r) for r in groups.values() if len(r) >= 2]
    return {"sd": sd, "df": df, "tail": tail, "per_recipe": per, "seeds_per_recipe": min(seeds) if seeds else None}


def margin_from_seeds(sd, n_seeds, z=1.96):
    """Half-width of a ~95% band for the difference of two recipes' n-seed mean plateaus: two
    recipes whose A differ by less are not told apart by this many seeds."""
    return z * sd * math.sqrt(2.0 / n_seeds)


def choose_margin(spec, spread):
    """(margin used, why) for --margin: a number, or 'auto' = the larger of the paper's 0.02 and
    the seeds' margin (the paper's alone when no recipe has two seeds)."""
    if spec != "auto":
        return float(spec), "given"
    if spread["sd"] is None:
        return PAPER_MARGIN, "the paper's (no recipe has two seeds to measure a spread)"
    measured = margin_from_seeds(spread["sd"], spread["seeds_per_recipe"])
    return (measured, "from the seeds") if measured > PAPER_MARGIN else (PAPER_MARGIN, "the paper's (above the seeds')")
