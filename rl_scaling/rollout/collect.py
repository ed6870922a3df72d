"""Synchronous rollouts: sample G completions per prompt, score them, pack a train batch."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from rl_scaling import data, distributed, sharding
from rl_scaling.rl import filters
from rl_scaling.rollout import sampler


def generate(params, gen_cfg, task, problems, samples_per_prompt, rng, *, max_prompt_len, max_new_tokens,
             temperature, interrupt=None, cache_segments=sampler.CACHE_SEGMENTS, record_routing=False):
    """Sample `samples_per_prompt` completions for each problem; returns host arrays [P*G, ...].
    Each prompt is prefilled once and its KV cache shared by its G samples. record_routing: the
    experts of every token too (MoE routing replay, out.routing_BSLK)."""
    tok, G = task.tokenizer, samples_per_prompt
    group_tokens, group_mask = data.encode_prompts(tok, [p.prompt for p in problems], max_prompt_len)
    prompt_tokens, prompt_mask = np.repeat(group_tokens, G, 0), np.repeat(group_mask, G, 0)
    kwargs = {}
    if interrupt is not None:  # (think_budget_B, phrase token ids, answer budget)
        kwargs = dict(think_budget_B=interrupt[0], interrupt_tokens=interrupt[1], answer_budget=interrupt[2],
                      think_end_id=tok.think_end_id)
    # Params on several devices: rows split over the data axes (each process feeds its own) and
    # the sampler traced under the mesh; every process gets all results. The shared prefill
    # needs the prompts themselves to split over the same axes.
    mesh = distributed.row_mesh(params, len(problems) * G)
    group = G if mesh is None or len(problems) % _row_shards(mesh) == 0 else 1
    fed = (group_tokens, group_mask) if group > 1 else (prompt_tokens, prompt_mask)
    dev_tokens, dev_mask, dev_rng, kwargs = distributed.shard_rows((*fed, rng, kwargs), mesh)
    with sharding.tracing_mesh(mesh):
        out = sampler.sample(params, dev_tokens, dev_mask, dev_rng, cfg=gen_cfg, max_new_tokens=max_new_tokens,
                             temperature=temperature, stop_tokens=(tok.eos_id,), pad_id=tok.pad_id,
                             group_size=group, cache_segments=cache_segments, record_routing=record_routing,
                             **kwargs)
    out = distributed.to_host(out)
    responses = [tok.decode(row[:n]) for row, n in zip(out.tokens_BT, out.lengths_B)]
    rewards = np.array([task.reward(r, problems[i // G]) for i, r in enumerate(responses)], np.float32)
    return prompt_tokens, prompt_mask, out, responses, rewards


def _row_shards(mesh) -> int:
    spec = sharding.batch_sharding(mesh, 1).spec[0]
    return int(np.prod([mesh.shape[a] for a in (spec if isinstance(spec, tuple) else (spec,)) if a]))


def rl_batch(prompt_tokens, prompt_mask, out, rewards, P, G):
    """Pack prompts + completions into the [P*G, L] arrays (and [P, G] rewards) `rl_step` takes."""
    completion_mask = np.arange(out.tokens_BT.shape[1])[None, :] < out.lengths_B[:, None]
    tokens, token_mask = data.pack_sequences(prompt_tokens, prompt_mask, out.tokens_BT, completion_mask)
    pad = np.zeros_like(prompt_mask, np.float32)
    loss_mask = np.concatenate([pad, (completion_mask & ~out.forced_BT).astype(np.float32)], axis=1)
    old_logp = np.concatenate([pad, np.where(completion_mask, out.logprobs_BT, 0.0)], axis=1).astype(np.float32)
    batch = {
        "tokens": tokens,
        "token_mask": token_mask,
        "loss_mask": loss_mask,
        "old_logp": old_logp,
        "rewards": rewards.reshape(P, G),
    }
    if out.routing_BSLK is not None and np.size(out.routing_BSLK):  # the generator's experts, for routing replay
        batch["routing"] = np.asarray(out.routing_BSLK, np.int32)
    return batch


class StepRollouts(NamedTuple):
    prompt_tokens: np.ndarray  # [P*G, max_prompt_len]
    prompt_mask: np.ndarray
    out: sampler.Samples  # host arrays, P*G rows
    rewards: np.ndarray  # [P*G] training reward (length control applied)
    correct: np.ndarray  # [P*G] 1.0 where the verifier's reward is positive (pass rate, NPR)
    problems: list | None  # [P]; None from the pipeline
    metrics: dict
    generated: tuple  # (prompt lengths, completion lengths) of every sequence sampled: compute
    dropped: tuple = ((), ())  # the same, of sequences generated but not trained on (the pipeline's stale groups)


def sync_rollouts(params, gen_cfg, task, stream, P, G, rng, *, length, dynamic_rounds=0, **gen_kw) -> StepRollouts:
    """One step's P prompt groups from the stream, with length control (length_control.LengthControl).

    dynamic_rounds > 0 is DAPO's dynamic sampling: groups whose samples all got the same
    outcome are set aside and up to `dynamic_rounds` more batches of P prompts are generated
    until P mixed groups are collected; if they are not, the step is filled up with set-aside
    groups (logged as rollout/ds_padded_groups; they get zero advantage). Every generated
    sequence counts in `generated` (training compute).
    """
    rounds, chosen, spare, generated = [], [], [], ([], [])
    for r in range(1 + max(dynamic_rounds, 0)):
        problems = next(stream)
        key = rng if r == 0 else jax.random.fold_in(rng, r)
        interrupt = length.interrupt_args(key, P * G)
        prompt_tokens, prompt_mask, out, _, raw = generate(params, gen_cfg, task, problems, G, key,
                                                           interrupt=interrupt, **gen_kw)
        correct = (raw > 0).astype(np.float32)
        rewards = length.shape_rewards(raw, out.lengths_B)
        rounds.append((prompt_tokens, prompt_mask, out, rewards, correct, problems))
        generated[0].append(prompt_mask.sum(1))
        generated[1].append(np.asarray(out.lengths_B))
        if dynamic_rounds <= 0:
            chosen = [(0, p) for p in range(P)]
            break
        mixed = filters.mixed_groups(correct.reshape(P, G))
        chosen += [(r, p) for p in range(P) if mixed[p]][: P - len(chosen)]
        spare += [(r, p) for p in range(P) if not mixed[p]]
        if len(chosen) == P:
            break
    padded = P - len(chosen)
    chosen += spare[::-1][:padded]  # newest first
    rows = np.concatenate([np.arange(p * G, (p + 1) * G) + r * P * G for r, p in chosen])

    def take(i):
        return np.concatenate([np.asarray(x[i]) for x in rounds])[rows]

    out = sampler.Samples(*(None if rounds[0][2][f] is None else np.concatenate([np.asarray(x[2][f]) for x in rounds])[rows]
                            for f in range(len(sampler.Samples._fields))))
    problems = [rounds[r][5][p] for r, p in chosen]
    metrics = {}
    if dynamic_rounds > 0:
        metrics = {"rollout/ds_rounds": float(len(rounds)), "rollout/ds_padded_groups": float(padded),
                   "rollout/ds_generated_groups": float(len(rounds) * P)}
    return StepRollouts(take(0), take(1), out, take(3), take(4), problems, metrics,
                        (np.concatenate(generated[0]), np.concatenate(generated[1])))
