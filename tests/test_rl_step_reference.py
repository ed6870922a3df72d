"""rl_step against references written here, outside its minibatching and weighting code.

PPO-off-policy-k: one generated batch -> k sequential AdamW updates, one per minibatch of
whole prompts in order, with advantages computed once on the full batch. The reference
computes the advantages and the per-token loss weights with numpy loops, takes each
minibatch's gradient with un-jitted jax through the model's forward pass, and applies
clip-by-global-norm + AdamW + the warm-up schedule in numpy.

Direction: one step with positive advantage on a sequence raises its log-prob, with
negative advantage it lowers it, for every loss in losses.LOSSES.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from configs import tiny
from rl_scaling.policy import model as model_lib
from rl_scaling.rl import losses
from rl_scaling.rl import train_step as ts

# One layer, 16 wide: these tests compile a step per configuration.
MODEL = model_lib.ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32)
P, G, L = 8, 4, 10
COMPLETION_START = 4  # tokens 0..3: the (left-padded) prompt
# Pass counts that differ between the two halves, so batch-normalized advantages differ from
# per-minibatch ones; prompts 3 (all right) and 5 (all wrong) have zero variance.
REWARDS = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1],
                    [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]], np.float32)


def config_with(rl=None, optim=None):
    config = tiny.get_config()
    config.rl.grad_accum = 1
    for k, v in (rl or {}).items():
        config.rl[k] = v
    for k, v in (optim or {}).items():
        config.optim[k] = v
    return config


@jax.jit
def ref_token_logp(params, tokens, token_mask):
    """log pi(token_t | tokens_<t) for t >= 1 straight from the model's logits: [N, L-1]."""
    positions = model_lib.positions_from_mask(token_mask)
    logits, _ = model_lib.Decoder(MODEL).apply({"params": params}, tokens[:, :-1], positions[:, :-1],
                                              token_mask[:, :-1])
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]


def make_batch(params, seed):
    """Prompts of 3-4 tokens (some left-padded), completions of 1-6 tokens (right-padded) with
    one forced token (real, not trained on) in some; old_logp = the current policy's log-prob
    plus noise, so importance ratios straddle PPO's clip range."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 60, size=(P, G, L)).astype(np.int32)
    tokens[:, :, :COMPLETION_START] = rng.integers(3, 60, size=(P, 1, COMPLETION_START))  # shared prompt
    token_mask = np.ones((P, G, L), bool)
    token_mask[::3, :, 0] = False  # left padding
    loss_mask = np.zeros((P, G, L), np.float32)
    lengths = rng.integers(1, L - COMPLETION_START + 1, size=(P, G))
    for p in range(P):
        for g in range(G):
            end = COMPLETION_START + lengths[p, g]
            loss_mask[p, g, COMPLETION_START:end] = 1.0
            token_mask[p, g, end:] = False
            if lengths[p, g] >= 4:
                loss_mask[p, g, COMPLETION_START + 1] = 0.0  # an injected token
    tokens, token_mask, loss_mask = (x.reshape(P * G, L) for x in (tokens, token_mask, loss_mask))
    logp = np.asarray(ref_token_logp(params, jnp.asarray(tokens), jnp.asarray(token_mask)))
    old_logp = np.zeros((P * G, L), np.float32)
    old_logp[:, 1:] = logp + rng.normal(0.0, 0.15, size=logp.shape)
    old_logp *= loss_mask
    return {"tokens": tokens, "token_mask": token_mask, "loss_mask": loss_mask, "old_logp": old_logp,
            "rewards": REWARDS.copy()}


# ---- references: numpy loops ------------------------------------------------------------

def ref_advantages(rewards, norm, zero_var_filter, eps=1e-6):
    adv, keep = np.zeros(rewards.shape), np.ones(len(rewards))
    for p, r in enumerate(rewards):
        if zero_var_filter and r.min() == r.max():
            keep[p] = 0.0
        adv[p] = r - r.mean()
        if norm == "group":
            adv[p] /= r.std() + eps
    if norm == "batch":
        kept = np.concatenate([adv[p] for p in range(len(rewards)) if keep[p]])
        adv /= kept.std() + eps
    return adv * keep[:, None], keep


def ref_weights(aggregation, mask_pGT, keep_p):
    """Per-token weights of one minibatch's loss, so loss = sum(w * per-token loss)."""
    w = np.zeros(mask_pGT.shape)
    kept = [p for p in range(len(keep_p)) if keep_p[p]]
    if aggregation == "prompt":  # mean over kept prompts of (token sum / the prompt's tokens)
        for p in kept:
            w[p] = mask_pGT[p] / max(mask_pGT[p].sum(), 1.0) / len(kept)
    elif aggregation == "sample":  # mean over kept non-empty samples of their token mean
        samples = [(p, g) for p in kept for g in range(G) if mask_pGT[p, g].sum() > 0]
        for p, g in samples:
            w[p, g] = mask_pGT[p, g] / mask_pGT[p, g].sum() / len(samples)
    elif aggregation == "token":  # mean over every kept token
        n_tokens = sum(mask_pGT[p].sum() for p in kept)
        for p in kept:
            w[p] = mask_pGT[p] / n_tokens
    return w


