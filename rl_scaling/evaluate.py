"""Held-out pass rate: mean reward over k samples per prompt at the rollout temperature."""

from __future__ import annotations

import jax
import numpy as np

from rl_scaling.rollout import collect


def prompt_rewards(params, gen_cfg, task, problems, *, samples_per_prompt, batch_size, rng, max_prompt_len,
                   max_new_tokens, temperature=1.0) -> np.ndarray:
    """[len(problems), samples_per_prompt] rewards; batches of whole prompts."""
    per_batch = max(batch_size // samples_per_prompt, 1)
    rewards = []
    for i in range(0, len(problems), per_batch):
        chunk = problems[i: i + per_batch]
        chunk = chunk + [chunk[-1]] * (per_batch - len(chunk))  # one shape, one compile
        _, _, _, _, r = collect.generate(params, gen_cfg, task, chunk, samples_per_prompt,
                                         jax.random.fold_in(rng, i), max_prompt_len=max_prompt_len,
                                         max_new_tokens=max_new_tokens, temperature=temperature)
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
