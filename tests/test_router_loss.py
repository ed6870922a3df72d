"""The router load-balancing loss in the train step against a hand computation: the value
c * mean_l E * sum_e f_e * P_e from the router inputs captured in the forward pass, and its
gradient with respect to the last layer's router, derived by hand in numpy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from configs import tiny
from rl_scaling.policy import model as M
from rl_scaling.policy import presets
from rl_scaling.rl import train_step as ts
from tests.test_train_step import G, P, random_batch

COEF = 0.05
CFG = presets.tiny_moe(vocab_size=64, d_model=32, head_dim=8, mlp_dim=32, moe_mlp_dim=16, n_layers=2,
                       router_aux_loss_coef=COEF)


def minibatch(seed=0):
    b = random_batch(seed)
    adv = np.random.default_rng(seed).normal(size=P * G).astype(np.float32)
    mask = b["loss_mask"]
    weight = mask / mask.sum()
    return {k: jnp.asarray(v) for k, v in dict(b, adv=adv, weight=weight).items() if k != "rewards"}


def router_inputs(params, mb):
    """The MoE input of every layer (the mlp_norm output), [L, S, D] in float64."""
    positions = M.positions_from_mask(mb["token_mask"])
    _, inter = M.Decoder(CFG).apply(
        {"params": params}, mb["tokens"][:, :-1], positions[:, :-1], mb["token_mask"][:, :-1],
        capture_intermediates=lambda mdl, _: mdl.name == "mlp_norm", mutable="intermediates")
    x_LBTD = np.asarray(inter["intermediates"]["layers"]["mlp_norm"]["__call__"][0], np.float64)
    return x_LBTD.reshape(CFG.n_layers, -1, CFG.d_model)


def np_aux_and_grad(x_SD, router_DE, k):
    """E * sum_e f_e * P_e and d/d router (f_e is piecewise constant: no gradient)."""
    S, E = x_SD.shape[0], router_DE.shape[1]
    logits = x_SD @ router_DE
    chosen = np.argsort(-logits, axis=1)[:, :k]
    f = np.bincount(chosen.ravel(), minlength=E) / (S * k)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    aux = E * np.sum(f * p.mean(0))
    dlogits = (E / S) * p * (f[None, :] - (p * f[None, :]).sum(1, keepdims=True))
    return aux, x_SD.T @ dlogits


@pytest.fixture(scope="module")
def params(mesh1):
    with jax.set_mesh(mesh1):
        return jax.device_get(nn.unbox(jax.jit(lambda: M.init_params(CFG, jax.random.key(0)))()))


def test_router_loss_value_and_gradient_match_hand_computation(params):
    rl_cfg = tiny.get_config().rl
    mb = minibatch()
    off = dataclasses.replace(CFG, router_aux_loss_coef=0.0)

    def grad(cfg):
        return jax.jit(jax.value_and_grad(lambda p: ts.policy_loss(p, mb, model_cfg=cfg, rl_cfg=rl_cfg), has_aux=True))(params)

    (loss_on, stats), g_on = grad(CFG)
    (loss_off, _), g_off = grad(off)

    x_LSD = router_inputs(params, mb)
    routers = np.asarray(params["layers"]["moe"]["router"], np.float64)
    per_layer = [np_aux_and_grad(x_LSD[i], routers[i], CFG.num_experts_per_tok) for i in range(CFG.n_layers)]
    aux_mean = np.mean([a for a, _ in per_layer])
    assert aux_mean > 1.0  # E * sum f P is 1 for perfectly balanced routing: this one is not
    np.testing.assert_allclose(float(stats["router/aux_loss"]), aux_mean, rtol=1e-5)
    np.testing.assert_allclose(float(loss_on - loss_off), COEF * aux_mean, rtol=1e-4)

    # The last layer's router reaches the loss only directly (no later layer reads it).
    d_router = np.asarray(g_on["layers"]["moe"]["router"][-1] - g_off["layers"]["moe"]["router"][-1])
    expected = COEF / CFG.n_layers * per_layer[-1][1]
    np.testing.assert_allclose(d_router, expected, rtol=2e-3, atol=1e-7)
    assert np.abs(expected).max() > 1e-4


def test_rl_step_logs_router_metrics(mesh1):
    """A MoE policy's RL step logs the router loss, the largest expert load (>= 1/E) and the
    dropped fraction (0: dispatch is dropless); a dense policy logs none of them."""
    from tests.test_train_step import run_step

    _, m = run_step(mesh1, model_cfg=CFG)
    assert float(m["router/aux_loss"]) > 0.0
    assert 1.0 / CFG.num_experts <= float(m["router/expert_load_max"]) <= 1.0
    assert float(m["router/dropped_frac"]) == 0.0
    _, dense = run_step(mesh1)
    assert not any(k.startswith("router/") for k in dense)
