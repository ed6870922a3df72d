"""MoE routing replay (rl.routing_replay): the KV-cache sampler records each fed token's experts per
layer, and the trainer replaying them (r3) computes the generator's log-probs of the sampled tokens
to float32 rounding on a bfloat16 MoE where, without replay, routers at a near-tie choose
differently; the routing record against a teacher-forced recompute; the disagreement metric
against a numpy count; r2/r3/off through rl_step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from rl_scaling import sharding
from rl_scaling.policy import model as M, moe, presets
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import collect, sampler

# dense dispatch: a token's output does not depend on the batch (bit for bit), so routing is the
# only thing that can differ between the generator's decode and the trainer's recompute
CFG = dataclasses.replace(presets.tiny_moe(vocab_size=32, d_model=32, head_dim=8, mlp_dim=32, moe_mlp_dim=16,
                                           n_layers=2), dtype="bfloat16", num_experts=4, num_experts_per_tok=1,
                          moe_impl="dense")
B, P, T = 8, 4, 12


@pytest.fixture(scope="module")
def case():
    """Trainer params whose routers tie experts 0 and 1 exactly (top-1 takes 0), and generator params
    whose expert-1 column is a few float32 ulps larger (as another kernel's rounding): the generator
    takes 1 wherever that logit is positive. Everything else is the same."""
    with jax.set_mesh(sharding.make_mesh(devices=jax.devices()[:1])):
        params = jax.device_get(nn.unbox(jax.jit(lambda: M.init_params(CFG, jax.random.key(0)))()))
    r = np.asarray(params["layers"]["moe"]["router"]).copy()  # [n_layers, D, E]
    r[..., 0] *= 3.0
    r[..., 1] = r[..., 0]
    gen_r = r.copy()
    gen_r[..., 1] *= np.float32(1 + 2.0 ** -23)
    train = jax.tree.map(np.copy, params)
    train["layers"]["moe"]["router"] = r
    gen = jax.tree.map(np.copy, params)
    gen["layers"]["moe"]["router"] = gen_r
    prompt = jax.random.randint(jax.random.key(1), (B, P), 1, CFG.vocab_size)
    mask = jnp.ones((B, P), bool).at[0, :2].set(False)  # one left-padded prompt
    out = sampler.sample(gen, prompt, mask, jax.random.key(2), cfg=CFG, max_new_tokens=T, record_routing=True,
                         cache_segments=1)
    tokens = jnp.concatenate([prompt, out.tokens_BT], 1)
    tmask = jnp.concatenate([mask, jnp.arange(T)[None] < out.lengths_B[:, None]], 1)
    f = jax.jit(lambda p, r: ts.token_logprobs(p, CFG, tokens, tmask, with_router=True, routing_BLlk=r))
    return dict(train=train, gen=gen, out=out, tokens=tokens, tmask=tmask, plain=f(train, None),
                replayed=f(train, out.routing_BSLK))


def _gen_positions(case):
    m = np.asarray(case["tmask"][:, P:])
    return lambda lp: np.where(m, np.asarray(lp)[:, P - 1:], 0.0)


def test_record_is_the_teacher_forced_routing(case):
    """The sampler's record == the routing of one teacher-forced forward over the sampled sequences
    (the trainer's params: their exact ties cannot flip)."""
    prompt, pmask = case["tokens"][:, :P], case["tmask"][:, :P]
    out = sampler.sample(case["train"], prompt, pmask, jax.random.key(3), cfg=CFG, max_new_tokens=T,
                         record_routing=True, cache_segments=2)
    routing = np.asarray(out.routing_BSLK)
    assert routing.shape == (B, P + T, CFG.n_layers, 1) and routing.dtype == np.int32
    tokens = jnp.concatenate([prompt, out.tokens_BT], 1)
    tmask = jnp.concatenate([pmask, jnp.arange(T)[None] < out.lengths_B[:, None]], 1)
    _, inter = ts.token_logprobs(case["train"], CFG, tokens, tmask, with_router=True)
    want = np.asarray(moe.routing_of(inter, B, P + T - 1))
    real = np.asarray(tmask[:, :-1])
    # the decode step's and the full sequence's router matmuls round differently in float32, which
    # can flip a router at a near-tie (what replay is for): all but such rare pairs agree
    agree = (routing[:, :-1][real] == want[real]).mean()
    assert agree >= 0.98, agree
    assert len(np.unique(want[real])) > 1  # more than one expert in use


def test_replay_makes_trainer_logprobs_equal_the_generators(case):
    at = _gen_positions(case)
    gen = np.asarray(case["out"].logprobs_BT)
    own = moe.routing_of(case["plain"][1], B, P + T - 1)
    ref = case["out"].routing_BSLK[:, :-1]
    real = case["tmask"][:, :-1]
    disagree = float(moe.replay_disagreement(own, ref, real))
    differ = (np.asarray(own) != np.asarray(ref)).any(-1) & np.asarray(real)[..., None]
    assert disagree == pytest.approx(differ.sum() / (np.asarray(real).sum() * CFG.n_layers))
    assert disagree > 0.05  # the near-tie flips a share of the routers
    plain_err = np.abs(at(case["plain"][0]) - gen).max()
    assert plain_err > 0.1  # ... and the log-probs with them
    # Replay removes the flips. What remains: the replayed gates are the trainer's router's, one ulp
    # off the generator's, and casting gate * x to bfloat16 sometimes rounds that to one bf16 ulp
    # (not float32 rounding: equality to 1e-6 holds only where the routers agree bit for bit).
    replay_err = np.abs(at(case["replayed"][0]) - gen).max()
    assert replay_err < 0.05 and replay_err < plain_err / 10, (replay_err, plain_err)
    # under replay the trainer's own routers still disagree (what the metric reports)
    own_replayed = moe.routing_of(case["replayed"][1], B, P + T - 1)
    assert float(moe.replay_disagreement(own_replayed, ref, real)) > 0.05


def test_replay_keeps_router_gradient(case):
    """Replay fixes the selection only: the gates are the live router's, so it still learns."""
    def loss(p):
        lp = ts.token_logprobs(p, CFG, case["tokens"], case["tmask"], routing_BLlk=case["out"].routing_BSLK)
        return lp.sum()

    g = jax.jit(jax.grad(loss))(case["train"])
    assert float(jnp.abs(g["layers"]["moe"]["router"]).max()) > 0


@pytest.mark.slow  # three rl_step compiles, ~20 s each on two cores
@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
def test_rl_step_replay_modes(case, mode):
    """rl_step reads the routing under r3, logs the disagreement and the log-prob mismatch (r3's
    small, off's large). r2 with 2 minibatches replays the old params' routing."""
    import ml_collections

    from configs import common

    rl = common.base_config().rl
    rl.routing_replay, rl.num_minibatches, rl.zero_var_filter = mode, 2 if mode == "r2" else 1, False
    rl = ml_collections.FrozenConfigDict(rl)
    opt = ts.make_optimizer(ml_collections.ConfigDict(dict(lr=1e-3, warmup_steps=1, b1=0.9, b2=0.999, eps=1e-8,
                                                           weight_decay=0.0, grad_clip=1.0)))
    state = {"params": case["train"], "opt_state": opt.init(case["train"]), "step": jnp.zeros((), jnp.int32)}
    out = case["out"]
    rewards = np.tile(np.array([1.0, 0.0], np.float32), B // 2)
    batch = collect.rl_batch(np.asarray(case["tokens"][:, :P]), np.asarray(case["tmask"][:, :P]),
                             jax.tree.map(np.asarray, out), rewards, 2, B // 2)
    assert batch["routing"].shape == (B, P + T, CFG.n_layers, 1)
    keys = ts.rl_batch_keys(rl, CFG)
    assert ("routing" in keys) == (mode == "r3")
    _, metrics = jax.jit(lambda s, b: ts.rl_step(s, b, model_cfg=CFG, rl_cfg=rl, optimizer=opt))(
        state, {k: batch[k] for k in keys})
    if mode == "r3":
        assert float(metrics["router/logp_mismatch"]) < 5e-3
        assert float(metrics["router/replay_disagreement"]) > 0.05
    elif mode == "off":
        assert float(metrics["router/logp_mismatch"]) > 1e-3
        assert "router/replay_disagreement" not in metrics
    else:  # r2: the old params' routing, replayed in both minibatches (the second's params moved: the
        # exact ties break, so its own routers disagree with the replayed ones)
        assert 0.0 < float(metrics["router/replay_disagreement"]) <= 1.0


def test_bad_mode_and_missing_routing_are_errors(case):
    import ml_collections

    with pytest.raises(ValueError, match="routing_replay"):
        ts.replay_mode(ml_collections.ConfigDict(dict(routing_replay="r4")), CFG)
    assert ts.replay_mode(ml_collections.ConfigDict(dict(routing_replay="r3")), dataclasses.replace(CFG, num_experts=0)) == "off"
