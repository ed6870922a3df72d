"""Tiny ScaleRL run on graded synthetic arithmetic: the embedded default, one CPU machine.

Command:   python launch/run.py --config=configs/tiny.py --workdir=/tmp/tiny
Variants:  --config=configs/tiny.py:recipe=dapo   (any name in configs/common.py RECIPES)
Hardware:  2 CPU cores, a few minutes end to end (warm start included).
Expected:  a ~0.2M-parameter policy; held-out pass rate (mean@4, temperature 1) rises
           from ~0.15 after the supervised warm start to ~0.5-0.7, below 1.0 because the
           multiplication levels stay out of reach.
"""

from configs import common


def get_config(arg=None):
    args = common.parse_arg(arg)
    config = common.base_config()
    common.apply_recipe(config, args.pop("recipe", "scalerl"))
    config.steps = 1000
    config.eval_every = 50
    config.checkpoint_every = 50
    if "seed" in args:
        config.seed = int(args.pop("seed"))
    if args:
        raise ValueError(f"unknown config arg(s) {sorted(args)}; valid: recipe, seed")
    return config
