"""RL math against a plain numpy reference on random ragged batches: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_scaling.rl import losses


def ragged_batch(seed, P=5, G=4, T=7):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=(P, G))  # some samples empty
    mask = (np.arange(T)[None, None, :] < lengths[..., None]).astype(np.float64)
    logp = -rng.exponential(1.0, size=(P, G, T))
    old_logp = logp + rng.normal(0, 0.8, size=(P, G, T))
    old_logp[:, :, 0] -= 3.0  # first tokens: ratios well above eps_max
    rewards = rng.integers(0, 2, size=(P, G)).astype(np.float64)
    rewards[0] = 1.0  # a zero-variance prompt (all correct)
    rewards[1] = 0.0  # and another (all wrong)
    return logp, old_logp, mask, rewards


def np_advantages(rewards, norm, zero_var_filter, eps=1e-6):
    keep = (rewards.max(1) > rewards.min(1)).astype(float) if zero_var_filter else np.ones(len(rewards))
    adv = rewards - rewards.mean(1, keepdims=True)
    if norm == "batch":
        kept = adv[keep > 0]
        adv = adv / (kept.std() + eps) if kept.size else adv / eps
    elif norm == "group":
        adv = adv / (rewards.std(1, keepdims=True) + eps)
    return adv * keep[:, None], keep


def np_cispo_prompt(logp, old_logp, mask, adv, keep, eps_max):
    """Loss and its gradient w.r.t. logp, written out by hand (loops, no vectorization)."""
    P, G, T = logp.shape
    total, grad = 0.0, np.zeros_like(logp)
    n_kept = keep.sum()
    for p in range(P):
        if not keep[p]:
            continue
        n_tok = mask[p].sum()
        if n_tok == 0:
            continue
        for g in range(G):
            for t in range(T):
                if mask[p, g, t]:
                    w = min(np.exp(logp[p, g, t] - old_logp[p, g, t]), eps_max)
                    total += -w * adv[p, g] * logp[p, g, t] / n_tok / n_kept
                    grad[p, g, t] = -w * adv[p, g] / n_tok / n_kept
    return total, grad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", ["batch", "group", "none"])
def test_advantages_match_numpy(seed, norm):
    _, _, _, rewards = ragged_batch(seed)
    for zv in (True, False):
        adv, keep = losses.advantages(jnp.asarray(rewards), norm=norm, zero_var_filter=zv)
        ref_adv, ref_keep = np_advantages(rewards, norm, zv)
        np.testing.assert_allclose(keep, ref_keep)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_cispo_prompt_aggregation_value_and_grad(seed):
    logp, old_logp, mask, rewards = ragged_batch(seed)
    adv, keep = np_advantages(rewards, "batch", True)
    eps_max = 4.0

    def loss_fn(lp):
        per_tok = losses.cispo(lp, jnp.asarray(old_logp), jnp.asarray(adv), jnp.asarray(mask), eps_max=eps_max)
        return losses.aggregate("prompt", per_tok, jnp.asarray(mask), jnp.asarray(keep))

    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
    ref_value, ref_grad = np_cispo_prompt(logp, old_logp, mask, adv, keep, eps_max)
    assert np.isclose(value, ref_value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    # The capped weights really were exercised: some ratios exceed eps_max.
    assert (np.exp(logp - old_logp)[mask > 0] > eps_max).any()


def test_cispo_matches_trl_per_token_formula():
    """TRL's GRPOTrainer loss_type="cispo": -clamp(ratio, max=eps).detach() * adv * logp."""
    torch = pytest.importorskip("torch")
    logp, old_logp, mask, rewards = ragged_batch(11)
    adv, _ = np_advantages(rewards, "batch", True)
    lp_t = torch.tensor(logp, requires_grad=True)
    ratio = torch.exp(lp_t - torch.tensor(old_logp))
    trl = -torch.clamp(ratio, max=5.0).detach() * torch.tensor(adv)[..., None] * lp_t
    trl.sum().backward()
    with jax.enable_x64(True):
        ours = losses.cispo(jnp.asarray(logp), jnp.asarray(old_logp), jnp.asarray(adv), jnp.asarray(mask), eps_max=5.0)
        our_grad = jax.grad(lambda lp: losses.cispo(lp, jnp.asarray(old_logp), jnp.asarray(adv), jnp.asarray(mask),
                                                   eps_max=5.0).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(ours, trl.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(our_grad, lp_t.grad.numpy(), rtol=1e-12)


def test_zero_variance_prompts_get_no_gradient():
    logp, old_logp, mask, rewards = ragged_batch(3)
    adv, keep = losses.advantages(jnp.asarray(rewards))
    grad = jax.grad(lambda lp: losses.aggregate(
        "prompt", losses.cispo(lp, jnp.asarray(old_logp), adv, jnp.asarray(mask)), jnp.asarray(mask), keep))(jnp.asarray(logp))
    assert np.all(np.asarray(grad)[:2] == 0.0)  # prompts 0 and 1 have constant rewards
    assert np.abs(np.asarray(grad)[2:]).sum() > 0
