"""Long work shows progress: the trainer's ETA line before anything is timed, and the HF import and
export callbacks convert.py draws as bars."""

import jax
import numpy as np
from flax import linen as nn

from rl_scaling import metrics
from rl_scaling.policy import hf_export, hf_io, model as M


def test_eta_before_the_first_timed_step_says_so():
    line = metrics.Progress(total=100, start=0).line(0, {"eval/pass_rate": 0.2})
    assert "nan" not in line and "ETA after the first timed step" in line


def test_hf_export_and_import_report_every_tensor(tmp_path):
    cfg = M.ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32)
    params = nn.unbox(M.init_params(cfg, jax.random.PRNGKey(0)))
    saved, loaded = [], []
    hf_export.save_hf_checkpoint(params, cfg, str(tmp_path), progress=lambda d, t: saved.append((d, t)))
    back = hf_io.load_hf_checkpoint(str(tmp_path), cfg, progress=lambda d, t: loaded.append((d, t)))
    n = saved[-1][1]
    assert [d for d, _ in saved] == list(range(1, n + 1)) and n == 2 + 9 * cfg.n_layers + 1
    assert loaded[-1] == (n, n) and len(loaded) == n
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
    np.testing.assert_allclose(flat(back), flat(params))
