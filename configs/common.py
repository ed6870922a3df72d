"""Shared config pieces: the defaults every experiment starts from and the recipes table.

An experiment file (tiny.py, dense_8b.py, scout_moe.py) builds on `base_config()`,
sets its sizes and applies a recipe by name with `apply_recipe`.
"""

from __future__ import annotations

import ml_collections


def _recipe(loss, clip, aggregation, adv_norm, zero_var, npr, length_control, fp32_heads, k, batch_scale=1.0):
    out = {"rl.loss": loss, "rl.aggregation": aggregation, "rl.adv_norm": adv_norm, "rl.zero_var_filter": zero_var,
           "rl.no_positive_resampling": npr, "rollout.length_control": length_control,
           "rollout.dynamic_sampling": False, "rollout.fp32_lm_head": fp32_heads, "rl.fp32_lm_head": fp32_heads,
           "rl.num_minibatches": k, "rl.kl_coef": 0.0, "batch_scale": batch_scale}
    if clip is not None:
        out["rl.eps_low"], out["rl.eps_high"] = clip
    return out


# docs/paper.md section 3, "Comparison recipes as the paper ran them"; (?) = our reading where the
# paper is silent. Select one with `--config=configs/tiny.py:recipe=NAME`; every switch stays
# overridable for the leave-one-out ablations (`--config.rl.no_positive_resampling=False`, ...;
# give an ablation its own label with `--config.recipe=LABEL`: the fitter groups seeds by it).
#
# Batch: the size preset's rollout.prompts_per_step is ScaleRL's batch per update (paper 48
# prompts x 16 = 768 samples; tiny 32 x 8). batch_scale scales it (DAPO, MiniMax: 1280 / 768
# samples, read as per update (?)), and PPO-off-policy-k generates k times that per step,
# trained as rl.num_minibatches = k updates (apply_recipe sets prompts_per_step).
# Off-policy: the paper runs ScaleRL (PipelineRL-8) and Magistral (PipelineRL) with
# rollout.mode="pipeline". The table keeps both synchronous and on-policy (k = 1; PipelineRL-k's
# ideal limit): a synchronous run resumes exactly (a pipeline drops the groups in flight at a
# checkpoint), and the tiny CPU comparison should not mix schemes. `--config.rollout.mode=pipeline`
# runs them as in the paper (the engine does forced interruption; rollout.max_staleness = k).
# DAPO: the paper's DAPO drops zero-variance prompts from the loss; DAPO's own dynamic sampling
# and overlong penalty are `--config.rollout.dynamic_sampling=True --config.rollout.length_control=overlong`.
# MiniMax: "PPO-off-policy" with k unstated, 8 here (?); its advantage normalization is per prompt
# (batch-level is ScaleRL's change). Magistral: "as DAPO" for loss and normalization (?).
# Model precision: the FP32 LM-head switches matter only with a bfloat16 body
# (`--config.model.dtype=bfloat16`, the full-scale presets); the tiny preset runs in float32.
RECIPES = {
    #                    loss        PPO clip     aggreg.   adv norm  zero-var NPR    length ctl   fp32  k  batch
    "scalerl":   _recipe("cispo",    None,        "prompt", "batch", True,  True,  "interrupt", True,  1),
    "minimax":   _recipe("cispo",    None,        "prompt", "group", True,  False, "none",      True,  8, 1280 / 768),
    "dapo":      _recipe("ppo_clip", (0.2, 0.26), "prompt", "group", True,  False, "none",      False, 8, 1280 / 768),
    "grpo":      _recipe("ppo_clip", (0.2, 0.2),  "sample", "group", False, False, "none",      False, 8),
    "magistral": _recipe("ppo_clip", (0.2, 0.26), "prompt", "group", True,  False, "none",      False, 1),
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
    c.preemption_grace_s = 60.0  # SIGTERM/SIGINT: finish the step and save within this, else exit at once
    c.init_checkpoint = ""  # Orbax params checkpoint to start RL from; empty = warm start here

    # name: arithmetic (synthetic, embedded) or jsonl_math (path: JSONL of {problem, answer};
    # tokenizer: a tokenizer.json; heldout_fraction of problems held out by hash).
    c.task = ml_collections.ConfigDict(dict(name="arithmetic", max_prompt_len=16, path="", tokenizer="",
                                            heldout_fraction=0.02))

    # preset: a name in rl_scaling/policy/presets.py (dense_8b, scout); its other fields then
    # override the preset's (configs/dense_8b.py). "" = the explicit fields below (tiny).
    c.model = ml_collections.ConfigDict(dict(
        preset="",
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=192,
        rope_theta=10000.0, norm_eps=1e-5, dtype="float32", param_dtype="float32", tie_embeddings=False,
        remat=False, scan_layers=False, num_experts=0, num_experts_per_tok=1, moe_mlp_dim=0, shared_expert=True,
        # MoE shapes the mesh does not divide make every device gather all routed experts' weights per
        # layer (Scout: ~4 GB): "error" stops naming the shapes and fields to change, "warn" logs the cost.
        moe_indivisible="warn",
    ))

    c.rollout = ml_collections.ConfigDict(dict(
        prompts_per_step=32,
        samples_per_prompt=8,
        max_new_tokens=16,
        temperature=1.0,
        fp32_lm_head=True,  # generator's LM head in float32 (ScaleRL)
        # The sync sampler's decode loop runs in this many segments over a KV cache grown between
        # them, so attention reads the slots written so far, not the whole budget (same tokens).
        # At a segment's end the grown copy and the old cache coexist: 1 keeps one full-size cache.
        cache_segments=4,
        # Off-policy scheme. "sync": generate, then train (PPO-off-policy-k is sync with
        # rl.num_minibatches=k and prompts_per_step = k x prompts per minibatch).
        # "pipeline": PipelineRL-k (rl_scaling/rollout/pipeline.py), JetStream engine.
        mode="sync",
        max_staleness=8,  # k: the trainer never trains on data more than k versions old
        stale_policy="wait",  # "wait": admit prompts so none gets stale; "drop": drop stale groups
        queue_size=0,  # prompt groups generated ahead (in flight + ready); 0 = 2 x prompts_per_step
        server="",  # host:port of `launch/serve.py`; "" = engine in this process
        servers="",  # "HOST:PORT,HOST:PORT,...": M `launch/serve.py` engine replicas (failover between them)
        token_file="",  # the rollout servers' shared secret ("" = $RL_SCALING_ROLLOUT_TOKEN, or none)
        weights_dir="",  # "" = push weights over gRPC; a directory (gs:// too) the trainer writes, replicas poll
        # dtype of the weights sent to the engines (cast on the trainer's devices): "" = the params' own
        # (bit-exact), "bfloat16" halves the bytes; the LM head stays float32 with fp32_lm_head
        push_dtype="",
        ledger=False,  # write WORKDIR/rollout_ledger/*.jsonl: the group ids and prompts of every batch
        engine_slots=0,  # max concurrent decodes of the engine; 0 = prompts_per_step x samples_per_prompt
        # Devices (the last ones) the in-process engine gets to itself; the trainer keeps the rest.
        # 0 = the engine shares the trainer's first device (its computations then queue behind the
        # trainer's). On CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2 and engine_devices=1.
        engine_devices=0,
        reconnect_s=10.0,  # how long the trainer waits for a lost rollout server before stopping
        # Length control (rollout/length_control.py): "none" (truncate at max_new_tokens),
        # "interrupt" (ScaleRL's forced interruption), "overlong" (DAPO's penalty, rl.overlong_*).
        # Tiny values: thinking is 6 tokens, so a budget of 7-8 interrupts only rambling samples
        # (paper: U[10k, 12k], answer 2k, a 20-token phrase; hi + phrase + answer <= max_new_tokens).
        length_control="interrupt",
        think_budget_lo=7, think_budget_hi=8,  # per-sample budget ~ U{lo..hi} thinking tokens
        interrupt_phrase="</think>",  # injected as tokens (zero loss weight); must end with </think>
        answer_budget=7,  # sampled tokens allowed after the phrase
        dynamic_sampling=False,  # DAPO: regenerate until the step has P groups with mixed rewards
        dynamic_sampling_rounds=4,  # at most this many extra generation rounds per step
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
        grad_accum=1,  # microbatches per update (memory only: the gradient is the same)
        logprob_chunk=0,  # >0: LM head + log-softmax over this many positions at a time
        temperature=1.0,
        kl_coef=0.0,
        fp32_lm_head=True,  # trainer's LM head in float32 (ScaleRL)
        no_positive_resampling=True,  # drop prompts for good once a sampling's pass rate >= npr_threshold
        npr_threshold=0.9,
        overlong_max_len=0,  # DAPO L_max (0: rollout.max_new_tokens), with length_control="overlong"
        overlong_cache=2,  # DAPO L_cache: the penalty ramps over the last L_cache tokens
        # MoE routing replay (rl/train_step.py): "off"; "r2" replays the trainer's own pre-update routing
        # in the k updates of PPO-off-policy-k; "r3" replays the generator's recorded experts in every
        # trainer forward and backward (sync sampler only). Ignored by dense models.
        routing_replay="off",
    ))

    c.optim = ml_collections.ConfigDict(dict(
        lr=3e-4, warmup_steps=10, b1=0.9, b2=0.999, eps=1e-15, weight_decay=0.01, grad_clip=1.0,
    ))

    c.warmstart = ml_collections.ConfigDict(dict(
        max_steps=2000, batch_size=64, lr=1e-3, eval_every=50, target_pass_rate=0.15, probe_prompts=256,
    ))

    c.eval = ml_collections.ConfigDict(dict(num_prompts=256, samples_per_prompt=4, batch_size=1024))

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, expert=1))

    # gs:// I/O (rl_scaling/paths.py): every call ends within timeout_s (a StorageError naming the
    # path, the operation and the endpoint); a request silent for timeout_s / (1 + retries) is retried.
    c.storage = ml_collections.ConfigDict(dict(timeout_s=120.0, retries=2))

    # TPU slices for `launch/run.py --dry_run` (rl_scaling/dry_run.py): the trainer's slice (its
    # mesh is c.mesh), the generators' slice and its mesh (data = independent engine replicas,
    # each running rollout.engine_slots concurrent decodes), e.g. "v5p:2x2x4". hbm_gib: per-chip
    # capacity override (0 = the chip's). Empty topologies: no dry run.
    c.tpu = ml_collections.ConfigDict(dict(
        train_topology="", gen_topology="", gen_mesh=dict(data=-1, fsdp=1, tensor=1, expert=1), hbm_gib=0.0,
    ))
    return c


