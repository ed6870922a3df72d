"""Tiny ScaleRL run on graded synthetic arithmetic: the embedded default, one CPU machine.

Command:   python launch/run.py --config=configs/tiny.py --workdir=/tmp/tiny
Variants:  --config=configs/tiny.py:recipe=dapo   (any name in configs/common.py RECIPES)
           --config=configs/tiny.py:recipe=grpo,seed=1,samples=76800,evals=12,prompts=64
           samples: the RL budget in generated samples (default 256k = 1000 ScaleRL steps of
           32 x 8); steps = samples / (prompts_per_step x samples_per_prompt), so recipes with
           bigger batches (PPO-off-policy-8: 8x) get fewer steps for the same compute. evals:
           held-out evaluations over the run (eval_every = steps / evals). prompts: prompts per
           update (default 32; the batch-size axis), samples a step = prompts x 8. size: the
           policy's width and depth, s (default, 0.1M parameters), m (0.44M) or l (1.5M): the
           model-size axis (SIZES below).
           Recipes: python launch/sweep.py --config=configs/tiny.py --recipes=scalerl,grpo --seeds=2
Hardware:  2 CPU cores, a few minutes end to end (warm start included).
Expected:  a 0.1M-parameter policy (106,816 parameters at size s); held-out pass rate (mean@4,
           temperature 1) rises from ~0.15 after the supervised warm start to ~0.5-0.7, below 1.0
           because the multiplication levels stay out of reach.
"""

from configs import common

# The model-size axis (`:size=NAME`): widths and depths of the policy, each ~4x the parameters of the
# one before (counted with the LM head and embeddings). Head dim 16 and 2 KV heads throughout.
SIZES = {
    "s": dict(d_model=64, n_layers=2, n_heads=4, mlp_dim=192),  # 106,816 parameters: the default
    "m": dict(d_model=96, n_layers=4, n_heads=6, mlp_dim=288),  # 443,232
    "l": dict(d_model=128, n_layers=8, n_heads=8, mlp_dim=384),  # 1,525,888
}


def param_count(size, vocab_size=64, head_dim=16, n_kv_heads=2):
    """Parameters of a tiny policy of this size (embeddings, LM head, RMSNorm scales included)."""
    d, L, H, F = (SIZES[size][k] for k in ("d_model", "n_layers", "n_heads", "mlp_dim"))
    per_layer = d * head_dim * (2 * H + 2 * n_kv_heads) + 3 * d * F + 2 * d
    return 2 * vocab_size * d + L * per_layer + d


def get_config(arg=None):
    args = common.parse_arg(arg)
    config = common.base_config()
    size = args.pop("size", "s")
    if size not in SIZES:
        raise ValueError(f"config arg size={size!r}: choose one of {sorted(SIZES)}")
    config.model.update(SIZES[size])
    prompts = int(args.pop("prompts", config.rollout.prompts_per_step))
    if prompts <= 0:
        raise ValueError(f"config arg prompts={prompts} must be positive")
    config.rollout.prompts_per_step = prompts  # the batch per update, before the recipe scales it
    common.apply_recipe(config, args.pop("recipe", "scalerl"))
    samples, evals = int(args.pop("samples", 1000 * 32 * 8)), int(args.pop("evals", 20))
    if samples <= 0 or evals <= 0:
        raise ValueError(f"config args samples={samples} and evals={evals} must be positive")
    # On CPU, 8 microbatches (of 32 sequences by default; the gradient is the same) keep the
    # activations in cache: twice the train step's speed of one 256-sequence batch.
    config.rl.grad_accum = 8
    per_step = config.rollout.prompts_per_step * config.rollout.samples_per_prompt
    config.steps = max(1, -(-samples // per_step))
    config.eval_every = config.checkpoint_every = max(1, config.steps // evals)
    if "seed" in args:
        config.seed = int(args.pop("seed"))
    if args:
        raise ValueError(f"unknown config arg(s) {sorted(args)}; valid: recipe, seed, samples, evals, prompts, size")
    return config