def ref_per_token_loss(name, logp, old_logp, adv, mask, hp):
    """[n, T] per-token losses; adv [n]."""
    a = adv[:, None]
    rho = jnp.exp(logp - old_logp)
    if name == "cispo":
        return -jax.lax.stop_gradient(jnp.minimum(rho, hp["eps_max"])) * a * logp
    if name == "ppo_clip":
        return -jnp.minimum(rho * a, jnp.clip(rho, 1 - hp["eps_low"], 1 + hp["eps_high"]) * a)
    if name == "gspo":
        s = jnp.exp(((logp - old_logp) * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0))
        seq = -jnp.minimum(s * adv, jnp.clip(s, 1 - hp["gspo_eps_low"], 1 + hp["gspo_eps_high"]) * adv)
        return seq[:, None] * jnp.ones_like(logp)
    if name == "reinforce":
        return -a * logp
    raise NotImplementedError(name)


def ref_adamw(params, grads, mu, nu, count, o):
    """optax.chain(clip_by_global_norm, adamw(linear warm-up then constant)) in numpy;
    count = updates done before this one."""
    g_norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))
    scale = 1.0 if g_norm < o.grad_clip else o.grad_clip / g_norm
    warmup = max(o.warmup_steps, 1)
    lr = o.lr * min(count + 1, warmup) / warmup
    t = count + 1
    new_params, new_mu, new_nu = {}, {}, {}
    for k in params:
        g = grads[k] * scale
        new_mu[k] = o.b1 * mu[k] + (1 - o.b1) * g
        new_nu[k] = o.b2 * nu[k] + (1 - o.b2) * g * g
        mu_hat, nu_hat = new_mu[k] / (1 - o.b1 ** t), new_nu[k] / (1 - o.b2 ** t)
        new_params[k] = params[k] - lr * (mu_hat / (np.sqrt(nu_hat) + o.eps) + o.weight_decay * params[k])
    return new_params, new_mu, new_nu


def flatten(tree):
    return {jax.tree_util.keystr(path): np.asarray(x, np.float64) for path, x in
            jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten(like, flat):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[jax.tree_util.keystr(path)], jnp.float32)
                                                  for path, _ in leaves])


@functools.partial(jax.jit, static_argnames=("loss_name", "hp"))
def ref_loss_and_grad(params, tokens, token_mask, old_logp, adv, mask, weights, *, loss_name, hp):
    """sum(weights * per-token loss) and its gradient; jitted only for speed (the reference
    code is the same un-jitted)."""

    def loss_fn(p):
        logp = ref_token_logp(p, tokens, token_mask)
        return (ref_per_token_loss(loss_name, logp, old_logp, adv, mask, dict(hp)) * weights).sum()

    return jax.value_and_grad(loss_fn)(params)


def ref_minibatch_grad(like, params, batch, rl, m):
    """Loss and gradient of minibatch m (whole prompts, in order) at `params` (flat numpy;
    `like`: a params tree of the same structure)."""
    adv_PG, keep_P = ref_advantages(batch["rewards"], rl.adv_norm, rl.zero_var_filter)  # the full batch
    per_mb = P // rl.num_minibatches
    prompts = slice(m * per_mb, (m + 1) * per_mb)
    rows = slice(m * per_mb * G, (m + 1) * per_mb * G)
    mask = batch["loss_mask"][rows, 1:]
    weights = ref_weights(rl.aggregation, mask.reshape(per_mb, G, L - 1), keep_P[prompts]).reshape(-1, L - 1)
    loss, grads = ref_loss_and_grad(
        unflatten(like, params), batch["tokens"][rows], batch["token_mask"][rows], batch["old_logp"][rows, 1:],
        adv_PG[prompts].reshape(-1).astype(np.float32), mask, weights.astype(np.float32),
        loss_name=rl.loss, hp=tuple(sorted(ts.loss_hparams(rl).items())))
    return float(loss), flatten(grads)


