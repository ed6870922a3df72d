"""Training compute: model FLOPs and accelerator-seconds.

FLOPs (the standard dense-transformer count, Kaplan et al. 2020, with attention):
  forward, one token at context c:  2 N  +  4 L c n_heads d_head
  generation:                       forward FLOPs for every prompt and generated token
  training:                         3x forward (forward + backward) for every token fed to
                                    the trainer, once per minibatch update
where N = `model.compute_params` (every matmul weight a token touches, LM head included,
embedding lookup excluded; only the routed experts for MoE). Evaluation is not counted:
the law's x axis is training compute.
Accelerator-seconds: wall-clock of the RL loop x number of devices.
"""

from __future__ import annotations

import numpy as np

from rl_scaling.policy import model as model_lib


def sequence_flops(cfg, prompt_lens, gen_lens) -> tuple[float, float]:
    """Generation and one training pass over sequences with these prompt/generated lengths."""
    prompt_lens, gen_lens = np.asarray(prompt_lens), np.asarray(gen_lens)
    total = prompt_lens + gen_lens
    # Token at 0-based position i attends to i+1 tokens; a sequence of n tokens sums to n(n+1)/2.
    ctx_sum = (total * (total + 1) / 2.0).sum()
    n_tokens = total.sum()
    per_token = 2.0 * model_lib.compute_params(cfg)
    attn = 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    forward = n_tokens * per_token + attn * ctx_sum
    return float(forward), float(3.0 * forward)
