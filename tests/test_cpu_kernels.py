"""The CPU decode backend (policy/cpu_kernels.py: decode_attention.cc, decode_matmul.cc) against XLA's
attention, numpy matmuls, a full recompute and the sampler without the backend."""

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from rl_scaling.policy import cpu_kernels
from rl_scaling.policy import model as model_lib
from rl_scaling.rollout import sampler
from tests.conftest import TINY

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="the kernels cannot be built on this machine")
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
    return cpu_kernels.decode_attention(q, k, v, mask, _reference)


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
def test_model_decode_uses_kernels_and_matches_full_recompute():
    """The decoder's decode steps traced inside the backend's `decoding` context (the sampler's
    seam) run the kernels (their custom calls are in the compiled step, absent without the
    context) and reproduce a full forward pass's logits, left-padded prompts included."""
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
    panels = cpu_kernels.decode_panels(params, H16)
    assert all(set(layer) == {"attn", "mlp"} for layer in panels["layers"]) and "lm_head" in panels
    variables = {"params": model_lib.split_layers(params)}  # as the sampler's

    def step(c, t, p, m, backend=True):
        with cpu_kernels.decoding(H16, params) if backend else contextlib.nullcontext():
            return dec.apply(variables, t, p, m, c)

    cache = model_lib.init_cache(H16, B, P + N)
    logits, cache = dec.apply({"params": params}, tokens[:, :P], pos[:, :P], mask[:, :P], cache)
    out = [logits]
    targets = (cpu_kernels.ATTENTION, cpu_kernels.MATMUL, cpu_kernels.SWIGLU)
    for t in range(P, P + N):
        args = (tokens[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1])
        if t == P:
            hlo = jax.jit(step).lower(cache, *args).compile().as_text()
            assert all(target in hlo for target in targets)
            plain = jax.jit(functools.partial(step, backend=False)).lower(cache, *args).compile().as_text()
            assert not any(target in plain for target in targets)
        logits, cache = jax.jit(step)(cache, *args)
        out.append(logits)
    np.testing.assert_allclose(np.concatenate(out, 1)[mask], np.asarray(full)[mask], rtol=2e-5, atol=2e-5)


def _silu_np(x):
    return x / (1.0 + np.exp(-x.astype(np.float64)))


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 32, 32), (5, 48, 96), (12, 256, 64), (17, 64, 32), (64, 256, 1024),
                                   (256, 32, 64)])
def test_panel_matmul_and_swiglu_match_numpy(M, K, N):
    """Row counts off the 12-row tile (remainders of 4 and 1), several panels, and gate values
    far into both tails of silu (no overflow in its exp)."""
    rng = np.random.default_rng(M * K + N)
    x = rng.normal(size=(M, K)).astype(np.float32)
    w, gate, up = ((rng.normal(size=(K, N)) / np.sqrt(K)).astype(np.float32) for _ in range(3))
    gate[:, 0] *= 300.0  # columns of |x @ gate| up to ~1000
    poison = lambda _: jnp.full((M, N), jnp.nan)  # noqa: E731  (the XLA reference must not be what runs)
    got = jax.jit(lambda x, w: cpu_kernels.matmul(x, cpu_kernels.panels([w[None]], 0), poison))(x, w)
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    want = _silu_np(x.astype(np.float64) @ gate) * (x.astype(np.float64) @ up)
    swiglu = lambda x, g, u: cpu_kernels.swiglu(x, cpu_kernels.panels([g[None], u[None]], 0, interleave=True), poison)  # noqa: E731
    got = jax.jit(swiglu)(x, gate, up)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-5)