def ref_ppo_off_policy_k(like, params, batch, rl, o, mu, nu, count):
    """k sequential updates, one per minibatch. Returns the params and each minibatch's loss."""
    mb_losses = []
    for m in range(rl.num_minibatches):
        loss, grads = ref_minibatch_grad(like, params, batch, rl, m)
        params, mu, nu = ref_adamw(params, grads, mu, nu, count + m, o)
        mb_losses.append(loss)
    return params, mb_losses


# ---- the state rl_step starts from: mid-training optimizer moments ------------------------

def mid_training_state(optimizer, params, grad_scale, count, seed, mu_scale=0.1):
    """AdamW state as after `count` updates: small random first moments and second moments
    of the gradient's size (per tensor), so each update is close to linear in the gradient
    (with zero moments Adam's first update is lr * sign(g) and would not see its scale)."""
    rng = np.random.default_rng(seed)
    flat = flatten(params)
    mu = {k: rng.normal(0.0, mu_scale * grad_scale[k], v.shape) for k, v in flat.items()}
    nu = {k: (grad_scale[k] * rng.uniform(0.5, 1.5, v.shape)) ** 2 for k, v in flat.items()}
    clip_state, (adam, decay, schedule) = optimizer.init(params)
    assert hasattr(adam, "mu") and hasattr(schedule, "count"), "make_optimizer's chain changed: update this test"
    adam = adam._replace(count=jnp.array(count, jnp.int32), mu=unflatten(params, mu), nu=unflatten(params, nu))
    schedule = schedule._replace(count=jnp.array(count, jnp.int32))  # its own buffer: the state is donated
    state = {"params": params, "opt_state": (clip_state, (adam, decay, schedule)),
             "step": jnp.zeros((), jnp.int32)}
    return state, mu, nu


@pytest.fixture(scope="module")
def params0():
    """Host (numpy) arrays: rl_step donates the device copies it is given."""
    return jax.device_get(nn.unbox(model_lib.init_params(MODEL, jax.random.key(0))))


def run_rl_step(mesh, config, state, batch):
    optimizer = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(MODEL, optimizer, mesh)
    step = ts.jit_step(ts.rl_step, state_sh, mesh, model_cfg=MODEL, rl_cfg=config.rl, optimizer=optimizer)
    new_state, metrics = step(jax.device_put(state, state_sh), batch)
    return jax.device_get(new_state), jax.device_get(metrics)


# Resumed at update 1000 with a warm-up of 1002 updates: the learning rate changes inside the
# step (1001/1002, then 1 x lr). lr 2e-2 moves parameters by ~4e-3 per update
# (median over tensors of the mean change), 1e4 x the float32 difference seen (~5e-7).
OPTIM = {"lr": 2e-2, "warmup_steps": 1002}
START_COUNT = 1000
# Gradient norms here are ~0.3-2: a clip at 100 never acts, so a wrong gradient scale shows;
# the dapo case clips at 0.5 (its gradient norms are ~1.4).
NO_CLIP, CLIP = 100.0, 0.5


@pytest.mark.parametrize("rl, grad_clip", [
    pytest.param({"num_minibatches": 2, "loss": "cispo", "aggregation": "prompt", "adv_norm": "batch",
                  "zero_var_filter": True}, NO_CLIP, id="scalerl-k2"),
    pytest.param({"num_minibatches": 8, "grad_accum": 2, "loss": "cispo", "aggregation": "prompt",
                  "adv_norm": "batch", "zero_var_filter": True}, NO_CLIP, id="minimax-k8-accum2"),
    pytest.param({"num_minibatches": 8, "loss": "ppo_clip", "eps_low": 0.2, "eps_high": 0.26,
                  "aggregation": "prompt", "adv_norm": "group", "zero_var_filter": True}, CLIP, id="dapo-k8-clipped"),
    pytest.param({"num_minibatches": 8, "loss": "ppo_clip", "aggregation": "sample", "adv_norm": "group",
                  "zero_var_filter": False}, NO_CLIP, id="grpo-k8"),
    pytest.param({"num_minibatches": 2, "loss": "gspo", "gspo_eps_low": 3e-2, "gspo_eps_high": 4e-2,
                  "aggregation": "token", "adv_norm": "none", "zero_var_filter": False}, NO_CLIP, id="gspo-token-k2",
                 marks=pytest.mark.slow),
])
def test_ppo_off_policy_k_equals_k_sequential_updates(mesh1, params0, rl, grad_clip):
    config = config_with(rl, dict(OPTIM, grad_clip=grad_clip))
    batch = make_batch(params0, seed=1)
    flat0 = flatten(params0)
    _, grads0 = ref_minibatch_grad(params0, flat0, batch, config.rl, 0)
    grad_scale = {k: max(np.sqrt((g ** 2).mean()), 1e-6) for k, g in grads0.items()}
    state, mu, nu = mid_training_state(ts.make_optimizer(config.optim), params0, grad_scale, START_COUNT, seed=2)
    ref_params, ref_losses = ref_ppo_off_policy_k(params0, flat0, batch, config.rl, config.optim, mu, nu,
                                                  START_COUNT)

    new_state, metrics = run_rl_step(mesh1, config, state, batch)
    got = flatten(new_state["params"])
    moved = np.median([np.abs(ref_params[k] - flat0[k]).mean() for k in flat0])
    assert moved > 1e-3  # the updates are far above the tolerance below
    for k in ref_params:
        np.testing.assert_allclose(got[k], ref_params[k], rtol=0, atol=1e-5, err_msg=k)
    assert int(new_state["opt_state"][1][0].count) == START_COUNT + config.rl.num_minibatches
    np.testing.assert_allclose(metrics["loss"], np.mean(ref_losses), rtol=1e-4, atol=1e-6)


