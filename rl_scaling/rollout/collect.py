"""Synchronous rollouts: sample G completions per prompt, score them, pack a train batch."""

from __future__ import annotations

import jax
import numpy as np

from rl_scaling import data
from rl_scaling.rollout import sampler


def generate(params, gen_cfg, task, problems, samples_per_prompt, rng, *, max_prompt_len, max_new_tokens,
             temperature, interrupt=None):
    """Sample `samples_per_prompt` completions for each problem; returns host arrays [P*G, ...]."""
    tok = task.tokenizer
    prompts = [p.prompt for p in problems for _ in range(samples_per_prompt)]
    prompt_tokens, prompt_mask = data.encode_prompts(tok, prompts, max_prompt_len)
    kwargs = {}
    if interrupt is not None:  # (think_budget_B, phrase token ids, answer budget)
        kwargs = dict(think_budget_B=interrupt[0], interrupt_tokens=interrupt[1], answer_budget=interrupt[2],
                      think_end_id=tok.think_end_id)
    out = sampler.sample(params, prompt_tokens, prompt_mask, rng, cfg=gen_cfg, max_new_tokens=max_new_tokens,
                         temperature=temperature, stop_tokens=(tok.eos_id,), pad_id=tok.pad_id, **kwargs)
    out = jax.device_get(out)
    responses = [tok.decode(row[:n]) for row, n in zip(out.tokens_BT, out.lengths_B)]
    rewards = np.array([task.reward(r, problems[i // samples_per_prompt]) for i, r in enumerate(responses)],
                       np.float32)
    return prompt_tokens, prompt_mask, out, responses, rewards


def rl_batch(prompt_tokens, prompt_mask, out, rewards, P, G):
    """Pack prompts + completions into the [P*G, L] arrays (and [P, G] rewards) `rl_step` takes."""
    completion_mask = np.arange(out.tokens_BT.shape[1])[None, :] < out.lengths_B[:, None]
    tokens, token_mask = data.pack_sequences(prompt_tokens, prompt_mask, out.tokens_BT, completion_mask)
    pad = np.zeros_like(prompt_mask, np.float32)
    loss_mask = np.concatenate([pad, (completion_mask & ~out.forced_BT).astype(np.float32)], axis=1)
    old_logp = np.concatenate([pad, np.where(completion_mask, out.logprobs_BT, 0.0)], axis=1).astype(np.float32)
    return {
        "tokens": tokens,
        "token_mask": token_mask,
        "loss_mask": loss_mask,
        "old_logp": old_logp,
        "rewards": rewards.reshape(P, G),
    }
