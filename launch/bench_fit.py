"""Calibration study and timing of the sigmoid fit on synthetic Table-1 curves.

    python launch/bench_fit.py                      # 200 replicates x 1,000 bootstrap, all rows (~5 min, 2 cores)
    python launch/bench_fit.py --replicates=50 --rows=0,9 --json=/tmp/bench.json

Prints, per Table-1 row: noise-free recovery (A error, B and C_mid relative errors, direct vs grid
residuals), then with Gaussian noise: median |A error|, coverage of the 95% intervals of A, B, C_mid,
the share of replicates flagged 'A not identifiable', and the coverage of the 95% prediction interval of
the last point when fitting only the first half of the window. Then the same prediction-interval coverage
on a paper-like curve (A 0.61, B 1.97) with binomial eval noise (--prompts, linear and log-spaced evals)
and how often each diagnostic flags these clean curves. Then the bootstrap timing.

    python launch/bench_fit.py --only=binomial --replicates=200    # the binomial study alone (~5 min)
"""

from __future__ import annotations

import argparse
import json
import time


from rl_scaling.scaling import calibration as cal


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicates", type=int, default=200)
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--noise", type=float, default=0.01)
    ap.add_argument("--rows", default="all", help="comma-separated Table-1 row indices (0-9) or 'all'")
    ap.add_argument("--r0-mode", choices=("noisy", "exact", "known"), default="noisy",
                    help="noisy: the initial eval is as noisy as the rest and R0 is fixed to it (real runs); "
                         "exact: it is exact but the fit treats it as noisy; known: R0 = 0.3 given to the fit")
    ap.add_argument("--window", choices=("full", "paper"), default="full",
                    help="full: all 40 points; paper: drop compute below 1.5/16 of the largest")
    ap.add_argument("--spacing", choices=("linear", "log"), default="linear")
    ap.add_argument("--grid-inner", choices=("curve_fit", "batched"), default="curve_fit")
    ap.add_argument("--prompts", default="256x4,1000x16,256,1000",
                    help="binomial study: evals as PROMPTSxSAMPLES (samples per prompt, default 1): the tiny "
                         "eval (256x4), the paper's (1000x16), and one sample per prompt (the noisiest reading)")
    ap.add_argument("--only", choices=("all", "table1", "binomial"), default="all")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rows = cal.TABLE1 if a.rows == "all" else tuple(cal.TABLE1[int(i)] for i in a.rows.split(","))
    out = {"settings": vars(a)}
    if a.only in ("all", "table1"):
        _table1(a, rows, out)
    if a.only in ("all", "binomial"):
        _binomial(a, out)
    out["timing"] = cal.bootstrap_timing(a.n_boot)
    print(f"\n== timing == {a.n_boot}-replicate bootstrap of one curve: {out['timing']['bootstrap_s']:.3f} s; "
          f"whole summary (fit, 2 bootstraps, power law, early/late): {out['timing']['full_fit_summary_s']:.3f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _binomial(a, out):
    print(f"\n== paper-like curve (A {cal.PAPER_LIKE[3]}, B {cal.PAPER_LIKE[2]}), binomial noise, {a.replicates} "
          f"replicates x {a.n_boot} bootstrap: 95% PI of the last eval fitted on the first half; flag rates ==")
    out["binomial"] = []
    t0 = time.time()
    for k, spec in enumerate(a.prompts.split(",")):
        prompts, samples = (int(v) for v in (spec.split("x") + ["1"])[:2])
        for spacing in ("linear", "log"):
            r = cal.binomial(prompts, spacing, a.replicates, a.n_boot, samples_per_prompt=samples,
                             seed=a.seed + 10 * k + (spacing == "log"))
            out["binomial"].append(r)
            rates = ", ".join(f"{c} {v:.2f}" for c, v in r["flag_rates"].items() if v) or "none"
            print(f"{prompts:5d} prompts x {samples:2d} {spacing:6s}  PI coverage {r['pi_coverage_last']:.3f}  "
                  f"flagged: {rates}", flush=True)
    print(f"({time.time() - t0:.0f} s)")


def _table1(a, rows, out):
    print("== noise-free curves (R0 = 0.3, 40 points 0.1x-4x C_mid) ==")
    out["noise_free"] = cal.noise_free(rows, a.grid_inner)
    for r in out["noise_free"]:
        print(f"{r['row']:18s} |A err| {r['A_err']:.1e}  B rel {r['B_rel']:.1e}  C_mid rel {r['C_mid_rel']:.1e}  "
              f"SSR direct {r['ssr_direct']:.1e} grid {r['ssr_grid']:.1e}  identifiable {r['identifiable']}")

    print(f"\n== noise sd {a.noise}, {a.replicates} replicates x {a.n_boot} bootstrap, window {a.window}, "
          f"R0 {a.r0_mode} ==")
    print(f"{'row':18s} {'B':>5s} {'med|dA|':>8s} {'covA':>5s} {'covB':>5s} {'covC':>5s} {'hwA':>6s} "
          f"{'flag':>5s} {'f|warn':>6s} {'PIcov':>6s} {'med|last|':>9s} {'ssr d/g':>8s}")
    out["noisy"] = []
    t0 = time.time()
    for k, row in enumerate(rows):
        r = cal.noisy(row, a.replicates, a.n_boot, a.noise, r0_mode=a.r0_mode,
                      c_min=0.0 if a.window == "full" else None, seed=a.seed + k, spacing=a.spacing)
        out["noisy"].append(r)
        print(f"{r['row']:18s} {r['B']:5.2f} {r['median_abs_A_err']:8.4f} {r['coverage_A']:5.2f} "
              f"{r['coverage_B']:5.2f} {r['coverage_C_mid']:5.2f} {r['median_half_width_A']:6.3f} "
              f"{r['flagged']:5.2f} {r['flagged_or_warned']:6.2f} "
              f"{r['pi_coverage_last']:6.2f} {r['median_abs_last_err']:9.4f} {r['max_ssr_direct_over_grid']:8.4f}",
              flush=True)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
