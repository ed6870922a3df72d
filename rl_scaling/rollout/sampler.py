"""A jitted KV-cache sampler that returns per-token log-probs.

The log-prob of each sampled token is read off the same float32 logits the token was
drawn from (after temperature), so the trainer's importance ratio pi_train/pi_gen is
exact when both sides use float32 logits.

Decoding is inside one jit: prefill the (left-padded) prompts, then one token per step for
every row, stopping early when all rows are done. The steps run as a few `lax.while_loop`
segments over a KV cache that grows between them (`cache_segments`), so a step's attention
reads the slots written so far rounded up to its segment's end, not the whole budget: with 4
segments ~5/8 of the cache traffic of one full-length loop, the same tokens.

Forced interruption (ScaleRL's length control): when `think_budget_B` is given, a row
that has produced that many tokens without closing its thinking gets
`interrupt_tokens` injected (one per step, teacher-forced, marked in `forced_BT`), then
`answer_budget` more tokens to answer.

Backends: a sampling call is traced inside `decode_backend`, where the optional CPU backend
(policy/cpu_kernels.py) runs the decode steps' attention and matmuls as kernels on XLA:CPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rl_scaling.policy import model as model_lib, moe

try:  # the CPU decode backend (kernels on XLA:CPU); without it every backend decodes with XLA's code
    from rl_scaling.policy import cpu_kernels
except ModuleNotFoundError as e:
    if e.name != "rl_scaling.policy.cpu_kernels":
        raise
    cpu_kernels = None


def decode_backend(cfg: model_lib.ModelConfig, params=None):
    """The context a sampling call traces its prefill and decode steps in: the CPU kernels where
    the backend module is present (`cpu_kernels.decoding`, which lays out `params`' weight panels
    once), else nothing."""
    return contextlib.nullcontext() if cpu_kernels is None else cpu_kernels.decoding(cfg, params)


CACHE_SEGMENTS = 4  # the default; config.rollout.cache_segments
MIN_SEGMENT_STEPS = 16  # shorter segments would save less than their extra compiled loop costs


class Samples(NamedTuple):
    tokens_BT: jax.Array  # generated tokens, pad after the end
    logprobs_BT: jax.Array  # float32 log pi_gen(token), 0 after the end
    forced_BT: jax.Array  # True where a token was injected, not sampled
    lengths_B: jax.Array  # generated tokens, stop token included
    truncated_B: jax.Array  # ran out of budget before a stop token
    interrupted_B: jax.Array  # the thinking budget was hit and the phrase injected
    # record_routing (MoE): each fed token's experts per layer, prompt columns then generated ones
    # ([B, P + T, n_layers, k] int32, aligned with collect.rl_batch's tokens), for routing replay;
    # [B, 0] when not recorded, None from generators that cannot record it (the JetStream engine)
    routing_BSLK: jax.Array | None = None


def categorical(key, logits_BV):
    """jax.random.categorical's draw (the same Gumbel noise, the same token), with the argmax
    as a max then a min over matching indices: XLA:CPU runs the two plain reductions far
    faster than argmax's paired (value, index) one, which otherwise dominates small models'
    decode steps."""
    z_BV = logits_BV + jax.random.gumbel(key, logits_BV.shape, logits_BV.dtype)
    best_B1 = jnp.max(z_BV, axis=-1, keepdims=True)
    index_BV = jax.lax.broadcasted_iota(jnp.int32, z_BV.shape, z_BV.ndim - 1)
    return jnp.min(jnp.where(z_BV == best_B1, index_BV, z_BV.shape[-1]), axis=-1)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "max_new_tokens", "stop_tokens", "pad_id", "interrupt_tokens",
                     "think_end_id", "answer_budget", "group_size", "cache_segments", "record_routing"),
)
def sample(params, prompt_BP, prompt_mask_BP, rng, *, cfg: model_lib.ModelConfig, max_new_tokens: int,
           temperature=1.0, stop_tokens: tuple[int, ...] = (), pad_id: int = 0,
           think_budget_B=None, interrupt_tokens: tuple[int, ...] = (), think_end_id: int = -1,
           answer_budget: int = 0, group_size: int = 1, cache_segments: int = CACHE_SEGMENTS,
           record_routing: bool = False) -> Samples:
    """group_size=G: prompt_BP holds each group's prompt once ([B/G, P]); it is prefilled once
    and its KV cache and last logits repeated for the group's G rows (row b samples from prompt
    b // G), so prefill costs 1/G. Tokens and log-probs are those of G copies of each prompt.
    record_routing (an MoE cfg): also return the experts of every token fed (Samples.routing_BSLK)."""
    with decode_backend(cfg, params):
        return _sample(params, prompt_BP, prompt_mask_BP, rng, cfg, max_new_tokens, temperature, stop_tokens, pad_id,
                       think_budget_B, interrupt_tokens, think_end_id, answer_budget, group_size, cache_segments,
                       record_routing)


def _sample(params, prompt_BP, prompt_mask_BP, rng, cfg, max_new_tokens, temperature, stop_tokens, pad_id,
            think_budget_B, interrupt_tokens, think_end_id, answer_budget, group_size, cache_segments, record_routing):
    decoder = model_lib.Decoder(cfg)
    variables = {"params": model_lib.split_layers(params)}  # once per call: a step never copies a layer out
    record_routing = bool(record_routing and cfg.num_experts)

    def apply(tokens_BT, *args):
        """(logits, cache, routing [B, T, n_layers, k] or None)."""
        if not record_routing:
            return (*decoder.apply(variables, tokens_BT, *args), None)
        (logits, cache), inter = decoder.apply(variables, tokens_BT, *args, mutable="intermediates")
        return logits, cache, moe.routing_of(inter, *tokens_BT.shape)

    n_prompts, P = prompt_BP.shape
    B = n_prompts * group_size
    if cache_segments < 1:
        raise ValueError(f"cache_segments must be >= 1, got {cache_segments}")
    segment_ends = model_lib.even_split_ends(max_new_tokens, cache_segments, MIN_SEGMENT_STEPS)
    cache = model_lib.init_cache(cfg, n_prompts, P + segment_ends[0])
    positions_BP = model_lib.positions_from_mask(prompt_mask_BP)
    logits_BPV, cache, prompt_routing = apply(prompt_BP, positions_BP, prompt_mask_BP, cache)
    last_BV, next_pos_B = logits_BPV[:, -1], positions_BP[:, -1] + 1
    if group_size > 1:
        last_BV, next_pos_B, cache, prompt_routing = jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0),
                                                                  (last_BV, next_pos_B, cache, prompt_routing))

    stop_ids = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    phrase = jnp.asarray(interrupt_tokens or (pad_id,), jnp.int32)
    use_interrupt = think_budget_B is not None and len(interrupt_tokens) > 0
    if think_budget_B is None:
        think_budget_B = jnp.full((B,), max_new_tokens + 1, jnp.int32)

    def cond(carry):
        t, done_B = carry[0], carry[3]
        return (t < max_new_tokens) & ~jnp.all(done_B)

    def body(carry):
        t, cache, logits_BV, done_B, out, rng, pos_B, think_end_B, forced_left_B, answer_left_B = carry
        rng, key = jax.random.split(rng)
        scaled_BV = logits_BV / temperature
        sampled_B = categorical(key, scaled_BV)
        # Forced interruption: start injecting when the thinking budget runs out.
        if use_interrupt:
            start_B = (~done_B) & (think_end_B < 0) & (forced_left_B == 0) & (t >= think_budget_B)
            forced_left_B = jnp.where(start_B, len(interrupt_tokens), forced_left_B)
            forcing_B = forced_left_B > 0
            phrase_idx = len(interrupt_tokens) - forced_left_B
            forced_tok_B = phrase[jnp.clip(phrase_idx, 0, len(interrupt_tokens) - 1)]
            token_B = jnp.where(forcing_B, forced_tok_B, sampled_B)
            forced_left_B = jnp.where(forcing_B, forced_left_B - 1, forced_left_B)
            interrupted_now_B = forcing_B & (forced_left_B == 0)
            answer_left_B = jnp.where(interrupted_now_B, answer_budget, answer_left_B)
        else:
            forcing_B = jnp.zeros((B,), bool)
            token_B = sampled_B
        logprob_B = jnp.take_along_axis(jax.nn.log_softmax(scaled_BV), token_B[:, None], axis=1)[:, 0]
        token_B = jnp.where(done_B, pad_id, token_B)
        logprob_B = jnp.where(done_B | forcing_B, 0.0, logprob_B)
        think_end_B = jnp.where((think_end_B < 0) & (token_B == think_end_id) & ~done_B, t, think_end_B)
        routing_BTLK = out.get("routing")
        out = {
            "tokens": out["tokens"].at[:, t].set(token_B),
            "logprobs": out["logprobs"].at[:, t].set(logprob_B),
            "forced": out["forced"].at[:, t].set(forcing_B & ~done_B),
            "lengths": out["lengths"] + (~done_B).astype(jnp.int32),
        }
        logits_B1V, cache, routing_B1LK = apply(token_B[:, None], pos_B[:, None], ~done_B[:, None], cache)
        if record_routing:  # the experts of token t, fed at this step
            out["routing"] = routing_BTLK.at[:, t].set(routing_B1LK[:, 0])
        stopped_B = jnp.any(token_B[:, None] == stop_ids[None, :], axis=1) & ~forcing_B
        if use_interrupt:
            # After an interruption the answer has its own budget of sampled tokens.
            answering_B = (answer_left_B >= 0) & ~interrupted_now_B & ~done_B
            answer_left_B = jnp.where(answering_B, answer_left_B - 1, answer_left_B)
            stopped_B |= answering_B & (answer_left_B == 0)
            stopped_B |= interrupted_now_B & (answer_budget == 0)
        new_done_B = done_B | stopped_B
        return (t + 1, cache, logits_B1V[:, 0], new_done_B, out, rng, pos_B + 1, think_end_B,
                forced_left_B, answer_left_B)

    out = {
        "tokens": jnp.full((B, max_new_tokens), pad_id, jnp.int32),
        "logprobs": jnp.zeros((B, max_new_tokens), jnp.float32),
        "forced": jnp.zeros((B, max_new_tokens), bool),
        "lengths": jnp.zeros((B,), jnp.int32),
    }
    if record_routing:
        out["routing"] = jnp.zeros((B, max_new_tokens) + prompt_routing.shape[2:], jnp.int32)
    carry = (jnp.int32(0), cache, last_BV, jnp.zeros((B,), bool), out, rng, next_pos_B,
             jnp.full((B,), -1, jnp.int32), jnp.zeros((B,), jnp.int32), jnp.full((B,), -1, jnp.int32))
    for end in segment_ends:  # step t writes slot P + t: a segment ending at `end` needs P + end slots
        carry = (carry[0], model_lib.grow_cache(carry[1], P + end)) + carry[2:]
        carry = jax.lax.while_loop(lambda c, end=end: cond(c) & (c[0] < end), body, carry)
    _, _, _, done_B, out, _, _, _, _, answer_left_B = carry
    interrupted_B = answer_left_B >= 0
    # not recorded: an empty [B, 0] array (every field stays an array for callers that map over them)
    routing = (jnp.concatenate([prompt_routing, out["routing"]], axis=1) if record_routing
               else jnp.zeros((B, 0), jnp.int32))
    return Samples(out["tokens"], out["logprobs"], out["forced"], out["lengths"], ~done_B, interrupted_B, routing)
