"""Training compute: model FLOPs and accelerator-seconds.

FLOPs (the standard dense-transformer count, Kaplan et al. 2020, with attention):
  forward, one token at context c:  2 N  +  4 L c n_heads d_head
  generation:                       forward FLOPs for every prompt and generated token
  training:                         3x forward (forward + backward) for every token fed to
                                    the trainer, once per minibatch update
where N = `model.compute_params` (every matmul weight a token touches, LM head included,
embedding lookup excluded; only the routed experts for MoE). Evaluation is not counted:
the law's x axis is training compute.
The pipeline engine prefills a group's prompt once for its G samples (`group_size`), and
groups it generated but dropped as too stale count too: the compute was spent.
Accelerator-seconds: wall-clock of the RL loop x number of devices, XLA compilation left
out (`CompileClock`), so a resumed run's recompiles are not counted again.
"""

from __future__ import annotations

import jax
import numpy as np

from rl_scaling.policy import model as model_lib


def forward_flops(cfg, n_tokens, ctx_sum) -> float:
    """Forward FLOPs of n_tokens tokens whose attention contexts sum to ctx_sum."""
    per_token = 2.0 * model_lib.compute_params(cfg)
    attn = 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    return float(n_tokens * per_token + attn * ctx_sum)


def sequence_flops(cfg, prompt_lens, gen_lens, group_size: int = 1) -> tuple[float, float]:
    """Generation and one training pass over sequences with these prompt/generated lengths.

    group_size=G: the generator prefilled each group's prompt once and shared its KV cache
    across the G samples (the sync sampler and the pipeline engine both do); a group's rows are
    contiguous. group_size=1: every row was prefilled. The training pass counts every row's
    prompt (model FLOPs, the compute axis of the shipped law results), also where the trainer
    runs a group's prompt once (train_step.shared_prompt_logprobs)."""
    prompt_lens, gen_lens = np.asarray(prompt_lens, np.float64), np.asarray(gen_lens, np.float64)
    total = prompt_lens + gen_lens
    # Token at 0-based position i attends to i+1 tokens; n tokens sum to n(n+1)/2.
    ctx_total, ctx_prompt = total * (total + 1) / 2.0, prompt_lens * (prompt_lens + 1) / 2.0
    train = 3.0 * forward_flops(cfg, total.sum(), ctx_total.sum())
    prefilled = prompt_lens[::group_size]
    gen = (forward_flops(cfg, prefilled.sum(), (prefilled * (prefilled + 1) / 2.0).sum())
           + forward_flops(cfg, gen_lens.sum(), (ctx_total - ctx_prompt).sum()))
    return gen, train


class CompileClock:
    """Seconds this process spent tracing, lowering and compiling with XLA (jax.monitoring
    events), so accelerator-seconds leave compilation out: a resumed run recompiles its
    steps, and would otherwise count that time twice."""

    _total = 0.0
    _registered = False

    def __init__(self):
        if not CompileClock._registered:
            jax.monitoring.register_event_duration_secs_listener(CompileClock._listen)
            CompileClock._registered = True
        self._seen = CompileClock._total

    @staticmethod
    def _listen(name, seconds, **_):
        if name.startswith("/jax/core/compile/"):
            CompileClock._total += seconds

    def take(self) -> float:
        """Compile seconds since the last call."""
        now = CompileClock._total
        seconds, self._seen = now - self._seen, now
        return seconds
