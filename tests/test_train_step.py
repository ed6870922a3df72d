"""The jitted RL step: gradient accumulation is exact; the sharded step equals the
single-device step on 8 fake CPU devices."""

import dataclasses

import jax
import numpy as np
import pytest

from configs import tiny
from rl_scaling import sharding
from rl_scaling.policy import model as model_lib
from rl_scaling.rl import train_step as ts
from tests.conftest import TINY

P, G, L = 8, 4, 12


def random_batch(seed=0, shared_prompts=False):
    """shared_prompts: a group's G rows share their first 5 tokens (its prompt, as
    collect.rl_batch packs them), the first two of them padding in every other group."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 60, size=(P, G, L)).astype(np.int32)
    token_mask = np.ones((P, G, L), bool)
    lengths = rng.integers(1, 7, size=(P, G))
    loss_mask = np.zeros((P, G, L), np.float32)
    for p in range(P):
        for g in range(G):
            loss_mask[p, g, 5:5 + lengths[p, g]] = 1.0
            token_mask[p, g, 5 + lengths[p, g]:] = False
    if shared_prompts:
        tokens[:, :, :5] = tokens[:, :1, :5]
        tokens[::2, :, :2], token_mask[::2, :, :2] = 0, False
    old_logp = np.where(loss_mask > 0, -rng.exponential(2.0, size=(P, G, L)), 0.0).astype(np.float32)
    rewards = rng.integers(0, 2, size=(P, G)).astype(np.float32)
    flat = lambda x: x.reshape(P * G, L)  # noqa: E731
    return {"tokens": flat(tokens), "token_mask": flat(token_mask), "loss_mask": flat(loss_mask),
            "old_logp": flat(old_logp), "rewards": rewards}


def run_step(mesh, rl_overrides=None, seed=0, model_cfg=TINY, prompt_len=0, shared_prompts=False):
    config = tiny.get_config()
    for k, v in (rl_overrides or {}).items():
        config.rl[k] = v
    opt = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(model_cfg, opt, mesh)
    state = ts.init_state(model_cfg, opt, jax.random.key(seed), mesh, state_sh)
    step = ts.jit_step(ts.rl_step, state_sh, mesh, model_cfg=model_cfg, rl_cfg=config.rl, optimizer=opt,
                       prompt_len=prompt_len)
    new_state, metrics = step(state, random_batch(seed, shared_prompts=shared_prompts))
    return jax.device_get(new_state["params"]), jax.device_get(metrics)


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_grad_accumulation_is_exact(mesh1, aggregation):
    base_params, base_m = run_step(mesh1, {"aggregation": aggregation})
    acc_params, acc_m = run_step(mesh1, {"aggregation": aggregation, "grad_accum": 4})
    np.testing.assert_allclose(acc_m["loss"], base_m["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(acc_m["grad_norm"], base_m["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(acc_params), jax.tree.leaves(base_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_logprobs_step_matches(mesh1):
    base_params, base_m = run_step(mesh1)
    ch_params, ch_m = run_step(mesh1, {"logprob_chunk": 4})
    np.testing.assert_allclose(ch_m["loss"], base_m["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(ch_params), jax.tree.leaves(base_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


UNROLLED = dataclasses.replace(TINY, scan_layers=False)


def test_shared_prompt_logprobs_equal_teacher_forcing(tiny_params):
    """Each group's prompt run once into a repeated KV cache: the completions' log-probs and the
    gradient of a weighted sum of them equal the full rows' (left-padded prompts, ragged
    completions); prompt targets read 0."""
    batch = random_batch(3, shared_prompts=True)
    tokens, mask = jax.numpy.asarray(batch["tokens"]), jax.numpy.asarray(batch["token_mask"])
    weight = np.random.default_rng(4).normal(size=(P * G, L - 1)) * batch["loss_mask"][:, 1:]
    full = lambda p: ts.token_logprobs(p, UNROLLED, tokens, mask)  # noqa: E731
    shared = lambda p: ts.shared_prompt_logprobs(p, UNROLLED, tokens, mask, G, 5)  # noqa: E731
    ref, got = np.asarray(full(tiny_params)), np.asarray(shared(tiny_params))
    completion = batch["token_mask"][:, 1:] & (np.arange(1, L) >= 5)
    np.testing.assert_allclose(got[completion], ref[completion], rtol=0, atol=2e-5)
    assert np.all(got[:, :4] == 0.0)
    grads = [jax.grad(lambda p, f=f: jax.numpy.sum(f(p) * weight))(tiny_params) for f in (full, shared)]
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-5)


def test_shared_prompt_causal_blocks_equal_teacher_forcing(tiny_params):
    """Completions long enough to run in several causal blocks (Decoder(query_offset=P)): their
    log-probs and the gradient of a weighted sum still equal the full rows'."""
    rng = np.random.default_rng(6)
    n_prompts, prompt_len, length = 2, 6, 6 + 41
    assert len(model_lib.causal_blocks(length - 1 - prompt_len)) > 1
    prompts = np.repeat(rng.integers(3, 60, size=(n_prompts, 1, prompt_len)), G, axis=1).reshape(-1, prompt_len)
    tokens = np.concatenate([prompts, rng.integers(3, 60, size=(n_prompts * G, length - prompt_len))], 1)
    mask = np.ones_like(tokens, bool)
    mask[:G, :2] = False  # the first prompt left-padded
    tokens, mask = jax.numpy.asarray(np.where(mask, tokens, 0).astype(np.int32)), jax.numpy.asarray(mask)
    weight = rng.normal(size=(n_prompts * G, length - 1)) * (np.arange(1, length) >= prompt_len)
    full = lambda p: ts.token_logprobs(p, UNROLLED, tokens, mask)  # noqa: E731
    shared = lambda p: ts.shared_prompt_logprobs(p, UNROLLED, tokens, mask, G, prompt_len)  # noqa: E731
    ref, got = np.asarray(full(tiny_params)), np.asarray(shared(tiny_params))
    np.testing.assert_allclose(got[:, prompt_len - 1:], ref[:, prompt_len - 1:], rtol=0, atol=2e-5)
    grads = [jax.grad(lambda p, f=f: jax.numpy.sum(f(p) * weight))(tiny_params) for f in (full, shared)]
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-5)


