"""Tiny ScaleRL run on graded synthetic arithmetic: the embedded default, one CPU machine.

Command:   python launch/run.py --config=configs/tiny.py --workdir=/tmp/tiny
Variants:  --config=configs/tiny.py:recipe=dapo   (any name in configs/common.py RECIPES)
           --config=configs/tiny.py:recipe=grpo,seed=1,samples=76800,evals=12,prompts=64
           samples: the RL budget in generated samples (default 256k = 1000 ScaleRL steps of
           32 x 8); steps = samples / (prompts_per_step x samples_per_prompt), so recipes with
           bigger batches (PPO-off-policy-8: 8x) get fewer steps for the same compute. evals:
           held-out evaluations over the run (eval_every = steps / evals). prompts: prompts per
           update (default 32; the batch-size axis), samples a step = prompts x 8.
           Recipes: python launch/sweep.py --config=configs/tiny.py --recipes=scalerl,grpo --seeds=2
Hardware:  2 CPU cores, a few minutes end to end (warm start included).
Expected:  a ~0.2M-parameter policy; held-out pass rate (mean@4, temperature 1) rises
           from ~0.15 after the supervised warm start to ~0.5-0.7, below 1.0 because the
           multiplication levels stay out of reach.
"""

from configs import common


def get_config(arg=None):
    args = common.parse_arg(arg)
    config = common.base_config()
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
        raise ValueError(f"unknown config arg(s) {sorted(args)}; valid: recipe, seed, samples, evals, prompts")
    return config
