"""Calibration study on synthetic curves drawn from the paper's Table 1 (not data from any run).

Each row gives (C_mid, B, A); the curves have R0 = 0.3 and 40 evals linearly spaced (evals every k
steps) from 0.1x to 4x C_mid, plus the initial eval at compute 0. With noise sd 0.01 (1,000 prompts x 16
samples) we measure how often the 95% intervals cover the truth. `binomial` does the same for the
prediction interval with binomial eval noise (a finite prompt set) and counts the diagnostics' false
alarms on these clean curves. `launch/bench_fit.py` is the CLI; tests run reduced versions.
"""

from __future__ import annotations

import time

import numpy as np

from rl_scaling.scaling import api, diagnostics, fit as fitlib, law, uncertainty as unc
from rl_scaling.scaling.io import Run

# (name, C_mid [GPU-hours], B, A) from Table 1 of the paper
TABLE1 = (
    ("ScaleRL 8B", 2542, 1.92, 0.610),
    ("32k thinking", 11272, 1.89, 0.645),
    ("8 gen/prompt", 2542, 2.44, 0.585),
    ("24 gen/prompt", 3054, 2.22, 0.590),
    ("32 gen/prompt", 2936, 2.07, 0.595),
    ("Scout MoE", 4242, 1.65, 0.710),
    ("batch 512", 2818, 1.77, 0.605),
    ("batch 2048", 10909, 1.70, 0.645),
    ("math+code: math", 2896, 2.05, 0.595),
    ("math+code: code", 1675, 1.09, 0.615),
)
R0 = 0.3
# A paper-like curve for the binomial study: ScaleRL 8B's C_mid and A, B between its 1.92 and the others'
PAPER_LIKE = ("paper-like", 2542, 1.97, 0.610)


def table1_curve(row, n=40, lo=0.1, hi=4.0, spacing="linear"):
    """Compute points (with the initial C = 0 eval first) and the noise-free pass rate of one row."""
    _, cm, B, A = row
    grid = np.linspace(lo, hi, n) if spacing == "linear" else np.geomspace(lo, hi, n)
    c = np.concatenate([[0.0], grid * cm])
    return c, law.sigmoid(c, A, B, cm, R0)


def noise_free(rows=TABLE1, grid_inner="curve_fit"):
    """Recovery of the parameters and direct-versus-grid residuals on exact curves."""
    out = []
    for row in rows:
        name, cm, B, A = row
        c, y = table1_curve(row)
        d = fitlib.fit_direct(c[1:], y[1:], r0=R0)
        g, _ = fitlib.fit_grid(c[1:], y[1:], r0=R0, unit="gpu_hours", inner=grid_inner)
        res = api.fit_arrays(c, y, name=name, c_min=0, unit="gpu_hours", n_boot=200, holdout=None)
        out.append({"row": name, "A_err": abs(d.A - A), "B_rel": abs(d.B / B - 1), "C_mid_rel": abs(d.C_mid / cm - 1),
                    "ssr_direct": d.ssr, "ssr_grid": g.ssr, "identifiable": res.identifiable})
    return out


