"""Held-out pass rate: mean reward over k samples per prompt at the rollout temperature."""

from __future__ import annotations

import jax
import numpy as np

from rl_scaling.rollout import collect, sampler


def prompt_rewards(params, gen_cfg, task, problems, *, samples_per_prompt, batch_size, rng, max_prompt_len,
                   max_new_tokens, temperature=1.0, cache_segments=sampler.CACHE_SEGMENTS) -> np.ndarray:
    """[len(problems), samples_per_prompt] rewards; batches of whole prompts."""
    per_batch = max(batch_size // samples_per_prompt, 1)
    rewards = []
    for i in range(0, len(problems), per_batch):
        chunk = problems[i: i + per_batch]
        chunk = chunk + [chunk[-1]] * (per_batch - len(chunk))  # one shape, one compile
        _, _, _, _, r = collect.generate(params, gen_cfg, task, chunk, samples_per_prompt,
                                         jax.random.fold_in(rng, i), max_prompt_len=max_prompt_len,
                                         max_new_tokens=max_new_tokens, temperature=temperature,
                                         cache_segments=cache_segments)
        rewards.append(np.asarray(r).reshape(per_batch, samples_per_prompt))
    return np.concatenate(rewards)[: len(problems)]


def pass_rate(params, gen_cfg, task, problems, **kw) -> dict:
    """{"pass_rate", "pass_rate_stderr", per-level rates}: `prompt_rewards` averaged."""
    per_prompt = prompt_rewards(params, gen_cfg, task, problems, **kw).mean(1)
    out = {
        "pass_rate": float(per_prompt.mean()),
        "pass_rate_stderr": float(per_prompt.std(ddof=1) / np.sqrt(len(per_prompt))) if len(per_prompt) > 1 else 0.0,
    }
    levels = np.array([getattr(p, "level", 0) for p in problems])
    for lvl in np.unique(levels):
        out[f"pass_rate_level{lvl}"] = float(per_prompt[levels == lvl].mean())
    return out


def from_workdir_config(config):
    """What evaluating a run's checkpoints needs, from its config.json (launch/eval_fit.py,
    launch/eval_noise.py): (mesh, task, generator model config, held-out problems, the abstract
    train state that Orbax restores into)."""
    from rl_scaling import checkpoint, config as config_lib, sharding, tasks
    from rl_scaling.rl import train_step as ts

    mesh = sharding.make_mesh(dict(config.mesh))
    task = tasks.make_task(config.task, config.seed)
    gen_cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    problems = task.eval_problems(config.eval.num_prompts)
    optimizer = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(gen_cfg, optimizer, mesh)
    abstract = checkpoint.abstract_like(
        jax.eval_shape(lambda: ts.init_state(gen_cfg, optimizer, jax.random.key(0), mesh, state_sh)), state_sh)
    return mesh, task, gen_cfg, problems, abstract
