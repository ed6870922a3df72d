"""launch/eval_noise.py: the noise figures against numpy, and the CLI on a short real run."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _load():
    spec = importlib.util.spec_from_file_location("eval_noise", os.path.join(ROOT, "launch", "eval_noise.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


eval_noise = _load()


def test_noise_stats_by_hand():
    r = np.array([[[1, 1], [0, 0]], [[1, 0], [0, 0]], [[1, 1], [1, 0]]], float)  # 3 repeats, 2 prompts, 2 samples
    s = eval_noise.noise_stats(r)
    assert s["pass_rates"] == [0.5, 0.25, 0.75]
    assert s["sd_measured"] == pytest.approx(0.25)
    p = np.array([5 / 6, 1 / 6])  # each prompt over all 6 samples
    assert s["sd_binomial"] == pytest.approx(np.sqrt(np.sum(p * (1 - p) / 2)) / 2)


def test_binomial_prediction_matches_the_spread_of_simulated_evals():
    rng = np.random.default_rng(0)
    p = rng.choice([0.0, 0.02, 0.3, 0.6, 0.97, 1.0], size=256)  # saturated and open prompts, like the task's levels
    rewards = (rng.random((400, 256, 4)) < p[None, :, None]).astype(float)
    s = eval_noise.noise_stats(rewards)
    assert s["sd_measured"] == pytest.approx(s["sd_binomial"], rel=0.12)
    # the naive iid binomial sqrt(m (1 - m) / (n s)) ignores that saturated prompts never vary
    m = s["mean"]
    assert np.sqrt(m * (1 - m) / (256 * 4)) > 1.5 * s["sd_measured"]


def test_cli_evaluates_the_last_checkpoint(tmp_path):
    from test_run import fast_config

    from rl_scaling import train

    train.train(fast_config(steps=2, eval_every=2, checkpoint_every=2), str(tmp_path / "run"))
    out = tmp_path / "noise.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "eval_noise.py"), str(tmp_path / "run"),
                          "--repeats=3", f"--out={out}"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, XLA_FLAGS=""))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    (run,) = got["runs"]
    assert run["step"] == 2 and run["repeats"] == 3 and run["n_prompts"] == 16 and run["samples_per_prompt"] == 2
    assert all(0 <= v <= 1 for v in run["pass_rates"]) and "pooled eval-to-eval sd" in res.stdout


def test_cli_needs_two_repeats(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "eval_noise.py"), str(tmp_path), "--repeats=1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--repeats must be >= 2" in res.stderr
