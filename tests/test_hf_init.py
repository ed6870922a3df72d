"""Start RL from Hugging Face weights and hand the trained policy back to transformers:
config.init_checkpoint takes a safetensors directory (its config.json checked against the
configured model), launch/convert.py imports it into Orbax params and exports a run's
checkpoint, and transformers' logits on the export equal ours on the checkpoint."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launch import convert  # noqa: E402
from rl_scaling import checkpoint, config as config_lib, sharding, train  # noqa: E402
from rl_scaling.policy import hf_io  # noqa: E402
from rl_scaling.policy import model as M  # noqa: E402
from tests.test_run import ROOT, fast_config, read_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random transformers Llama with the tiny config's shapes (vocab = the char tokenizer's 64)."""
    mc = fast_config().model
    cfg = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.d_model, intermediate_size=mc.mlp_dim,
        num_hidden_layers=mc.n_layers, num_attention_heads=mc.n_heads, num_key_value_heads=mc.n_kv_heads,
        head_dim=mc.head_dim, rope_theta=mc.rope_theta, rms_norm_eps=mc.norm_eps, tie_word_embeddings=False,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)  # HF's init (std 0.02) gives near-zero logits
    path = str(tmp_path_factory.mktemp("hf_llama"))
    model.save_pretrained(path)
    return path


def _logits(cfg, params, toks):
    mask = jnp.ones(toks.shape, bool)
    return np.asarray(M.Decoder(cfg).apply({"params": params}, toks, M.positions_from_mask(mask), mask)[0])


def test_mismatched_architecture_names_the_field(hf_dir):
    cfg = config_lib.model_config(fast_config())
    hf_io.check_architecture(hf_dir, cfg)  # the matching config passes
    import dataclasses
    with pytest.raises(ValueError, match=r"config.json does not match.*\n  model.mlp_dim: config 96, checkpoint 192"):
        hf_io.check_architecture(hf_dir, dataclasses.replace(cfg, mlp_dim=96))


def test_import_writes_orbax_params_equal_to_the_safetensors(hf_dir, tmp_path):
    out = str(tmp_path / "params")
    convert.main(["import", hf_dir, out])
    cfg = hf_io.config_from_hf(hf_dir)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    want = hf_io.load_hf_checkpoint(hf_dir, cfg, mesh)
    shapes, shardings = hf_io.abstract_params(cfg, mesh)
    got = checkpoint.load_params(out, checkpoint.abstract_like(shapes, shardings))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rl_from_hf_weights_then_export_to_transformers(hf_dir, tmp_path):
    workdir = str(tmp_path / "run")
    result = train.train(fast_config(steps=2, eval_every=2, checkpoint_every=2, log_every=1,
                                     init_checkpoint=hf_dir), workdir)
    assert result["step"] == 2
    assert not os.path.exists(os.path.join(workdir, "warmstart"))  # started from the HF weights
    assert [r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r] == [1, 2]

    out = str(tmp_path / "export")
    convert.main(["export", workdir, out])
    params, cfg, step = convert.run_params(workdir)
    assert step == 2
    start = hf_io.load_hf_checkpoint(hf_dir, cfg)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start)))
    assert moved > 0  # two RL updates changed the weights

    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 12))
    with jax.set_mesh(sharding.make_mesh(devices=jax.devices()[:1])):
        ours = _logits(cfg, jax.device_get(params), jnp.asarray(toks))
    hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(toks)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4

    # The eval-and-fit loop takes its step-0 point from the HF weights (no warm start here).
    cmd = [sys.executable, os.path.join(ROOT, "launch", "eval_fit.py"), f"--workdir={workdir}", "--once", "--axis=steps"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(os.path.join(workdir, "eval_fit", "evals.jsonl"))] == [0, 2]
