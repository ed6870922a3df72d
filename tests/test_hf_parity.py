"""Parity with transformers (torch, float32, eager attention): tiny random Llama-3 (with
Llama-3.1 rope scaling) and Llama-4 (MoE + shared expert, NoPE layers, chunked attention with
a chunk shorter than the sequence, qk norm, temperature tuning) checkpoints are imported with
hf_io, logits compared; export -> transformers round trip; KV-cache decode on the MoE model."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rl_scaling import sharding  # noqa: E402
from rl_scaling.policy import hf_export, hf_io  # noqa: E402
from rl_scaling.policy import model as M  # noqa: E402

ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
T = 11  # longer than the chunk (4) and past floor_scale (4), so chunking and temperature tuning act
TOL = 1e-4


def _randomize(model, seed):
    """HF's init (std 0.02) gives near-zero logits; larger weights make the test sensitive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                std = 0.3 if ("experts" in name or "router" in name) else 0.15
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.eval()


def _hf_logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(toks))).logits.numpy()


def _mesh():
    if len(jax.devices()) >= 8:
        return sharding.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    return sharding.make_mesh(devices=jax.devices()[:1])


@jax.jit(static_argnums=0)
def _forward(cfg, params, toks):
    mask = jnp.ones(toks.shape, bool)
    return M.Decoder(cfg).apply({"params": params}, toks, M.positions_from_mask(mask), mask)[0]


def _ours(cfg, params, toks, mesh):
    with jax.set_mesh(mesh):
        return np.asarray(_forward(cfg, params, jnp.asarray(toks)))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_parameters=dict(ROPE), attn_implementation="eager")
    model = _randomize(transformers.LlamaForCausalLM(cfg), 0)
    path = str(tmp_path_factory.mktemp("llama3"))
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    cfg = transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        no_rope_layer_interval=2, attention_chunk_size=4, use_qk_norm=True, attn_temperature_tuning=True,
        floor_scale=4, attn_scale=0.1, rope_parameters=dict(ROPE), attn_implementation="eager")
    model = _randomize(transformers.Llama4ForCausalLM(cfg), 1)
    path = str(tmp_path_factory.mktemp("llama4"))
    model.save_pretrained(path, max_shard_size="40KB")  # sharded: exercises the index json
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return model, path


TOKS = np.random.RandomState(0).randint(0, 96, (2, T))


def test_llama3_parity(llama3):
    model, path = llama3
    cfg = hf_io.config_from_hf(path)
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.num_experts == 0
    mesh = _mesh()
    params = hf_io.load_hf_checkpoint(path, cfg, mesh)
    diff = np.abs(_ours(cfg, params, TOKS, mesh) - _hf_logits(model, TOKS)).max()
    print(f"llama3 max abs diff {diff:.2e}")
    assert diff <= TOL


def test_llama4_parity_and_decode(llama4):
    model, path = llama4
    cfg = hf_io.config_from_hf(path)
    assert (cfg.num_experts, cfg.nope_layer_interval, cfg.attention_chunk_size, cfg.use_qk_norm) == (4, 2, 4, True)
    mesh = _mesh()
    params = hf_io.load_hf_checkpoint(path, cfg, mesh)
    assert params["layers"]["moe"]["wi_gate"].shape == (4, 4, 32, 16)
    if len(jax.devices()) >= 8:  # loaded straight into its sharding: [L, E/expert, D/fsdp, F/tensor]
        assert params["layers"]["moe"]["wi_gate"].sharding.spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
    ref = _hf_logits(model, TOKS)
    full = _ours(cfg, params, TOKS, mesh)
    diff = np.abs(full - ref).max()
    print(f"llama4 max abs diff {diff:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert diff <= TOL

    # KV-cache decode (prefill 5, then one token at a time) equals the full recompute.
    params = jax.device_get(params)
    dec = M.Decoder(cfg)
    pos = lambda t, c: c["index"][:, None] + jnp.arange(t.shape[1])  # noqa: E731
    step = jax.jit(lambda p, t, c: dec.apply({"params": p}, t, pos(t, c), jnp.ones(t.shape, bool), c))
    cache = M.init_cache(cfg, 2, 16)
    lg, cache = step(params, jnp.asarray(TOKS[:, :5]), cache)
    outs = [lg]
    for t in range(5, T):
        lg, cache = step(params, jnp.asarray(TOKS[:, t:t + 1]), cache)
        outs.append(lg)
    inc = np.asarray(jnp.concatenate(outs, 1))
    print(f"llama4 decode vs recompute {np.abs(inc - full).max():.2e}, vs HF {np.abs(inc - ref).max():.2e}")
    assert np.abs(inc - full).max() <= 1e-5
    assert np.abs(inc - ref).max() <= TOL


@pytest.mark.parametrize("which", ["llama3", "llama4"])
def test_export_round_trip(which, request, tmp_path):
    model, path = request.getfixturevalue(which)
    cfg = hf_io.config_from_hf(path)
    params = hf_io.load_hf_checkpoint(path, cfg)
    hf_export.save_hf_checkpoint(params, cfg, str(tmp_path), max_shard_bytes=30_000 if which == "llama4" else 5 << 30)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(back) is type(model)
    want = dict(model.state_dict())
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k].numpy(), err_msg=k)
    diff = np.abs(_hf_logits(back, TOKS) - _hf_logits(model, TOKS)).max()
    assert diff == 0.0
    assert hf_io.config_from_hf(str(tmp_path)) == cfg


def test_multimodal_llama4_layout(llama4, tmp_path):
    """Llama4ForConditionalGeneration checkpoints nest the text config and prefix the text
    weights with "language_model."; vision tensors are ignored."""
    _, path = llama4
    cfg = hf_io.config_from_hf(path)
    params = hf_io.load_hf_checkpoint(path, cfg)
    src = hf_io._SafetensorsDir(path)
    tensors = {"language_model." + k: src[k] for k in src.keys()}
    tensors["vision_model.patch_embedding.linear.weight"] = np.ones((4, 4), np.float32)
    hf_export._write_safetensors(str(tmp_path / "model.safetensors"), {k: (lambda v=v: v) for k, v in tensors.items()},
                             {k: (v.dtype, v.shape) for k, v in tensors.items()})
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": text}, f)
    assert hf_io.config_from_hf(str(tmp_path)) == cfg
    again = hf_io.load_hf_checkpoint(str(tmp_path))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_checkpoint_loads(llama3, tmp_path):
    model, path = llama3
    cfg = hf_io.config_from_hf(path)
    params = hf_io.load_hf_checkpoint(path, cfg)
    hf_export.save_hf_checkpoint(params, cfg, str(tmp_path), dtype="bfloat16")
    cfg16 = hf_io.config_from_hf(str(tmp_path), param_dtype="bfloat16")
    p16 = hf_io.load_hf_checkpoint(str(tmp_path), cfg16)
    assert p16["embed"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(p16["embed"], np.float32), np.asarray(params["embed"]), rtol=1e-2)


def test_unsupported_configs_fail_clearly(llama4, tmp_path):
    _, path = llama4
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, no_rope_layers=[1, 0, 0, 1])))
    with pytest.raises(NotImplementedError, match="no_rope_layers"):
        hf_io.config_from_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, moe_layers=[1, 3])))
    with pytest.raises(NotImplementedError, match="all-MoE"):
        hf_io.config_from_hf(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        hf_io.load_hf_checkpoint(str(tmp_path), hf_io.config_from_hf(path))
