"""The train state, the optimizer and the jitted steps (RL and supervised warm start).

`rl_step(state, batch) -> (state, metrics)` is a free function, jitted once with
shardings and buffer donation. A batch is P prompts x G samples of full sequences
(left-padded prompt, right-padded completion):
  tokens_PGL      int32   prompt + completion tokens
  token_mask_PGL  bool    real (non-pad) tokens
  loss_mask_PGL   float32 1.0 on sampled completion tokens (forced/injected tokens: 0.0)
  old_logp_PGL    float32 generator log-prob of each token (0 where not sampled)
  rewards_PG      float32
Minibatches (PPO-off-policy-k: k updates per generated batch) run inside via lax.scan
over whole prompts, after advantages are computed on the full batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from rl_scaling import sharding
from rl_scaling.policy import model as model_lib
from rl_scaling.rl import losses


def make_optimizer(opt_cfg) -> optax.GradientTransformation:
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, opt_cfg.lr, max(opt_cfg.warmup_steps, 1)), optax.constant_schedule(opt_cfg.lr)],
        [max(opt_cfg.warmup_steps, 1)],
    )
    return optax.chain(
        optax.clip_by_global_norm(opt_cfg.grad_clip),
        optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay),
    )


def state_shardings(model_cfg, optimizer, mesh):
    """Shardings for {"params", "opt_state", "step"} from the model's logical axis names."""
    boxed = jax.eval_shape(functools.partial(model_lib.init_params, model_cfg), jax.random.key(0))
    param_sh = sharding.tree_shardings(mesh, nn.get_partition_spec(boxed))
    params_shape = nn.unbox(boxed)
    opt_shape = jax.eval_shape(optimizer.init, params_shape)
    # Optimizer moments mirror the parameters; scalars (counts) are replicated.
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, param_sh,
                                   transform_non_params=lambda _: sharding.replicated(mesh))
    return {"params": param_sh, "opt_state": opt_sh, "step": sharding.replicated(mesh)}


def init_state(model_cfg, optimizer, rng, mesh, shardings=None):
    shardings = shardings or state_shardings(model_cfg, optimizer, mesh)

    def init(rng):
        params = nn.unbox(model_lib.init_params(model_cfg, rng))
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    return jax.jit(init, out_shardings=shardings)(rng)


def token_logprobs(params, model_cfg, tokens_BL, token_mask_BL, temperature=1.0):
    """log pi(token_t | tokens_<t) for t >= 1, from float32 logits; shape [B, L-1]."""
    positions = model_lib.positions_from_mask(token_mask_BL)
    logits, _ = model_lib.Decoder(model_cfg).apply(
        {"params": params}, tokens_BL[:, :-1], positions[:, :-1], token_mask_BL[:, :-1]
    )
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp_all, tokens_BL[:, 1:, None], axis=-1)[..., 0]


def _policy_loss(params, mb, *, model_cfg, rl_cfg):
    P, G, L = mb["tokens"].shape
    logp = token_logprobs(
        params, model_cfg, mb["tokens"].reshape(P * G, L), mb["token_mask"].reshape(P * G, L), rl_cfg.temperature
    ).reshape(P, G, L - 1)
    mask = mb["loss_mask"][..., 1:]
    old_logp = mb["old_logp"][..., 1:]
    per_token = losses.LOSSES[rl_cfg.loss](logp, old_logp, mb["adv"], mask, **loss_hparams(rl_cfg))
    if rl_cfg.kl_coef:  # k3 estimator against the generator policy (off by default)
        log_r = old_logp - logp
        per_token = per_token + rl_cfg.kl_coef * (jnp.exp(log_r) - log_r - 1.0)
    loss = losses.AGGREGATIONS[rl_cfg.aggregation](per_token, mask, mb["keep"])
    n_tok = jnp.maximum(mask.sum(), 1.0)
    rho = jnp.exp(logp - old_logp)
    stats = {
        "rho_abs_dev": (jnp.abs(rho - 1.0) * mask).sum() / n_tok,
        "rho_max": jnp.max(jnp.where(mask > 0, rho, 0.0)),
        "is_capped_frac": ((rho > rl_cfg.eps_max) * mask).sum() / n_tok,
        "neg_logp": -(logp * mask).sum() / n_tok,
    }
    return loss, stats


def rl_step(state, batch, *, model_cfg, rl_cfg, optimizer):
    adv, keep = losses.advantages(batch["rewards"], norm=rl_cfg.adv_norm, zero_var_filter=rl_cfg.zero_var_filter)
    data = {k: batch[k] for k in ("tokens", "token_mask", "loss_mask", "old_logp")}
    data["adv"], data["keep"] = adv, keep
    M = rl_cfg.num_minibatches
    minibatches = jax.tree.map(lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), data)
    grad_fn = jax.value_and_grad(functools.partial(_policy_loss, model_cfg=model_cfg, rl_cfg=rl_cfg), has_aux=True)

    def update(carry, mb):
        params, opt_state = carry
        (loss, stats), grads = grad_fn(params, mb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        stats = dict(stats, loss=loss, grad_norm=optax.global_norm(grads))
        return (params, opt_state), stats

    (params, opt_state), stats = jax.lax.scan(update, (state["params"], state["opt_state"]), minibatches)
    metrics = {k: v.mean() for k, v in stats.items()}
    metrics["rho_abs_dev_first_mb"] = stats["rho_abs_dev"][0]  # generator/trainer mismatch, before any update
    metrics["keep_frac"] = keep.mean()
    metrics["reward_mean"] = batch["rewards"].mean()
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
    return new_state, metrics


def sft_step(state, batch, *, model_cfg, optimizer):
    """Cross-entropy on the completion tokens of reference solutions (warm start)."""

    def loss_fn(params):
        logp = token_logprobs(params, model_cfg, batch["tokens"], batch["token_mask"])
        mask = batch["loss_mask"][:, 1:]
        return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss}


def jit_step(step_fn, state_sh, mesh, **static):
    """jit with the state's shardings, the batch split over the data axes along its
    leading (prompt) axis, and the old state donated."""
    return jax.jit(
        functools.partial(step_fn, **static),
        in_shardings=(state_sh, sharding.batch_sharding(mesh, 1)),
        out_shardings=(state_sh, sharding.replicated(mesh)),
        donate_argnums=0,
    )


def loss_hparams(rl_cfg) -> dict:
    return {k: rl_cfg[k] for k in ("eps_max", "eps_low", "eps_high", "gspo_eps_low", "gspo_eps_high")}