# ---- direction: positive advantage raises a sequence's log-prob, negative lowers it ----------

def direction_batch(seed=3):
    """Two prompts x two samples, rewards [1, 0] and [0, 1]: every sample has a non-zero
    advantage. Completions of 6, 3, 4 and 5 tokens, so the aggregations weigh them
    differently. On-policy (old_logp = the current log-probs): no ratio is clipped."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 60, size=(4, L)).astype(np.int32)
    tokens[1, :COMPLETION_START] = tokens[0, :COMPLETION_START]  # a prompt's two samples share it
    tokens[3, :COMPLETION_START] = tokens[2, :COMPLETION_START]
    token_mask = np.ones((4, L), bool)
    loss_mask = np.zeros((4, L), np.float32)
    for row, length in enumerate((6, 3, 4, 5)):
        loss_mask[row, COMPLETION_START:COMPLETION_START + length] = 1.0
        token_mask[row, COMPLETION_START + length:] = False
    return {"tokens": tokens, "token_mask": token_mask, "loss_mask": loss_mask,
            "rewards": np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)}


def sequence_logp(params, batch):
    logp = np.asarray(ref_token_logp(params, batch["tokens"], batch["token_mask"]))
    return (logp * batch["loss_mask"][:, 1:]).sum(1)


DIRECTION_CASES = [(loss, agg) for loss in losses.LOSSES for agg in losses.AGGREGATIONS]
# Every loss and every aggregation in the default suite; the rest of the grid is slow.
DEFAULT_DIRECTION = {("cispo", "prompt"), ("ppo_clip", "sample"), ("gspo", "token"), ("reinforce", "prompt")}


@pytest.mark.parametrize("loss, aggregation", [
    pytest.param(loss, agg, marks=() if (loss, agg) in DEFAULT_DIRECTION else pytest.mark.slow)
    for loss, agg in DIRECTION_CASES])
def test_one_step_raises_positive_and_lowers_negative_advantage_logp(mesh1, params0, loss, aggregation):
    # No weight decay, zero first moments and fixed second moments (the weights' size): the
    # update is ~ -lr x a positive diagonal x the gradient, so the first-order change of each
    # sequence's log-prob shows.
    config = config_with({"loss": loss, "aggregation": aggregation},
                         {"lr": 3e-3, "weight_decay": 0.0, "warmup_steps": 1})
    batch = direction_batch()
    before = sequence_logp(params0, batch)
    batch["old_logp"] = np.zeros((4, L), np.float32)
    batch["old_logp"][:, 1:] = np.asarray(ref_token_logp(params0, batch["tokens"], batch["token_mask"]))
    batch["old_logp"] *= batch["loss_mask"]
    flat0 = flatten(params0)
    grad_scale = {k: max(np.sqrt((v ** 2).mean()), 1e-3) for k, v in flat0.items()}  # ~ the weights' size
    state, _, _ = mid_training_state(ts.make_optimizer(config.optim), params0, grad_scale, count=10, seed=4,
                                     mu_scale=0.0)

    new_state, _ = run_rl_step(mesh1, config, state, batch)
    change = sequence_logp(new_state["params"], batch) - before
    adv_sign = np.sign(batch["rewards"] - batch["rewards"].mean(1, keepdims=True)).reshape(-1)
    assert np.all(np.abs(change) > 1e-4), change
    np.testing.assert_array_equal(np.sign(change), adv_sign, err_msg=f"log-prob changes {change}")
