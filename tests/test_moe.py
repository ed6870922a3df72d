"""MoE layer: dropless ragged dispatch == dense oracle (values and gradients), the sharded
shard_map path == the single-device path, sown router metrics. (KV-cache decode == recompute
on an MoE model is in test_hf_parity.py, on a model imported from transformers.)"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import linen as nn  # noqa: E402

from rl_scaling import sharding  # noqa: E402
from rl_scaling.policy import model as M  # noqa: E402
from rl_scaling.policy import moe, presets  # noqa: E402

CFG = presets.tiny_moe(vocab_size=64, d_model=32, head_dim=8, mlp_dim=32, moe_mlp_dim=16, n_layers=2)


def _one_device_mesh():
    return sharding.make_mesh(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def params():
    with jax.set_mesh(_one_device_mesh()):
        return jax.device_get(nn.unbox(jax.jit(lambda: M.init_params(CFG, jax.random.key(0)))()))


def _batch(B=4, T=8, seed=1):
    toks = jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)
    mask = jnp.ones((B, T), bool).at[0, :3].set(False)  # one left-padded row
    return toks, M.positions_from_mask(mask), mask


def _apply(cfg, params, toks, pos, mask):
    return _apply_jit(cfg, params, toks, pos, mask)


@jax.jit(static_argnums=0)
def _apply_jit(cfg, params, toks, pos, mask):
    return M.Decoder(cfg).apply({"params": params}, toks, pos, mask, mutable="intermediates")


def _moe_only(cfg, k):
    """A bare MoeMlp (no shared expert) and its params, to compare dispatchers directly."""
    cfg = dataclasses.replace(cfg, num_experts_per_tok=k, shared_expert=False)
    x = jax.random.normal(jax.random.key(3), (3, 5, cfg.d_model))
    with jax.set_mesh(_one_device_mesh()):
        p = nn.unbox(jax.jit(moe.MoeMlp(cfg).init)(jax.random.key(4), x))["params"]
    p = dict(p, router=p["router"] * 5.0)  # sharper routing: more distinct choices
    return cfg, p, x


@pytest.mark.parametrize("k", [1, 2])
def test_ragged_equals_dense_oracle_values_and_grads(k):
    cfg, p, x = _moe_only(CFG, k)

    def f(impl):
        c = dataclasses.replace(cfg, moe_impl=impl)
        return lambda p, x: moe.MoeMlp(c).apply({"params": p}, x)

    def both(p, x):  # one compile: outputs and gradients of both dispatchers
        outs = {}
        for impl in ("ragged", "dense"):
            loss = lambda p, x: jnp.sum(jnp.sin(f(impl)(p, x)))  # noqa: E731
            outs[impl] = (f(impl)(p, x), jax.grad(loss, argnums=(0, 1))(p, x))
        return outs

    outs = jax.jit(both)(p, x)
    (y_r, g_r), (y_d, g_d) = outs["ragged"], outs["dense"]
    np.testing.assert_allclose(y_r, y_d, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_d)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_gate_scales_expert_input_like_hf():
    """y = sum_e expert_e(sigmoid(l_e) x): with one expert and top-1, compare to a hand formula."""
    cfg = dataclasses.replace(CFG, num_experts=1, num_experts_per_tok=1, shared_expert=False)
    _, p, x = _moe_only(cfg, 1)
    y = jax.jit(moe.MoeMlp(cfg).apply)({"params": p}, x)
    g = jax.nn.sigmoid(x @ p["router"])  # [B, T, 1]
    xs = x * g
    want = (nn.silu(xs @ p["wi_gate"][0]) * (xs @ p["wi_up"][0])) @ p["wo"][0]
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)


def test_router_metrics_sown(params):
    (logits, _), inter = _apply(CFG, params, *_batch())
    assert np.isfinite(np.asarray(logits)).all()
    m = moe.router_metrics(inter)
    assert m["expert_load"].shape == (CFG.n_layers, CFG.num_experts)
    np.testing.assert_allclose(m["expert_load"].sum(-1), 1.0, rtol=1e-6)
    assert m["router_aux_loss"].shape == () and float(m["router_aux_loss"]) > 0.0
    assert moe.router_metrics({"intermediates": {}}) == {}


def test_sharded_path_matches_single_device(params):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    toks, pos, mask = _batch()
    (want, _), _ = _apply(CFG, params, toks, pos, mask)  # no mesh: plain ragged path
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(lambda: M.init_params(CFG, jax.random.key(0)))
        shard = sharding.tree_shardings(mesh, nn.get_partition_spec(abstract))
        p = jax.device_put(params, shard)
        fn = jax.jit(lambda p: M.Decoder(CFG).apply({"params": p}, toks, pos, mask)[0])
        assert "shard_map" in str(jax.make_jaxpr(fn)(p))
        got = fn(p)
        # and the legacy `with mesh:` context takes the same route
    with mesh:
        got_legacy = jax.jit(lambda p: M.Decoder(CFG).apply({"params": p}, toks, pos, mask)[0])(p)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got_legacy, want, atol=2e-5, rtol=1e-5)
    assert p["layers"]["moe"]["wi_gate"].sharding.spec[1] == "expert"


def test_bfloat16_runs_and_rejects_bad_impl(params):
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    (logits, _), _ = _apply(cfg, params, *_batch())
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="moe_impl"):
        _apply(dataclasses.replace(CFG, moe_impl="capacity"), params, *_batch())