@needs_kernel
def test_panel_layout_matches_numpy():
    """The kernel's layout of stacked weights: one layer of several sources' concatenated
    columns, or two sources interleaved 16 columns at a time (as is XLA's reference layout)."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.normal(size=(3, 5, n)).astype(np.float32) for n in (48, 16, 32))
    got = np.asarray(jax.jit(lambda *w: cpu_kernels.panels(w, 1))(a, b, c))
    cat = np.concatenate([a[1], b[1], c[1]], 1)  # [5, 96]
    assert got.shape == (3, 5, 32)
    for p in range(3):
        np.testing.assert_array_equal(got[p], cat[:, 32 * p:32 * (p + 1)])
    got = np.asarray(jax.jit(lambda g, u: cpu_kernels.panels((g, u), 2, interleave=True))(a[:, :, :32], c))
    assert got.shape == (2, 5, 32)
    for p in range(2):
        np.testing.assert_array_equal(got[p], np.concatenate([a[2, :, 16 * p:16 * (p + 1)], c[2, :, 16 * p:16 * (p + 1)]], 1))
    np.testing.assert_array_equal(got, cpu_kernels._panels_reference((a[:, :, :32], c), 2, True))


def _sampler_args(cfg):  # (the same draws as _WITHOUT_BACKEND's)
    params = nn.unbox(model_lib.init_params(cfg, jax.random.key(5)))
    prompts = np.random.default_rng(3).integers(1, cfg.vocab_size, size=(3, 5)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    mask[1, :2] = False
    return (params, prompts, mask, jax.random.key(1)), dict(cfg=cfg, max_new_tokens=20, group_size=2)


@needs_kernel
@pytest.mark.parametrize("max_rows", [cpu_kernels.MAX_PANEL_ROWS, 8])
def test_sampler_with_kernels_samples_the_same_tokens(monkeypatch, max_rows):
    """sampler.sample enters the backend: its compiled decode steps contain the attention and
    matmul kernels' custom calls; tokens equal those of the sampler without the backend module
    (XLA's attention and matmuls, no custom call) and log-probs agree to float32 rounding.
    max_rows 8: the 15-row prefill takes XLA's matmuls beside the panels, the 6-row decode steps
    the kernels."""
    monkeypatch.setattr(cpu_kernels, "MAX_PANEL_ROWS", max_rows)
    args, kw = _sampler_args(H16)
    targets = (cpu_kernels.ATTENTION, cpu_kernels.MATMUL, cpu_kernels.SWIGLU)
    hlo = jax.jit(lambda *a: sampler.sample.__wrapped__(*a, **kw)).lower(*args).compile().as_text()
    assert all(target in hlo for target in targets)
    with_kernels = jax.jit(lambda *a: sampler.sample.__wrapped__(*a, **kw))(*args)  # traced with this max_rows
    monkeypatch.setattr(sampler, "cpu_kernels", None)  # as if policy/cpu_kernels.py were removed
    plain = jax.jit(lambda *a: sampler.sample.__wrapped__(*a, **kw))
    assert not any(target in plain.lower(*args).compile().as_text() for target in targets)
    without = plain(*args)
    np.testing.assert_array_equal(np.asarray(with_kernels.tokens_BT), np.asarray(without.tokens_BT))
    np.testing.assert_allclose(np.asarray(with_kernels.logprobs_BT), np.asarray(without.logprobs_BT), atol=2e-5)


_WITHOUT_BACKEND = """
import json, sys
sys.modules["rl_scaling.policy.cpu_kernels"] = None  # importing it now fails, as if the file were gone
import jax, numpy as np
from flax import linen as nn
from rl_scaling.policy import model as model_lib
from rl_scaling.rollout import sampler
assert sampler.cpu_kernels is None
cfg = model_lib.ModelConfig(**json.loads(sys.argv[1]))
params = nn.unbox(model_lib.init_params(cfg, jax.random.key(5)))
prompts = np.random.default_rng(3).integers(1, cfg.vocab_size, size=(3, 5)).astype(np.int32)
mask = np.ones_like(prompts, bool)
mask[1, :2] = False
out = sampler.sample(params, prompts, mask, jax.random.key(1), cfg=cfg, max_new_tokens=20, group_size=2)
print(json.dumps({"tokens": np.asarray(out.tokens_BT).tolist(), "logprobs": np.asarray(out.logprobs_BT).tolist(),
                  "modules": sorted(m for m, v in sys.modules.items() if m.startswith("rl_scaling") and v is not None)}))
"""


def test_model_and_sampler_work_without_the_backend_module():
    """With policy/cpu_kernels.py unimportable, the model and the sampler import and sample (in a
    fresh process): the same tokens as this process's sampler, log-probs to float32 rounding."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, "-c", _WITHOUT_BACKEND, json.dumps(dataclasses.asdict(H16))], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "rl_scaling.policy.cpu_kernels" not in got["modules"] and "rl_scaling.policy.model" in got["modules"]
    args, kw = _sampler_args(H16)
    want = sampler.sample(*args, **kw)
    np.testing.assert_array_equal(np.asarray(got["tokens"]), np.asarray(want.tokens_BT))
    np.testing.assert_allclose(np.asarray(got["logprobs"], np.float32), np.asarray(want.logprobs_BT), atol=2e-5)


def test_model_source_has_no_cpu_plumbing():
    """The model's modules name no CPU kernel, panel or backend: the seam is the sampler's."""
    import inspect

    from rl_scaling.policy import mlp

    for module in (model_lib, mlp):
        source = inspect.getsource(module)
        assert "panels" not in source and "cpu_kernels" not in source.replace("policy/cpu_kernels.py", "")


def test_switch_off_and_build_failure_fall_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert not cpu_kernels.available.__wrapped__()
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no built kernel in this cache
    monkeypatch.setattr(cpu_kernels, "_cpu_id", lambda: "flags\t\t: fpu avx2 avx512f\n")
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    assert not cpu_kernels.available.__wrapped__()
    assert "could not be built" in caplog.text and "false exited with 1" in caplog.text
    assert not list((tmp_path / "rl_scaling").glob("*.so"))  # no partial library left behind
    caplog.clear()  # a CPU without AVX-512: said in one line, no compiler run
    monkeypatch.setattr(cpu_kernels, "_cpu_id", lambda: "flags\t\t: fpu avx2\nmodel name\t: AMD EPYC\n")
    assert not cpu_kernels.available.__wrapped__()
    assert "this CPU has no AVX-512" in caplog.text and "exited" not in caplog.text
