"""Shared config pieces: the defaults every experiment starts from and the recipes table.

An experiment file (tiny.py, dense_8b.py, scout_moe.py) builds on `base_config()`,
sets its sizes and applies a recipe by name with `apply_recipe`.
"""

from __future__ import annotations

import ml_collections

# PAPER.md section 3: each recipe is a set of overrides on the ScaleRL defaults.
RECIPES = {
    "scalerl": {},
}


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.recipe = "scalerl"
    c.seed = 0
    c.steps = 100  # RL steps
    c.eval_every = 25
    c.checkpoint_every = 25
    c.log_every = 10
    c.keep_checkpoints = 3
    c.init_checkpoint = ""  # Orbax params checkpoint to start RL from; empty = warm start here

    c.task = ml_collections.ConfigDict(dict(name="arithmetic", max_prompt_len=16))

    c.model = ml_collections.ConfigDict(dict(
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=192,
        rope_theta=10000.0, norm_eps=1e-5, dtype="float32", param_dtype="float32", tie_embeddings=False,
        remat=False, num_experts=0, num_experts_per_tok=1, moe_mlp_dim=0, shared_expert=True,
    ))

    c.rollout = ml_collections.ConfigDict(dict(
        prompts_per_step=32,
        samples_per_prompt=8,
        max_new_tokens=16,
        temperature=1.0,
        fp32_lm_head=True,  # generator's LM head in float32 (ScaleRL)
        # Off-policy scheme. "sync": generate, then train (PPO-off-policy-k is sync with
        # rl.num_minibatches=k and prompts_per_step = k x prompts per minibatch).
        # "pipeline": PipelineRL-k (rl_scaling/rollout/pipeline.py), JetStream engine.
        mode="sync",
        max_staleness=8,  # k: the trainer never trains on data more than k versions old
        stale_policy="wait",  # "wait": admit prompts so none gets stale; "drop": drop stale groups
        queue_size=0,  # prompt groups generated ahead (in flight + ready); 0 = 2 x prompts_per_step
        server="",  # host:port of `launch/serve.py`; "" = engine in this process
        engine_slots=0,  # max concurrent decodes of the engine; 0 = prompts_per_step x samples_per_prompt
        reconnect_s=10.0,  # how long the trainer waits for a lost rollout server before stopping
    ))

    c.rl = ml_collections.ConfigDict(dict(
        loss="cispo",
        eps_max=4.0,  # CISPO importance-weight cap
        eps_low=0.2, eps_high=0.2,  # PPO clip range
        gspo_eps_low=3e-4, gspo_eps_high=4e-4,
        aggregation="prompt",
        adv_norm="batch",
        zero_var_filter=True,
        num_minibatches=1,  # PPO-off-policy-k: k minibatch updates per generated batch
        temperature=1.0,
        kl_coef=0.0,
        fp32_lm_head=True,  # trainer's LM head in float32 (ScaleRL)
    ))

    c.optim = ml_collections.ConfigDict(dict(
        lr=3e-4, warmup_steps=10, b1=0.9, b2=0.999, eps=1e-15, weight_decay=0.01, grad_clip=1.0,
    ))

    c.warmstart = ml_collections.ConfigDict(dict(
        max_steps=2000, batch_size=64, lr=1e-3, eval_every=50, target_pass_rate=0.15, probe_prompts=256,
    ))

    c.eval = ml_collections.ConfigDict(dict(num_prompts=256, samples_per_prompt=4, batch_size=1024))

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, expert=1))
    return c


def apply_recipe(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(sorted(RECIPES))}")
    config.recipe = name
    for dotted, value in RECIPES[name].items():
        section, field = dotted.split(".")
        config[section][field] = value
    return config


def parse_arg(arg: str | None) -> dict:
    """`--config=configs/tiny.py:recipe=dapo,seed=1` -> {"recipe": "dapo", "seed": "1"}."""
    out = {}
    for part in filter(None, (arg or "").split(",")):
        if "=" not in part:
            raise ValueError(f"config arg {part!r} must look like key=value (e.g. recipe=dapo)")
        key, value = part.split("=", 1)
        out[key.strip()] = value.strip()
    return out
