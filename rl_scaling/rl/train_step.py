"""The train state, the optimizer and the jitted steps (RL and supervised warm start).

`rl_step(state, batch) -> (state, metrics)` is a free function, jitted once with
shardings and buffer donation. A batch is N = P x G samples
(a prompt's G samples contiguous) of full sequences (left-padded prompt, right-padded
completion):
  tokens_NL      int32   prompt + completion tokens
  token_mask_NL  bool    real (non-pad) tokens
  loss_mask_NL   float32 1.0 on sampled completion tokens (forced/injected tokens: 0.0)
  old_logp_NL    float32 generator log-prob of each token (0 where not sampled)
  rewards_PG     float32 (replicated; the per-sample arrays are split over the data axes)
  routing_NLlk   int32   (MoE, rl.routing_replay="r3") the generator's experts of each token in
                 each layer (sampler record_routing), replayed by the trainer
Routing replay (rl.routing_replay; MoE only), after verl/slime/ms-swift's R2 and R3 (NeMo-RL's and
Megatron's router replay is R3): "r3" (rollout routing replay) takes each token's experts from
the generator's record in every trainer forward, hence the backward differentiates the routing
that sampled the token; "r2" (vanilla routing replay) takes them from the trainer's own forward
with the pre-update params (one extra forward per microbatch), so the k updates of
PPO-off-policy-k keep the old policy's routing; with rl.num_minibatches = 1 that is the trainer's
own routing, nothing to replay. Either way the gates are the live router's sigmoids (the router
still learns). Logged: router/replay_disagreement (share of real token-layers where the trainer's
own top-k differs from the replayed or, without replay, the generator's recorded one) and
router/logp_mismatch (mean |log pi_train - log pi_gen| on sampled tokens, first minibatch).
Advantages are computed on the full batch; minibatches (PPO-off-policy-k: k updates per
generated batch) of whole prompts run inside via lax.scan; the aggregation is turned into
per-token weights, so microbatches (gradient accumulation) are exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from rl_scaling import sharding
from rl_scaling.policy import model as model_lib
from rl_scaling.policy import moe as moe_lib
from rl_scaling.rl import losses


def make_optimizer(opt_cfg) -> optax.GradientTransformation:
    # Linear warm-up over `warmup_steps` optimizer updates (not RL steps: PPO-off-policy-k makes
    # k updates a step), lr/W at the first update and lr from the W-th on; 0 means none.
    warmup = max(int(opt_cfg.warmup_steps), 1)
    schedule = lambda count: opt_cfg.lr * jnp.minimum(count + 1, warmup) / warmup  # noqa: E731
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


def target_logprobs(logits_BTV, targets_BT, temperature=1.0):
    """log pi(target) from float32 logits at this temperature."""
    logp_all = jax.nn.log_softmax(logits_BTV / temperature, axis=-1)
    return jnp.take_along_axis(logp_all, targets_BT[..., None], axis=-1)[..., 0]


def token_logprobs(params, model_cfg, tokens_BL, token_mask_BL, temperature=1.0, chunk=0, with_router=False,
                   routing_BLlk=None):
    """log pi(token_t | tokens_<t) for t >= 1, from float32 logits; shape [B, L-1].
    with_router=True also returns the MoE router's sown intermediates (see moe.py).
    routing_BLlk: each token's experts per layer to replay (MoE routing replay), [B, L, n_layers, k].

    With chunk > 0 the LM head and log-softmax run over `chunk` positions at a time under
    jax.checkpoint, so [B, L, V] logits never exist at once (128k-200k vocabularies at
    16k tokens would not fit in HBM)."""
    positions = model_lib.positions_from_mask(token_mask_BL)
    inputs = (tokens_BL[:, :-1], positions[:, :-1], token_mask_BL[:, :-1])
    targets_BT = tokens_BL[:, 1:]
    decoder = model_lib.Decoder(model_cfg)
    # the inputs' routing to replay: every column but the last
    replay = {} if routing_BLlk is None else {"routing": routing_BLlk[:, :-1]}

    def apply(**kw):
        if not with_router:
            return decoder.apply({"params": params}, *inputs, **replay, **kw), {}
        return decoder.apply({"params": params}, *inputs, mutable="intermediates", **replay, **kw)

    T = targets_BT.shape[1]
    if not chunk or T <= chunk:
        (logits, _), inter = apply()
        logp = target_logprobs(logits, targets_BT, temperature)
        return (logp, inter) if with_router else logp
    (hidden_BTD, kernel_DV), inter = apply(return_hidden=True)
    n = -(-T // chunk)
    pad = n * chunk - T
    hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
    targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))

    @jax.checkpoint
    def one_chunk(h_BCD, t_BC):
        return target_logprobs(model_lib.lm_head(h_BCD, kernel_DV, model_cfg), t_BC, temperature)

    h_NBCD = hidden_BTD.reshape(hidden_BTD.shape[0], n, chunk, -1).swapaxes(0, 1)
    t_NBC = targets_BT.reshape(targets_BT.shape[0], n, chunk).swapaxes(0, 1)
    logp_NBC = jax.lax.map(lambda xs: one_chunk(*xs), (h_NBCD, t_NBC))
    logp = logp_NBC.swapaxes(0, 1).reshape(targets_BT.shape)[:, :T]
    return (logp, inter) if with_router else logp


def shared_prompt_logprobs(params, model_cfg, tokens_BL, token_mask_BL, group_size, prompt_len, temperature=1.0):
    """token_logprobs for rows whose first `prompt_len` columns are their group's prompt, the
    same in each of the group's `group_size` contiguous rows (collect.rl_batch packs them so).

    The prompt runs once per group into a KV cache that is repeated for the group's G
    completions, as the sampler prefills it: the prompt's share of the forward and backward
    FLOPs falls to 1/G (at 16 prompt + 64 completion tokens, G = 8: 17% of the update). The
    gradient of the repeat sums the G completions' terms. Log-probs of prompt tokens (targets
    before column prompt_len) are 0: no loss reads them."""
    G, P = group_size, prompt_len
    B, L = tokens_BL.shape
    positions_BL = model_lib.positions_from_mask(token_mask_BL)
    variables = {"params": params}
    cache = model_lib.init_cache(model_cfg, B // G, P)  # the prompt attends over its own P slots
    logits_pPV, cache = model_lib.Decoder(model_cfg).apply(
        variables, tokens_BL[::G, :P], positions_BL[::G, :P], token_mask_BL[::G, :P], cache)
    cache = jax.tree.map(lambda x: jnp.repeat(x, G, axis=0), model_lib.grow_cache(cache, L - 1))
    logits_BCV, _ = model_lib.Decoder(model_cfg, query_offset=P).apply(  # every row's completion starts at slot P
        variables, tokens_BL[:, P:-1], positions_BL[:, P:-1], token_mask_BL[:, P:-1], cache)
    logits_BTV = jnp.concatenate([jnp.repeat(logits_pPV[:, -1:], G, axis=0), logits_BCV], axis=1)
    return jnp.pad(target_logprobs(logits_BTV, tokens_BL[:, P:], temperature), ((0, 0), (P - 1, 0)))


def shares_prompts(model_cfg, rl_cfg, rows: int, group_size: int, prompt_len: int, mesh=None) -> bool:
    """Whether microbatches of `rows` sequences run their prompts once per group: a dense model
    with unrolled layers (the cache path: no scan, no remat), whole groups per microbatch, one
    device (a strided slice of rows split over devices would move them), full-vocabulary logits."""
    return bool(prompt_len > 1 and group_size > 1 and rows % group_size == 0 and not model_cfg.num_experts
                and not model_cfg.scan_layers and not model_cfg.remat and not rl_cfg.logprob_chunk
                and (mesh is None or mesh.size == 1))


def check_group_prompts(batch, group_size: int, prompt_len: int):
    """The contract of rl_step(prompt_len=...) on a host batch: each group's G contiguous rows
    share their first prompt_len tokens and mask. A ValueError names the groups that do not
    (shared_prompt_logprobs would read the first row's prompt for all G)."""
    for key in ("tokens", "token_mask"):
        prompts = np.asarray(batch[key])[:, :prompt_len].reshape(-1, group_size, prompt_len)
        bad = np.flatnonzero((prompts != prompts[:, :1]).any(axis=(1, 2)))
        if bad.size:
            raise ValueError(f"rl_step(prompt_len={prompt_len}): the {group_size} rows of prompt group(s) "
                             f"{bad[:5].tolist()} differ in batch[{key!r}][:, :{prompt_len}]; a group's rows "
                             "must share its prompt (collect.rl_batch packs them so)")


def router_terms(intermediates, mb=None, replay=None) -> dict:
    """Router statistics of one forward pass from the sown MoE intermediates ({} for a dense
    model): the Switch load-balancing loss E * sum_e f_e * P_e averaged over layers, the
    largest per-layer expert load f_e, and the dropped fraction (0: dispatch is dropless); with
    a replayed routing (or else the generator's, mb["routing"]) the share of real token-layers
    where the trainer's own top-k differs from it."""
    m = moe_lib.router_metrics(intermediates)
    if not m:
        return {}
    out = {"router/aux_loss": m["router_aux_loss"], "router/expert_load_max": jnp.max(m["expert_load"]),
           "router/dropped_frac": jnp.zeros((), jnp.float32)}
    ref = replay if replay is not None else (mb or {}).get("routing")
    if ref is not None:
        n, L = mb["tokens"].shape
        own = jax.lax.stop_gradient(moe_lib.routing_of(intermediates, n, L - 1))
        out["router/replay_disagreement"] = moe_lib.replay_disagreement(own, ref[:, :-1], mb["token_mask"][:, :-1])
    return out


REPLAY = ("off", "r2", "r3")


def replay_mode(rl_cfg, model_cfg) -> str:
    """rl.routing_replay for this model ("off" for a dense one); a ValueError names a bad value."""
    mode = rl_cfg.get("routing_replay", "off") if hasattr(rl_cfg, "get") else getattr(rl_cfg, "routing_replay", "off")
    if mode not in REPLAY:
        raise ValueError(f"rl.routing_replay must be one of {REPLAY}, got {mode!r}")
    return mode if model_cfg.num_experts else "off"


def rl_batch_keys(rl_cfg, model_cfg) -> tuple:
    """The batch arrays rl_step reads: the generator's routing too under r3."""
    return RL_BATCH_KEYS + (("routing",) if replay_mode(rl_cfg, model_cfg) == "r3" else ())


def own_routing(params, model_cfg, tokens_BL, token_mask_BL):
    """The trainer's own experts per token and layer, [B, L, n_layers, k], with these params (r2's
    record: a forward without the LM head and without gradient)."""
    positions = model_lib.positions_from_mask(token_mask_BL)
    _, inter = model_lib.Decoder(model_cfg).apply({"params": jax.lax.stop_gradient(params)}, tokens_BL, positions,
                                                  token_mask_BL, return_hidden=True, mutable="intermediates")
    return moe_lib.routing_of(inter, *tokens_BL.shape)


def policy_loss(params, mb, *, model_cfg, rl_cfg, micro_frac=1.0, shared_prompt=None, replay=None):
    """sum(weight * per-token loss) over a microbatch of whole samples [n, L], plus
    model.router_aux_loss_coef x the router loss for a MoE policy. micro_frac is the
    microbatch's share of its minibatch: the per-token weights already sum to one over the
    minibatch, the router loss is a mean, so accumulated microbatches add up exactly.
    shared_prompt=(G, P): each group's prompt runs once (shared_prompt_logprobs).
    replay [n, L, n_layers, k]: the routing to replay (routing_replay); mb["routing"], the
    generator's, is compared with the trainer's own when given."""
    is_moe = bool(model_cfg.num_experts)
    if shared_prompt:
        logp, router = shared_prompt_logprobs(params, model_cfg, mb["tokens"], mb["token_mask"], *shared_prompt,
                                              rl_cfg.temperature), {}
    else:
        logp = token_logprobs(params, model_cfg, mb["tokens"], mb["token_mask"], rl_cfg.temperature,
                              rl_cfg.logprob_chunk, with_router=is_moe, routing_BLlk=replay)
        logp, router = (logp[0], router_terms(logp[1], mb, replay)) if is_moe else (logp, {})
    mask = mb["loss_mask"][:, 1:]
    old_logp = mb["old_logp"][:, 1:]
    if is_moe and not shared_prompt:
        router["router/logp_mismatch"] = (jnp.abs(logp - old_logp) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    per_token = losses.LOSSES[rl_cfg.loss](logp, old_logp, mb["adv"], mask, **loss_hparams(rl_cfg))
    if rl_cfg.kl_coef:  # k3 estimator against the generator policy (off by default)
        per_token = per_token + rl_cfg.kl_coef * losses.kl_k3(logp, old_logp)
    loss = (per_token * mb["weight"][:, 1:]).sum()
    if router and model_cfg.router_aux_loss_coef:
        loss = loss + model_cfg.router_aux_loss_coef * micro_frac * router["router/aux_loss"]
    n_tok = jnp.maximum(mask.sum(), 1.0)
    rho = jnp.exp(logp - old_logp)
    stats = {
        "rho_abs_dev": (jnp.abs(rho - 1.0) * mask).sum() / n_tok,
        "rho_max": jnp.max(jnp.where(mask > 0, rho, 0.0)),
        "is_capped_frac": losses.clipped(rl_cfg.loss, logp, old_logp, mb["adv"], mask, **loss_hparams(rl_cfg)).sum() / n_tok,
        "neg_logp": -(logp * mask).sum() / n_tok,
        "kl_k3": (losses.kl_k3(logp, old_logp) * mask).sum() / n_tok,  # logged even when kl_coef = 0
        **router,
    }
    return loss, stats


def reduce_stats(stats):
    """Per-microbatch (or per-minibatch) statistics stacked on axis 0 -> one value each:
    maxima stay maxima, the rest are means."""
    return {k: v.max(0) if k.endswith("_max") else v.mean(0) for k, v in stats.items()}


def rl_step(state, batch, *, model_cfg, rl_cfg, optimizer, mesh=None, prompt_len=0):
    """One generated batch -> `num_minibatches` optimizer updates (PPO-off-policy-k), each
    accumulated over `grad_accum` microbatches of whole samples. prompt_len > 0: the first
    prompt_len columns are each group's prompt (collect.rl_batch), run once per group where
    `shares_prompts` allows."""
    P, G = batch["rewards"].shape
    adv, keep = losses.advantages(batch["rewards"], norm=rl_cfg.adv_norm, zero_var_filter=rl_cfg.zero_var_filter)
    M, A = rl_cfg.num_minibatches, rl_cfg.grad_accum
    replay = replay_mode(rl_cfg, model_cfg)
    if replay == "r3" and "routing" not in batch:
        raise ValueError("rl.routing_replay='r3' needs the generator's routing in the batch (batch['routing']: "
                         "the sampler's or the engine's record_routing)")
    old_params = state["params"]  # r2 replays the routing of the params the batch starts from
    # Per-sample arrays [N, L] (a prompt's G samples contiguous) -> minibatches of whole prompts.
    data = {k: batch[k] for k in ("tokens", "token_mask", "loss_mask", "old_logp", "routing") if k in batch}
    data["adv"] = adv.reshape(P * G)
    data = jax.tree.map(lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), data)
    keep_M = keep.reshape(M, P // M)
    micro_rows = batch["tokens"].shape[0] // (M * A)
    shared = (G, prompt_len) if shares_prompts(model_cfg, rl_cfg, micro_rows, G, prompt_len, mesh) else None
    loss_fn = functools.partial(policy_loss, model_cfg=model_cfg, rl_cfg=rl_cfg, micro_frac=1.0 / A,
                                shared_prompt=shared)

    def grad_fn(params, mb):
        if replay == "r3":
            r = mb["routing"]
        elif replay == "r2" and M > 1:  # with one minibatch the params are the old ones: own routing
            r = own_routing(old_params, model_cfg, mb["tokens"], mb["token_mask"])
        else:
            r = None
        return jax.value_and_grad(functools.partial(loss_fn, replay=r), has_aux=True)(params, mb)

    def grads_of(params, mb, keep_p):
        n, L = mb["tokens"].shape
        mask_pGT = mb["loss_mask"].reshape(n // G, G, L)
        mb = dict(mb, weight=losses.aggregation_weights(rl_cfg.aggregation, mask_pGT, keep_p).reshape(n, L))
        if A == 1:
            return grad_fn(params, mb)
        micro = jax.tree.map(lambda x: sharding.constrain_batch(x.reshape((A, n // A) + x.shape[1:]), mesh, axis=1), mb)

        def add(grads_sum, m):
            (loss, stats), grads = grad_fn(params, m)
            return jax.tree.map(jnp.add, grads_sum, grads), (loss, stats)

        grads, (loss_A, stats) = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, params), micro)
        return (loss_A.sum(), reduce_stats(stats)), grads

    def update(carry, xs):
        params, opt_state = carry
        (loss, stats), grads = grads_of(params, *xs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        stats = dict(stats, loss=loss, grad_norm=optax.global_norm(grads))
        return (params, opt_state), stats

    (params, opt_state), stats = jax.lax.scan(update, (state["params"], state["opt_state"]), (data, keep_M))
    metrics = reduce_stats(stats)
    metrics["rho_abs_dev_first_mb"] = stats["rho_abs_dev"][0]  # generator/trainer mismatch, before any update
    if "router/logp_mismatch" in stats:  # the same, as |log-prob difference|, before any update
        metrics["router/logp_mismatch"] = stats["router/logp_mismatch"][0]
    metrics["keep_frac"] = keep.mean()
    metrics["reward_mean"] = batch["rewards"].mean()
    metrics["param_norm"] = optax.global_norm(params)  # non-finite params stop the run before a save
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
    return new_state, metrics


def sft_step(state, batch, *, model_cfg, optimizer, mesh=None):
    """Cross-entropy on the completion tokens of reference solutions (warm start)."""

    def loss_fn(params):
        logp = token_logprobs(params, model_cfg, batch["tokens"], batch["token_mask"])
        mask = batch["loss_mask"][:, 1:]
        return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss}


RL_BATCH_KEYS = ("tokens", "token_mask", "loss_mask", "old_logp", "rewards")
SFT_BATCH_KEYS = ("tokens", "token_mask", "loss_mask")
REPLICATED_KEYS = ("rewards",)  # [P, G]: tiny, and P need not divide the device count


def jit_step(step_fn, state_sh, mesh, batch_keys=RL_BATCH_KEYS, **static):
    """jit with the state's shardings, per-sample batch arrays split over the data axes
    along their leading axis, and the old state donated."""
    partial = functools.partial(step_fn, mesh=mesh, **static)

    def fn(state, batch):  # traced with the mesh in context: sharding.constrain and MoE shard_map read it
        with sharding.tracing_mesh(mesh):
            return partial(state, batch)

    batch_sh = {k: sharding.replicated(mesh) if k in REPLICATED_KEYS else sharding.batch_sharding(mesh, 1)
                for k in batch_keys}
    return jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, sharding.replicated(mesh)),
                   donate_argnums=0)


def loss_hparams(rl_cfg) -> dict:
    return {k: rl_cfg[k] for k in ("eps_max", "eps_low", "eps_high", "gspo_eps_low", "gspo_eps_high")}
