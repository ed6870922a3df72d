"""Train a policy with RL: `python launch/run.py --config=configs/tiny.py --workdir=DIR`.

Re-running the same command on the same workdir resumes from its latest checkpoint.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py"),
    "Experiment config file, optionally with an arg: configs/tiny.py:recipe=dapo", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rl_scaling/tiny", "Where checkpoints, logs and metrics.jsonl go.")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(absl_logging.WARNING)
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from configs import common
    from rl_scaling import train  # after flags: jax reads its env at import

    deviations = common.recipe_deviations(_CONFIG.value)
    if deviations:
        logging.warning("this run is labelled recipe=%r but differs from it in %s; select a recipe with "
                        "--config=configs/tiny.py:recipe=NAME, and label an ablation with --config.recipe=LABEL "
                        "(the fitter groups seeds by that label)", _CONFIG.value.recipe, ", ".join(deviations))
    result = train.train(_CONFIG.value, _WORKDIR.value)
    print("done:", {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})


if __name__ == "__main__":
    app.run(main)
