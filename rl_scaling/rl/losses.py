"""Policy-gradient losses, aggregations and advantage estimators as pure functions.

Every function works on a batch laid out as P prompts x G samples:
  logp_PGT, old_logp_PGT  log-probs of the completion tokens under the trainer / generator
  mask_PGT                1.0 on tokens that are trained on (sampled completion tokens)
  adv_PG                  one advantage per sample
A new algorithm is a new function in `LOSSES` plus a config value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient


# ---- per-token losses: (logp, old_logp, adv, mask, **hparams) -> loss_PGT ----------------

def cispo(logp, old_logp, adv, mask, *, eps_max=4.0, **_):
    """MiniMax-M1 / ScaleRL: -sg(min(rho, eps_max)) * A * log pi; no lower clip, and
    every token keeps its gradient (the weight is clipped, not the token)."""
    rho = jnp.exp(logp - old_logp)
    return -sg(jnp.minimum(rho, eps_max)) * adv[..., None] * logp


def ppo_clip(logp, old_logp, adv, mask, *, eps_low=0.2, eps_high=0.2, **_):
    """PPO's clipped surrogate (GRPO: symmetric 0.2; DAPO: asymmetric 0.2 / 0.26)."""
    rho = jnp.exp(logp - old_logp)
    a = adv[..., None]
    return -jnp.minimum(rho * a, jnp.clip(rho, 1.0 - eps_low, 1.0 + eps_high) * a)


def gspo(logp, old_logp, adv, mask, *, gspo_eps_low=3e-4, gspo_eps_high=4e-4, **_):
    """GSPO: one ratio per sequence, exp(mean_t log rho), clipped with a small range.
    The per-token value is the sequence loss, so any aggregation weighs it per token."""
    n = jnp.maximum(mask.sum(-1), 1.0)
    log_ratio = ((logp - old_logp) * mask).sum(-1) / n
    s = jnp.exp(log_ratio)
    seq = -jnp.minimum(s * adv, jnp.clip(s, 1.0 - gspo_eps_low, 1.0 + gspo_eps_high) * adv)
    return jnp.broadcast_to(seq[..., None], logp.shape)


def reinforce(logp, old_logp, adv, mask, **_):
    """Vanilla REINFORCE: -A * log pi (on-policy; no importance weight)."""
    return -adv[..., None] * logp


LOSSES = {"cispo": cispo, "ppo_clip": ppo_clip, "gspo": gspo, "reinforce": reinforce}


def clipped(name, logp, old_logp, adv, mask, *, eps_max=4.0, eps_low=0.2, eps_high=0.2,
            gspo_eps_low=3e-4, gspo_eps_high=4e-4, **_):
    """1.0 on the tokens whose importance weight the loss `name` clips: CISPO caps rho at
    eps_max; PPO's surrogate is flat (no gradient) where rho left [1 - eps_low, 1 + eps_high]
    in the direction of the advantage; GSPO the same with the sequence ratio; REINFORCE
    clips nothing."""
    rho = jnp.exp(logp - old_logp)
    a = jnp.broadcast_to(adv[..., None], rho.shape)
    if name == "cispo":
        out = rho > eps_max
    elif name == "ppo_clip":
        out = ((a > 0) & (rho > 1.0 + eps_high)) | ((a < 0) & (rho < 1.0 - eps_low))
    elif name == "gspo":
        s = jnp.exp(((logp - old_logp) * mask).sum(-1, keepdims=True) / jnp.maximum(mask.sum(-1, keepdims=True), 1.0))
        out = ((a > 0) & (s > 1.0 + gspo_eps_high)) | ((a < 0) & (s < 1.0 - gspo_eps_low))
    else:
        out = jnp.zeros(rho.shape, bool)
    return out.astype(jnp.float32) * mask


def kl_k3(logp, ref_logp):
    """Per-token k3 estimate of KL(pi || ref) (Schulman): exp(d) - d - 1 with d = ref - logp;
    non-negative, unbiased for samples drawn from pi. Added as `rl.kl_coef * kl_k3` (off by
    default; the paper drops it). `rl_step` uses the generator's log-probs as ref."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


# ---- aggregation: one registry of per-token weights (mask_PGT, keep_P) -> w_PGT --------
# The aggregated loss is sum(w * loss): linear in the tokens, so it can be split into
# microbatches of whole samples (gradient accumulation, sharding over samples) and summed
# back exactly.

def prompt_weights(mask, keep):
    """ScaleRL: each prompt's token losses summed and divided by that prompt's token
    count, then averaged over the kept prompts."""
    per_prompt = keep / jnp.maximum(mask.sum((1, 2)), 1.0) / jnp.maximum(keep.sum(), 1.0)
    return mask * per_prompt[:, None, None]


def sample_weights(mask, keep):
    """GRPO: mean over each sample's tokens, then over the kept samples."""
    weight = keep[:, None] * (mask.sum(2) > 0)
    per_sample = weight / jnp.maximum(mask.sum(2), 1.0) / jnp.maximum(weight.sum(), 1.0)
    return mask * per_sample[..., None]


def token_weights(mask, keep):
    """Token-level mean over the whole batch (DAPO paper)."""
    m = mask * keep[:, None, None]
    return m / jnp.maximum(m.sum(), 1.0)


AGGREGATIONS = {"prompt": prompt_weights, "sample": sample_weights, "token": token_weights}


def aggregation_weights(name, mask, keep):
    if name not in AGGREGATIONS:
        raise ValueError(f"rl.aggregation must be one of {sorted(AGGREGATIONS)}; got {name!r}")
    return AGGREGATIONS[name](mask, keep)


def aggregate(name, loss, mask, keep):
    """The scalar loss of aggregation `name` over per-token losses [P, G, T]."""
    return (aggregation_weights(name, mask, keep) * loss).sum()


# ---- advantages: rewards_PG -> (adv_PG, keep_P) ----------------------------------------

def zero_variance_keep(rewards):
    """1.0 for prompts whose samples got different rewards (the others carry no signal)."""
    return (rewards.max(1) > rewards.min(1)).astype(jnp.float32)


def advantages(rewards, *, norm="batch", zero_var_filter=True, eps=1e-6):
    """A_i = r_i - mean(r of the prompt), then normalized.

    norm="batch": divided by the std of the advantages of all kept samples (ScaleRL).
    norm="group": divided by each prompt's reward std (GRPO).
    norm="none":  left as is (Dr. GRPO).
    """
    rewards = rewards.astype(jnp.float32)
    keep = zero_variance_keep(rewards) if zero_var_filter else jnp.ones(rewards.shape[0], jnp.float32)
    adv = rewards - rewards.mean(1, keepdims=True)
    if norm == "batch":
        w = jnp.broadcast_to(keep[:, None], adv.shape)
        n = jnp.maximum(w.sum(), 1.0)
        mean = (adv * w).sum() / n
        std = jnp.sqrt(((adv - mean) ** 2 * w).sum() / n)
        adv = adv / (std + eps)
    elif norm == "group":
        adv = adv / (rewards.std(1, keepdims=True) + eps)
    elif norm != "none":
        raise ValueError(f"rl.adv_norm must be one of batch, group, none; got {norm!r}")
    return adv * keep[:, None], keep


ADV_NORMS = ("batch", "group", "none")
