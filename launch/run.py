"""Train a policy with RL: `python launch/run.py --config=configs/tiny.py --workdir=DIR`.

Re-running the same command on the same workdir resumes from its latest checkpoint.
On a slice with several hosts run the same command on every host: it joins them with
jax.distributed first (rl_scaling/distributed.py says how each environment is detected), and
only process 0 logs and writes metrics.

`--dry_run` compiles the config's train and generation steps for its TPU slices
(config.tpu) on this machine, TPU or not, prints per-chip HBM, FLOPs and time estimates, and
exits non-zero when a step does not fit (rl_scaling/dry_run.py).

Exit status: 0 done; 75 (EX_TEMPFAIL) stopped by SIGTERM/SIGINT after saving the step it was on
(re-run to resume; rl_scaling/preemption.py); 128 + N killed by a second signal N, or when the
save took longer than config.preemption_grace_s; 1 an error (the message names it: another
trainer holds the workdir, a checkpoint could not be saved, a bad config, ...).
"""

import glob
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


def _surely_process_0() -> bool:
    """Whether this process is process 0 of its run, decided without jax (rl_scaling/distributed.py:
    a coordinator with RL_SCALING_PROCESS_ID=0, or one process and no TPU slice to join)."""
    if os.environ.get("RL_SCALING_COORDINATOR", "").strip():
        return os.environ.get("RL_SCALING_PROCESS_ID", "").strip() == "0"
    switch = os.environ.get("RL_SCALING_DISTRIBUTED", "").strip()
    return switch == "0" or (switch != "1" and not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"))


def _lock_or_exit(lock):
    try:
        lock.acquire(_WORKDIR.value)
    except lock.LockHeld as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - OSError locally; client/network errors on gs://
        print(f"error: --workdir={_WORKDIR.value} is not writable: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(absl_logging.WARNING)
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("rl_scaling").setLevel(logging.INFO)  # resume and fall-back lines (absl lowers the root)
    if _DRY_RUN.value:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for config.tpu's slices; needs no accelerator
        from rl_scaling import dry_run

        try:
            print(dry_run.summary(dry_run.run(_CONFIG.value, steps=tuple(_DRY_RUN_STEPS.value))))
        except (dry_run.DoesNotFit, dry_run.DryRunError) as e:
            print(f"dry run failed: {e}", file=sys.stderr)
            sys.exit(1)
        return
    from rl_scaling import lock

    if _surely_process_0():  # lock before importing jax: a second trainer on this workdir stops within seconds
        _lock_or_exit(lock)
    from configs import common
    from rl_scaling import distributed  # after flags: jax reads its env at import

    if distributed.initialize() and not distributed.is_main():
        logging.getLogger().setLevel(logging.ERROR)  # process 0 logs for the run
        logging.getLogger("rl_scaling").setLevel(logging.ERROR)
    if distributed.is_main():
        _lock_or_exit(lock)  # held already unless this is a TPU slice's process 0
    from rl_scaling import checkpoint, preemption, train

    deviations = common.recipe_deviations(_CONFIG.value)
    if deviations:
        logging.warning("this run is labelled recipe=%r but differs from it in %s; select a recipe with "
                        "--config=configs/tiny.py:recipe=NAME, and label an ablation with --config.recipe=LABEL "
                        "(the fitter groups seeds by that label)", _CONFIG.value.recipe, ", ".join(deviations))
    try:
        result = train.train(_CONFIG.value, _WORKDIR.value)
    except preemption.Preempted as e:
        print(f"preempted: {e}", file=sys.stderr, flush=True)
        sys.exit(preemption.EXIT_PREEMPTED)
    except (checkpoint.CheckpointSaveError, lock.LockHeld) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if distributed.is_main():
        print("done:", {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})


if __name__ == "__main__":
    app.run(main)