def apply_recipe(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(sorted(RECIPES))}")
    config.recipe = name
    overrides = dict(RECIPES[name])
    batch_scale = overrides.pop("batch_scale", 1.0)
    for dotted, value in overrides.items():
        section, field = dotted.split(".")
        config[section][field] = value
    per_update = max(1, round(config.rollout.prompts_per_step * batch_scale))
    config.rollout.prompts_per_step = per_update * config.rl.num_minibatches
    return config


def recipe_deviations(config: ml_collections.ConfigDict) -> list[str]:
    """Switches where a config labelled with a recipe's name differs from that recipe (a run
    labelled 'dapo' that is not DAPO would be pooled with real DAPO runs by the fitter)."""
    recipe = RECIPES.get(config.recipe)
    if recipe is None:  # a custom label, e.g. an ablation's
        return []
    out = []
    for dotted, value in recipe.items():
        if "." in dotted:
            section, field = dotted.split(".")
            if config[section][field] != value:
                out.append(f"{dotted}={config[section][field]!r} (recipe: {value!r})")
    return out


def parse_arg(arg: str | None) -> dict:
    """`--config=configs/tiny.py:recipe=dapo,seed=1` -> {"recipe": "dapo", "seed": "1"}."""
    out = {}
    for part in filter(None, (arg or "").split(",")):
        if "=" not in part:
            raise ValueError(f"config arg {part!r} must look like key=value (e.g. recipe=dapo)")
        key, value = part.split("=", 1)
        out[key.strip()] = value.strip()
    return out
