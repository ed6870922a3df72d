"""README's "The law on the tiny task" block is exactly what launch/report.py makes of the shipped data."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_law_block_matches_the_shipped_results():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "report.py")], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    begin, end = "<!-- law-report -->", "<!-- /law-report -->"
    block = readme[readme.index(begin):readme.index(end) + len(end)]
    assert block.strip() == out.stdout.strip(), "README is stale: run `make report`"


def test_a_scored_ceiling_check_reports_its_claims_from_the_scored_file(tmp_path):
    """size_confirmation reads the pre-registration as frozen and, once scored, counts the claims the scored file
    says held (a made-up scored file, not shipped data): here 1 of 3, with the ceiling a lower bound."""
    import json
    import shutil

    from launch import report

    results = os.path.join(ROOT, "notebooks", "results")
    shutil.copy(os.path.join(results, "preregistered_l_lr_fresh.json"), tmp_path)
    check = ("preregistered_l_lr_fresh.json", "scored_fake", "results-x", "cost")
    (line,) = report.size_confirmation(str(tmp_path), *check)
    assert "[0.581, 0.640]" in line and "fitted from 72k samples" in line and "Not scored yet: `make results-x`" in line
    scored = {"held": {"identifiable": False, "ceiling_in_band": True, "not_above_reference": False},
              "A": None, "A_lower_bound": 0.6012, "ci": [0.6012, 1.0], "flags": ["still_rising"]}
    (tmp_path / "scored_fake.json").write_text(json.dumps(scored))
    (line,) = report.size_confirmation(str(tmp_path), *check)
    assert "1 of 3 claims held (A >= 0.601 [0.601, 1.000]; flags still_rising; identifiable failed, " \
           "ceiling_in_band held, not_above_reference failed)" in line


def test_the_size_test_at_one_learning_rate_reports_each_pair_from_the_scored_file(tmp_path):
    """size_one_lr_section states the frozen rule before the runs and, once scored (a made-up scored file, not
    shipped data), each size's plateaus, seed means and which pairs held."""
    import json
    import shutil

    from launch import report

    shutil.copy(os.path.join(ROOT, "notebooks", "results", "preregistered_sizes_lr.json"), tmp_path)
    lines = report.size_one_lr_section(str(tmp_path))
    assert "against l's plateaus there (0.606, 0.606" in lines[1] and lines[1].endswith("Not run yet (~100 min on 2 cores, resumable).")
    scored = {"plateaus": {"s": {"0": 0.55, "1": 0.57}, "m": {"0": 0.58, "1": 0.6}, "l": {"0": 0.6064, "1": 0.6062}},
              "sd": 0.0123, "df": 3, "held": {"m_above_s": False, "l_above_s": True, "l_above_m": False}}
    (tmp_path / "sizes_one_lr.json").write_text(json.dumps(scored))
    lines = report.size_one_lr_section(str(tmp_path))
    assert lines[3:8] == ["| size | plateau per seed | seed mean |", "|---|---|---|", "| s | 0.550, 0.570 | 0.560 |",
                          "| m | 0.580, 0.600 | 0.590 |", "| l | 0.606, 0.606 | 0.606 |"]
    assert lines[-1] == ("Pooled within-size sd 0.0123 (3 df); m above s: not shown; l above s: held; l above m: not shown "
                         "(1 of 3 claims held).")


def test_the_fresh_s_size_test_reports_the_verdict_from_the_scored_file(tmp_path):
    """size_fresh_s_section states l's frozen plateaus before s runs and, once scored (a made-up scored file, not
    shipped data), s's fresh plateaus and the scored verdict, held or not."""
    import json
    import shutil

    from launch import report

    shutil.copy(os.path.join(ROOT, "notebooks", "results", "preregistered_s_lr_fresh.json"), tmp_path)
    (line,) = report.size_fresh_s_section(str(tmp_path))[1:]
    assert "(seeds 0, 1, 2, 3: 0.606, 0.606, 0.617, 0.615)" in line and line.endswith("Not run yet (~30 min on 2 cores, resumable).")
    for held, verdict in ((True, "held."), (False, "not shown.")):
        scored = {"plateaus": {"s": {"2": 0.571, "3": 0.559}, "l": {}}, "sd": 0.0071, "df": 4, "held": {"l_above_s": held},
                  "observed": {"l_above_s": "0.611 - 0.565 = +0.046 (needs > 0.014)"}}
        (tmp_path / "sizes_s_fresh.json").write_text(json.dumps(scored))
        (line,) = report.size_fresh_s_section(str(tmp_path))[1:]
        assert line.endswith("s's fresh plateaus: seed 2 0.571, seed 3 0.559; pooled sd 0.0071 (4 df); "
                             f"l above s: 0.611 - 0.565 = +0.046 (needs > 0.014), {verdict}")
