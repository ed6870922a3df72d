"""Train a policy with RL: `python launch/run.py --config=configs/tiny.py --workdir=DIR`.

Re-running the same command on the same workdir resumes from its latest checkpoint.
On a slice with several hosts run the same command on every host: it joins them with
jax.distributed first (rl_scaling/distributed.py says how each environment is detected), and
only process 0 logs and writes metrics.

`--dry_run` compiles the config's train and generation steps for its TPU slices
(config.tpu) on this machine, TPU or not, prints per-chip HBM, FLOPs and time estimates, and
exits non-zero when a step does not fit (rl_scaling/dry_run.py).
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
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rl_scaling/tiny", "Where checkpoints, logs and metrics.jsonl go: a "
                               "local path or gs://BUCKET/PATH (STORAGE_EMULATOR_HOST=http://HOST:PORT for an emulator).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the steps for config.tpu's slices ahead of time and "
                             "check they fit in HBM; train nothing.")
_DRY_RUN_STEPS = flags.DEFINE_list("dry_run_steps", ["train", "generation"], "What --dry_run compiles.")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(absl_logging.WARNING)
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if _DRY_RUN.value:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for config.tpu's slices; needs no accelerator
        from rl_scaling import dry_run

        try:
            print(dry_run.summary(dry_run.run(_CONFIG.value, steps=tuple(_DRY_RUN_STEPS.value))))
        except (dry_run.DoesNotFit, dry_run.DryRunError) as e:
            print(f"dry run failed: {e}", file=sys.stderr)
            sys.exit(1)
        return
    from configs import common
    from rl_scaling import distributed, train  # after flags: jax reads its env at import

    if distributed.initialize() and not distributed.is_main():
        logging.getLogger().setLevel(logging.ERROR)  # process 0 logs for the run

    deviations = common.recipe_deviations(_CONFIG.value)
    if deviations:
        logging.warning("this run is labelled recipe=%r but differs from it in %s; select a recipe with "
                        "--config=configs/tiny.py:recipe=NAME, and label an ablation with --config.recipe=LABEL "
                        "(the fitter groups seeds by that label)", _CONFIG.value.recipe, ", ".join(deviations))
    result = train.train(_CONFIG.value, _WORKDIR.value)
    if distributed.is_main():
        print("done:", {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})


if __name__ == "__main__":
    app.run(main)