def noisy(row, replicates=200, n_boot=1000, noise=0.01, r0_mode="noisy", c_min=0.0, seed=0, spacing="linear",
          grid_checks=10):
    """Coverage of A/B/C_mid intervals and of the last-point prediction interval (fit on the first half).

    r0_mode: 'noisy' (the initial eval is as noisy as the others and R0 is fixed to it: real runs),
    'exact' (the initial eval is exactly R0, but the fit does not know that and treats it as noisy),
    'known' (R0 passed to the fit as a known number).
    The first `grid_checks` replicates also run the paper's grid fit to check the direct fit's residuals.
    """
    name, cm, B, A = row
    c, y0 = table1_curve(row, spacing=spacing)
    rng = np.random.default_rng(seed)
    keys = ("A_err", "cov_A", "cov_B", "cov_C", "flag", "warned", "pi_cov", "last_err", "half_A", "ssr_ratio")
    rec = {k: [] for k in keys}
    for i in range(replicates):
        y = y0 + rng.normal(0.0, noise, y0.size)
        if r0_mode != "noisy":
            y[0] = y0[0]
        r0 = R0 if r0_mode == "known" else "measured"
        res = api.fit_arrays(c, y, name=name, c_min=c_min, n_boot=n_boot, seed=seed * 100003 + i, unit="gpu_hours",
                             r0=r0)
        s = res.summary()
        ci = s["ci"]
        rec["A_err"].append(abs(res.fit.A - A))
        rec["cov_A"].append(ci["A"][0] <= A <= ci["A"][1])
        rec["cov_B"].append(ci["B"][0] <= B <= ci["B"][1])
        rec["cov_C"].append(ci["C_mid"][0] <= cm <= ci["C_mid"][1])
        rec["half_A"].append((ci["A"][1] - ci["A"][0]) / 2)
        rec["flag"].append(not res.identifiable)
        rec["warned"].append(not res.identifiable or bool(res.warnings))
        ex = s["extrapolation"]
        rec["pi_cov"].append(ex["last_point"]["covered"])
        rec["last_err"].append(abs(ex["last_point"]["error"]))
        if i < grid_checks:  # the grid fit is slow: a few replicates per row check 'direct never worse'
            g, _ = fitlib.fit_grid(res.c, res.y, r0=res.fit.R0, unit="gpu_hours", inner="batched")
            rec["ssr_ratio"].append(res.fit.ssr / g.ssr)
    return {"row": name, "B": B, "replicates": replicates,
            "median_abs_A_err": float(np.median(rec["A_err"])),
            "coverage_A": float(np.mean(rec["cov_A"])), "coverage_B": float(np.mean(rec["cov_B"])),
            "coverage_C_mid": float(np.mean(rec["cov_C"])), "median_half_width_A": float(np.median(rec["half_A"])),
            "flagged": float(np.mean(rec["flag"])), "flagged_or_warned": float(np.mean(rec["warned"])),
            "pi_coverage_last": float(np.mean(rec["pi_cov"])),
            "median_abs_last_err": float(np.median(rec["last_err"])),
            "max_ssr_direct_over_grid": float(np.max(rec["ssr_ratio"])) if rec["ssr_ratio"] else None}


def binomial(prompts, spacing="linear", replicates=200, n_boot=1000, samples_per_prompt=1, row=PAPER_LIKE,
             seed=0, c_min=0.0, holdout=0.5):
    """Coverage of the 95% prediction interval of the last eval, fitting the evals up to `holdout` of the
    compute, when each eval is the mean of prompts x samples_per_prompt Bernoulli outcomes (the
    initial eval too). Also the share of these clean curves that each diagnostic flags (false alarms).
    """
    name, cm, B, A = row
    c, p = table1_curve(row, spacing=spacing)
    n_eval = prompts * samples_per_prompt
    rng = np.random.default_rng(seed)
    covered, flags = [], {k: 0 for k in diagnostics.FLAG_CODES}
    for i in range(replicates):
        y = rng.binomial(n_eval, p) / n_eval
        run = Run(name=name, recipe=name, seed=None, compute=c, pass_rate=y, source=name, axis="gpu_hours",
                  eval_samples=n_eval)
        res = api.fit_runs([run], c_min=c_min, n_boot=n_boot, seed=seed * 100003 + i, unit="gpu_hours",
                           holdout=holdout)
        covered.append(res.summary()["extrapolation"]["last_point"]["covered"])
        for code in {k for k, _ in res.flags}:
            flags[code] += 1
    return {"row": name, "prompts": prompts, "samples_per_prompt": samples_per_prompt, "spacing": spacing,
            "replicates": replicates, "pi_coverage_last": float(np.mean(covered)),
            "flag_rates": {k: v / replicates for k, v in flags.items()}}


def bootstrap_timing(n_boot=1000, repeats=3):
    """Seconds for one n_boot-replicate bootstrap of one noisy Table-1 curve (best of `repeats`)."""
    c, y0 = table1_curve(TABLE1[0])
    y = y0 + np.random.default_rng(0).normal(0, 0.01, y0.size)
    f = fitlib.fit_direct(c[1:], y[1:], r0=R0)
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        unc.bootstrap(f, c[1:], y[1:], n_boot, rng=1, r0_evals=1)
        best = min(best, time.perf_counter() - t)
    t = time.perf_counter()
    api.fit_arrays(c, y, c_min=0, n_boot=n_boot)
    return {"bootstrap_s": best, "full_fit_summary_s": time.perf_counter() - t, "n_boot": n_boot}
