"""The calibration study at reduced size (slow). The full one: python launch/bench_fit.py."""

import numpy as np
import pytest

from rl_scaling.scaling import calibration as cal


@pytest.mark.slow
def test_table1_calibration_reduced():
    rows = [cal.noisy(row, replicates=40, n_boot=400, seed=100 + k, grid_checks=3) for k, row in enumerate(cal.TABLE1)]
    ident = [r for r in rows if r["B"] > 1.5]
    cov_a = np.mean([r["coverage_A"] for r in rows])
    cov_pi = np.mean([r["pi_coverage_last"] for r in rows])
    for r in rows:  # shown with -s
        print(f"{r['row']:18s} covA {r['coverage_A']:.2f} PI {r['pi_coverage_last']:.2f} "
              f"med|dA| {r['median_abs_A_err']:.4f} flagged {r['flagged']:.2f}")
    # pooled over 400 fits the binomial noise is ~1.1%; per row (40 fits) it is ~3.5%
    assert 0.88 <= cov_a <= 0.99, cov_a
    assert cov_pi >= 0.88, cov_pi
    assert all(r["coverage_A"] >= 0.8 for r in rows), [(r["row"], r["coverage_A"]) for r in rows]
    assert all(r["median_abs_A_err"] <= 0.012 for r in ident)  # <= 0.008 at 200 replicates (bench)
    assert all(r["flagged"] <= 0.15 for r in ident)
    assert rows[-1]["flagged"] >= 0.85  # B = 1.09: A cannot be pinned down by 4x C_mid (96% at 200 replicates)
    assert rows[-1]["flagged_or_warned"] >= 0.95
    assert all(r["max_ssr_direct_over_grid"] <= 1 + 1e-9 for r in rows)


@pytest.mark.slow
def test_prediction_interval_coverage_with_binomial_eval_noise():
    """Paper-like curve (A 0.61, B 1.97), evals of 256 prompts x 4 samples (the tiny eval) and 1000 x 16
    (the paper's), linear and log-spaced; fit the first half, predict the last eval. The full study:
    python launch/bench_fit.py --only=binomial (200 replicates x 1,000 bootstrap: 95-99% per setting)."""
    rows = [cal.binomial(p, sp, replicates=60, n_boot=400, samples_per_prompt=k, seed=7 + 10 * i + j)
            for i, (p, k) in enumerate(((256, 4), (1000, 16))) for j, sp in enumerate(("linear", "log"))]
    cov = [r["pi_coverage_last"] for r in rows]
    print(cov, [r["flag_rates"] for r in rows])
    # pooled over 240 fits the binomial sd of the coverage is ~1.4%; per setting (60 fits) ~2.8%
    assert 0.90 <= np.mean(cov) <= 0.99, cov
    assert all(0.85 <= v <= 1.0 for v in cov), cov
    for r in rows:  # clean curves: the shape checks rarely fire
        assert r["flag_rates"]["not_sigmoidal"] <= 0.05 and r["flag_rates"]["lack_of_fit"] <= 0.07, r
