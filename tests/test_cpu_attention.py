"""The CPU decode-attention kernel (policy/decode_attention.cc) against XLA's attention."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from rl_scaling.policy import cpu_attention
from rl_scaling.policy import model as model_lib
from tests.conftest import TINY

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="the kernel cannot be built on this machine")
H16 = dataclasses.replace(TINY, head_dim=16)  # the kernel takes head dims that are multiples of 16


def _inputs(B, K, G, H, S, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((B, 1, K, G, H), (B, K, S, H), (B, K, S, H)))
    mask = rng.random((B, 1, S)) < 0.7
    mask[0] = True  # every slot valid
    if B > 1:
        mask[1] = False  # none valid: softmax over the lowest float everywhere, uniform in both
    return q, k, v, mask


def _reference(q, k, v, mask):
    return model_lib._attend_cached(q, k, v, mask, jnp.float32)


def _kernel(q, k, v, mask):
    return cpu_attention.decode_attention(q, k, v, mask, _reference)


@needs_kernel
@pytest.mark.parametrize("B,K,G,H,S", [(3, 2, 3, 16, 1), (5, 1, 1, 32, 17), (4, 2, 2, 48, 40), (2, 4, 2, 128, 33),
                                       (9, 2, 4, 16, 80)])
def test_kernel_matches_xla_attention(B, K, G, H, S):
    q, k, v, mask = _inputs(B, K, G, H, S)
    want = jax.jit(_reference)(q, k, v, mask)
    got = jax.jit(_kernel)(q, k, v, mask)
    assert got.shape == want.shape == (B, 1, K, G, H)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@needs_kernel
def test_kernel_gradient_is_xla_attentions():
    q, k, v, mask = _inputs(3, 2, 2, 16, 9)
    w = np.random.default_rng(1).normal(size=(3, 1, 2, 2, 16)).astype(np.float32)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, mask) * w)

    want = jax.grad(functools.partial(loss, _reference), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(functools.partial(loss, _kernel), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_model_decode_uses_kernel_and_matches_full_recompute():
    """The decoder's decode steps run the kernel (its custom call is in the compiled step) and
    reproduce a full forward pass's logits, left-padded prompts included."""
    params = nn.unbox(model_lib.init_params(H16, jax.random.key(3)))
    dec = model_lib.Decoder(H16)
    rng = np.random.default_rng(2)
    B, P, N = 4, 6, 5
    tokens = rng.integers(1, H16.vocab_size, size=(B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    for i in range(B):
        mask[i, :i] = False  # left padding
    pos = model_lib.positions_from_mask(mask)
    full, _ = dec.apply({"params": params}, tokens, pos, mask)
    step = jax.jit(lambda c, t, p, m: dec.apply({"params": params}, t, p, m, c))
    cache = model_lib.init_cache(H16, B, P + N)
    logits, cache = dec.apply({"params": params}, tokens[:, :P], pos[:, :P], mask[:, :P], cache)
    out = [logits]
    for t in range(P, P + N):
        args = (tokens[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1])
        if t == P:
            assert cpu_attention.TARGET in step.lower(cache, *args).compile().as_text()
        logits, cache = step(cache, *args)
        out.append(logits)
    np.testing.assert_allclose(np.concatenate(out, 1)[mask], np.asarray(full)[mask], rtol=2e-5, atol=2e-5)


def test_switch_off_and_build_failure_fall_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "0")
    assert not cpu_attention.available.__wrapped__()
    monkeypatch.delenv(cpu_attention.ENV_SWITCH)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no built kernel in this cache
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    assert not cpu_attention.available.__wrapped__()
    assert "could not be built" in caplog.text and "false exited with 1" in caplog.text
    assert not list((tmp_path / "rl_scaling").glob("*.so"))  # no partial library left behind
