"""The FP32 LM-head ablation is visible on CPU: with a bfloat16 body, the generator/trainer
mismatch that rl_step logs (mean |rho - 1| on the first minibatch, before any update) is
small when both LM heads run in float32 and tens of times larger when the generator's does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from rl_scaling import config as config_lib, sharding, tasks
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import collect

P, G = 4, 4


def _setup(dtype, train_fp32_head):
    c = tiny.get_config()
    c.model.dtype, c.rl.fp32_lm_head = dtype, train_fp32_head
    c.rollout.prompts_per_step, c.rollout.samples_per_prompt = P, G
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    train_cfg = config_lib.model_config(c, c.rl.fp32_lm_head)
    opt = ts.make_optimizer(c.optim)
    sh = ts.state_shardings(train_cfg, opt, mesh)
    state = ts.init_state(train_cfg, opt, jax.random.key(0), mesh, sh)
    step = ts.jit_step(ts.rl_step, sh, mesh, model_cfg=train_cfg, rl_cfg=c.rl, optimizer=opt)
    return c, state, step


def mismatch(setup, gen_fp32_head):
    """rl_step's rho_abs_dev_first_mb on a batch sampled with the generator's LM head in
    float32 or in the body's dtype (the state is copied: rl_step donates it)."""
    c, state, step = setup
    c = c.copy_and_resolve_references()
    c.rollout.fp32_lm_head = gen_fp32_head
    config_lib.validate(c)
    task = tasks.ArithmeticTask(0)
    gen_cfg = config_lib.model_config(c, c.rollout.fp32_lm_head)
    problems = [task.train_problem(i) for i in range(P)]
    prompt, prompt_mask, out, _, _ = collect.generate(state["params"], gen_cfg, task, problems, G, jax.random.key(1),
                                                      max_prompt_len=16, max_new_tokens=c.rollout.max_new_tokens,
                                                      temperature=1.0)
    rewards = np.tile(np.array([1.0, 0.0, 0.0, 1.0], np.float32), P)  # mixed groups: nothing filtered
    _, metrics = step(jax.tree.map(jnp.copy, state), collect.rl_batch(prompt, prompt_mask, out, rewards, P, G))
    return float(metrics["rho_abs_dev_first_mb"])


def test_fp32_heads_cut_the_mismatch_of_a_bfloat16_body():
    setup = _setup("bfloat16", train_fp32_head=True)
    both_fp32, gen_bf16 = mismatch(setup, True), mismatch(setup, False)
    assert both_fp32 < 3e-4
    assert gen_bf16 > 10 * both_fp32 and gen_bf16 > 5e-4


@pytest.mark.slow
def test_mismatch_across_all_precision_settings():
    assert mismatch(_setup("float32", True), True) < 1e-5  # nothing to mismatch
    both_fp32 = mismatch(_setup("bfloat16", True), True)
    # No FP32 head anywhere: here generator and trainer run the same XLA computations (layer by
    # layer, the residual stream rounded between layers on both sides), so their bfloat16 heads
    # agree too; the mismatch FP32 heads remove comes from heads that differ, as above (on GPUs,
    # from different inference and training kernels).
    assert mismatch(_setup("bfloat16", False), False) < 3e-4
    assert mismatch(_setup("bfloat16", True), False) > 10 * both_fp32