def test_rl_step_with_shared_prompts_equals_full_rows(mesh1):
    """rl_step(prompt_len=5) runs each group's prompt once per microbatch (shares_prompts holds
    here): the same loss and updated params as the step over full rows."""
    rl_cfg = tiny.get_config().rl
    assert ts.shares_prompts(UNROLLED, rl_cfg, P * G // 2, G, 5, mesh1)
    assert not ts.shares_prompts(TINY, rl_cfg, P * G // 2, G, 5, mesh1)  # scanned layers: full rows
    overrides = {"grad_accum": 2}
    full_params, full_m = run_step(mesh1, overrides, model_cfg=UNROLLED, shared_prompts=True)
    shared_params, shared_m = run_step(mesh1, overrides, model_cfg=UNROLLED, prompt_len=5, shared_prompts=True)
    np.testing.assert_allclose(shared_m["loss"], full_m["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(shared_params), jax.tree.leaves(full_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_group_prompt_check_names_the_group_that_differs():
    batch = random_batch(5, shared_prompts=True)
    ts.check_group_prompts(batch, G, 5)  # collect.rl_batch's layout passes
    batch["tokens"][2 * G + 1, 3] += 1  # group 2's second row: another prompt token
    with pytest.raises(ValueError, match=r"prompt group\(s\) \[2\] differ in batch\['tokens'\]"):
        ts.check_group_prompts(batch, G, 5)
    batch = random_batch(5, shared_prompts=True)
    batch["token_mask"][G * 4, 0] = True  # group 4 (left-padded): its first row has a pad made real
    with pytest.raises(ValueError, match=r"\[4\] differ in batch\['token_mask'\]"):
        ts.check_group_prompts(batch, G, 5)


def test_sharded_step_equals_single_device(mesh1):
    assert len(jax.devices()) >= 8, "conftest sets 8 fake CPU devices"
    mesh8 = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=jax.devices()[:8])
    single_params, single_m = run_step(mesh1)
    sharded_params, sharded_m = run_step(mesh8)
    np.testing.assert_allclose(sharded_m["loss"], single_m["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(single_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True])
def test_layers_one_by_one_equal_the_scan(mesh1, remat):
    """scan_layers=False (the tiny config's training path) runs the same stacked params layer by
    layer: the same loss and updated params as the scanned layers."""
    scan_params, scan_m = run_step(mesh1, model_cfg=dataclasses.replace(TINY, remat=remat))
    loop_params, loop_m = run_step(mesh1, model_cfg=dataclasses.replace(TINY, remat=remat, scan_layers=False))
    np.testing.assert_allclose(loop_m["loss"], scan_m["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(loop_params), jax.tree.leaves(scan_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_first_update_moves_the_params():
    """Warm-up: lr/W at the first update (never 0), lr from the W-th update on."""
    import jax.numpy as jnp

    config = tiny.get_config()
    config.optim.weight_decay = 0.0
    for warmup, expected in ((0, 1.0), (1, 1.0), (4, 0.25)):
        config.optim.warmup_steps = warmup
        opt = ts.make_optimizer(config.optim)
        p = {"w": jnp.ones(3)}
        update, _ = opt.update({"w": jnp.full(3, 0.1)}, opt.init(p), p)
        # Adam's first step is -lr * sign(g) (up to eps), scaled by the warm-up
        np.testing.assert_allclose(update["w"], -config.optim.lr * expected, rtol=1e-5)
