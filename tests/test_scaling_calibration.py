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
