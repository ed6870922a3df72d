"""The loss zoo against hand-written numpy loops on random ragged batches: PPO clip
(symmetric: GRPO, asymmetric: DAPO), GSPO, REINFORCE and CISPO under every aggregation
(prompt, sample, token), the advantage normalizations (batch, group, none) and the KL term;
values and gradients (the numpy gradients are derived by hand, not by autodiff)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_scaling.rl import losses


def ragged(seed, P=5, G=4, T=6):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=(P, G))
    lengths[2, 0] = 0  # an empty sample
    lengths[3, :] = 0  # a kept prompt with no tokens at all
    mask = np.zeros((P, G, T))
    for p in range(P):
        for g in range(G):
            mask[p, g, : lengths[p, g]] = 1.0
    logp = -rng.exponential(1.0, size=(P, G, T))
    old_logp = logp + rng.normal(0.0, 0.4, size=(P, G, T))  # ratios on both sides of the clip range
    old_logp[4] = logp[4] + rng.normal(0.0, 0.01, size=(G, T))  # near on-policy: inside the GSPO range
    rewards = rng.integers(0, 2, size=(P, G)).astype(np.float64)
    rewards[0] = 1.0  # zero variance
    rewards[1, :] = [0, 1, 1, 0][:G]
    rewards[2, :] = [1, 0, 0, 0][:G]
    rewards[3, :] = [0, 1, 0, 1][:G]
    return logp, old_logp, mask, rewards


# ---- numpy references (loops) ---------------------------------------------------------

def np_advantages(rewards, norm, zero_var_filter, eps=1e-6):
    P, G = rewards.shape
    keep = np.ones(P)
    if zero_var_filter:
        for p in range(P):
            keep[p] = float(max(rewards[p]) > min(rewards[p]))
    adv = np.zeros((P, G))
    for p in range(P):
        mean = sum(rewards[p]) / G
        for g in range(G):
            adv[p, g] = rewards[p, g] - mean
    if norm == "group":
        for p in range(P):
            mean = sum(rewards[p]) / G
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards[p]) / G)
            adv[p] /= std + eps
    elif norm == "batch":
        vals = [adv[p, g] for p in range(P) for g in range(G) if keep[p]]
        m = sum(vals) / max(len(vals), 1)
        std = math.sqrt(sum((v - m) ** 2 for v in vals) / max(len(vals), 1))
        adv /= std + eps
    return adv * keep[:, None], keep


def np_weights(mask, keep, aggregation):
    """w[p,g,t] such that the aggregated loss is sum w * per-token value (w independent of logp)."""
    P, G, T = mask.shape
    w = np.zeros_like(mask)
    if aggregation == "prompt":
        n_kept = max(keep.sum(), 1.0)
        for p in range(P):
            n_tok = mask[p].sum()
            if keep[p] and n_tok > 0:
                w[p] = mask[p] / n_tok / n_kept
    elif aggregation == "sample":
        count = sum(1 for p in range(P) for g in range(G) if keep[p] and mask[p, g].sum() > 0)
        for p in range(P):
            for g in range(G):
                if keep[p] and mask[p, g].sum() > 0:
                    w[p, g] = mask[p, g] / mask[p, g].sum() / max(count, 1)
    elif aggregation == "token":
        total = sum(mask[p].sum() for p in range(P) if keep[p])
        for p in range(P):
            if keep[p]:
                w[p] = mask[p] / max(total, 1.0)
    return w


def _clipped_surrogate(r, a, lo, hi):
    """-min(r a, clip(r, lo, hi) a) and its derivative with respect to r."""
    unclipped, clipped = r * a, min(max(r, lo), hi) * a
    if unclipped <= clipped:
        return -unclipped, -a
    return -clipped, (-a if lo < r < hi else 0.0)


def np_token_loss(name, logp, old_logp, adv, mask, hp):
    """Per-token values v[p,g,t] and dv[p,g,t,t'] = d v[p,g,t] / d logp[p,g,t']."""
    P, G, T = logp.shape
    v, dv = np.zeros((P, G, T)), np.zeros((P, G, T, T))
    for p in range(P):
        for g in range(G):
            a = adv[p, g]
            if name == "gspo":
                n = max(mask[p, g].sum(), 1.0)
                s = math.exp(sum((logp[p, g, t] - old_logp[p, g, t]) * mask[p, g, t] for t in range(T)) / n)
                val, d_ds = _clipped_surrogate(s, a, 1 - hp["gspo_eps_low"], 1 + hp["gspo_eps_high"])
                for t in range(T):
                    v[p, g, t] = val
                    for u in range(T):
                        dv[p, g, t, u] = d_ds * s * mask[p, g, u] / n
                continue
            for t in range(T):
                lp = logp[p, g, t]
                rho = math.exp(lp - old_logp[p, g, t])
                if name == "cispo":
                    wgt = min(rho, hp["eps_max"])
                    v[p, g, t], dv[p, g, t, t] = -wgt * a * lp, -wgt * a
                elif name == "ppo_clip":
                    val, d_drho = _clipped_surrogate(rho, a, 1 - hp["eps_low"], 1 + hp["eps_high"])
                    v[p, g, t], dv[p, g, t, t] = val, d_drho * rho
                elif name == "reinforce":
                    v[p, g, t], dv[p, g, t, t] = -a * lp, -a
                if hp.get("kl_coef"):
                    d = old_logp[p, g, t] - lp
                    v[p, g, t] += hp["kl_coef"] * (math.exp(d) - d - 1.0)
                    dv[p, g, t, t] += hp["kl_coef"] * (1.0 - math.exp(d))
    return v, dv


def np_loss_and_grad(name, aggregation, logp, old_logp, adv, keep, mask, hp):
    v, dv = np_token_loss(name, logp, old_logp, adv, mask, hp)
    w = np_weights(mask, keep, aggregation)
    P, G, T = logp.shape
    total, grad = 0.0, np.zeros_like(logp)
    for p in range(P):
        for g in range(G):
            for t in range(T):
                total += w[p, g, t] * v[p, g, t]
                for u in range(T):
                    grad[p, g, u] += w[p, g, t] * dv[p, g, t, u]
    return total, grad


# ---- the JAX functions under test -------------------------------------------------------

def jax_loss_and_grad(name, aggregation, logp, old_logp, adv, keep, mask, hp):
    kl = hp.get("kl_coef", 0.0)

    def loss_fn(lp):
        per_tok = losses.LOSSES[name](lp, jnp.asarray(old_logp), jnp.asarray(adv), jnp.asarray(mask), **hp)
        if kl:
            per_tok = per_tok + kl * losses.kl_k3(lp, jnp.asarray(old_logp))
        return losses.aggregate(aggregation, per_tok, jnp.asarray(mask), jnp.asarray(keep))

    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
    return float(value), np.asarray(grad)


LOSS_CASES = {
    "ppo_sym": ("ppo_clip", dict(eps_low=0.2, eps_high=0.2)),  # GRPO
    "ppo_asym": ("ppo_clip", dict(eps_low=0.2, eps_high=0.26)),  # DAPO
    "gspo": ("gspo", dict(gspo_eps_low=3e-4, gspo_eps_high=4e-4)),  # the paper's small range
    "gspo_wide": ("gspo", dict(gspo_eps_low=0.05, gspo_eps_high=0.1)),
    "reinforce": ("reinforce", {}),
    "cispo": ("cispo", dict(eps_max=1.2)),  # a low cap, so it binds often
    "cispo_kl": ("cispo", dict(eps_max=4.0, kl_coef=0.3)),
}


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_and_aggregation_value_and_grad(case, aggregation):
    name, hp = LOSS_CASES[case]
    for seed, norm, zv in ((0, "batch", True), (1, "group", False), (2, "none", True)):
        logp, old_logp, mask, rewards = ragged(seed)
        adv, keep = np_advantages(rewards, norm, zv)
        ref_v, ref_g = np_loss_and_grad(name, aggregation, logp, old_logp, adv, keep, mask, hp)
        v, g = jax_loss_and_grad(name, aggregation, logp, old_logp, adv, keep, mask, hp)
        assert np.isclose(v, ref_v, rtol=1e-10, atol=1e-12), (seed, v, ref_v)
        np.testing.assert_allclose(g, ref_g, rtol=1e-9, atol=1e-12)
        assert np.all(g[mask == 0] == 0.0)  # padding never gets a gradient


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_per_token_aggregation_weights_match_loops(aggregation):
    """rl_step trains with sum(w * loss) (exact over microbatches): the same weights as the loops."""
    for seed, zv in ((0, True), (1, False)):
        _, _, mask, rewards = ragged(seed)
        _, keep = np_advantages(rewards, "batch", zv)
        with jax.enable_x64(True):
            w = np.asarray(losses.aggregation_weights(aggregation, jnp.asarray(mask), jnp.asarray(keep)))
        np.testing.assert_allclose(w, np_weights(mask, keep, aggregation), rtol=1e-12, atol=1e-15)


def test_clip_branches_are_exercised():
    """The batches really contain ratios inside and outside each clip range."""
    logp, old_logp, mask, _ = ragged(0)
    rho = np.exp(logp - old_logp)[mask > 0]
    assert (rho > 1.26).any() and (rho < 0.8).any() and ((rho > 0.8) & (rho < 1.2)).any()
    n = np.maximum(mask.sum(-1), 1)
    s = np.exp(((logp - old_logp) * mask).sum(-1) / n)[mask.sum(-1) > 0]
    assert ((s > 0.95) & (s < 1.1)).any() and ((s < 0.95) | (s > 1.1)).any()


@pytest.mark.parametrize("norm", ["batch", "group", "none"])
@pytest.mark.parametrize("zero_var_filter", [True, False])
def test_advantage_normalizations_match_loops(norm, zero_var_filter):
    for seed in range(3):
        _, _, _, rewards = ragged(seed)
        adv, keep = losses.advantages(jnp.asarray(rewards), norm=norm, zero_var_filter=zero_var_filter)
        ref_adv, ref_keep = np_advantages(rewards, norm, zero_var_filter)
        np.testing.assert_allclose(keep, ref_keep)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)


def test_dr_grpo_advantage_is_unnormalized_and_group_std_is_per_prompt():
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, _ = losses.advantages(jnp.asarray(rewards), norm="none")
    np.testing.assert_allclose(adv, [[0.75, -0.25, -0.25, -0.25], [0.5, 0.5, -0.5, -0.5]], atol=1e-6)
    adv, _ = losses.advantages(jnp.asarray(rewards), norm="group")
    np.testing.assert_allclose(np.asarray(adv).std(1), [1.0, 1.0], atol=1e-4)  # unit std in every prompt


def test_kl_k3_value_and_grad():
    rng = np.random.default_rng(5)
    logp, ref = -rng.exponential(1.0, 50), -rng.exponential(1.0, 50)
    with jax.enable_x64(True):
        v = np.asarray(losses.kl_k3(jnp.asarray(logp), jnp.asarray(ref)))
        g = np.asarray(jax.grad(lambda lp: losses.kl_k3(lp, jnp.asarray(ref)).sum())(jnp.asarray(logp)))
    for i in range(50):
        d = ref[i] - logp[i]
        assert math.isclose(v[i], math.exp(d) - d - 1.0, rel_tol=1e-12, abs_tol=1e-15)
        assert math.isclose(g[i], 1.0 - math.exp(d), rel_tol=1e-12, abs_tol=1e-15)
    assert (v >= 0).all()
    with jax.enable_x64(True):
        assert float(losses.kl_k3(jnp.asarray(logp), jnp.asarray(logp)).sum()) == 0.0


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_clipped_tokens_are_those_without_an_unclipped_gradient(case):
    """losses.clipped marks the tokens whose importance weight the active loss clips: a loop
    over the loss's own rule (CISPO: rho > eps_max; PPO: flat side of the surrogate in the
    advantage's direction; GSPO: the same with the sequence ratio; REINFORCE: none)."""
    name, hp = LOSS_CASES[case]
    logp, old_logp, mask, rewards = ragged(0)
    adv, _ = np_advantages(rewards, "batch", False)
    P, G, T = logp.shape
    ref = np.zeros_like(mask)
    for p in range(P):
        for g in range(G):
            n = max(mask[p, g].sum(), 1)
            seq = math.exp(sum((logp[p, g, t] - old_logp[p, g, t]) * mask[p, g, t] for t in range(T)) / n)
            a = adv[p, g]
            for t in range(T):
                rho = math.exp(logp[p, g, t] - old_logp[p, g, t])
                if name == "cispo":
                    c = rho > hp["eps_max"]
                elif name == "ppo_clip":
                    c = (a > 0 and rho > 1 + hp["eps_high"]) or (a < 0 and rho < 1 - hp["eps_low"])
                elif name == "gspo":
                    c = (a > 0 and seq > 1 + hp["gspo_eps_high"]) or (a < 0 and seq < 1 - hp["gspo_eps_low"])
                else:
                    c = False
                ref[p, g, t] = float(c) * mask[p, g, t]
    hp = {k: v for k, v in hp.items() if k != "kl_coef"}
    with jax.enable_x64(True):
        got = np.asarray(losses.clipped(name, jnp.asarray(logp), jnp.asarray(old_logp), jnp.asarray(adv),
                                        jnp.asarray(mask), **hp))
    np.testing.assert_array_equal(got, ref)
    if case in ("cispo", "ppo_sym", "ppo_asym"):
        assert 0 < ref.sum() < mask.sum()  # both outcomes occur
