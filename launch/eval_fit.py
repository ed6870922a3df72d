"""Eval-and-fit loop: watch a training workdir's checkpoints, evaluate each new one on the
held-out set, refit the sigmoid law, log A, B, C_mid and the predicted pass rate.

    python launch/eval_fit.py --workdir=DIR [--target_compute=3e13] [--axis=flops] [--once]

Runs beside the trainer (another process, machine or slice that sees DIR): it only reads
the checkpoints, so the trainer never waits on it. Results go to DIR/eval_fit/:
evals.jsonl (one line per evaluated checkpoint; a restart skips those already there),
fit.json (the latest fit) and tb/ (TensorBoard scalars fit/A, fit/B, fit/C_mid,
fit/predicted_pass_rate, eval/pass_rate against the step). The warm-start params, when
present, are evaluated as the compute-0 point that gives R0.
"""

import json
import logging
import time


from absl import app, flags, logging as absl_logging

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
_TARGET = flags.DEFINE_float("target_compute", None, "Compute at which to predict the pass rate (axis units).")
_AXIS = flags.DEFINE_enum("axis", "flops", ["flops", "accel_hours", "steps"], "Compute axis of the fit.")
_POLL = flags.DEFINE_float("poll_seconds", 10.0, "How often to look for new checkpoints.")
_ONCE = flags.DEFINE_bool("once", False, "Evaluate what is there, fit, and exit.")
_TIMEOUT = flags.DEFINE_float("idle_timeout", 3600.0, "Exit after this long without a new checkpoint.")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    absl_logging.set_verbosity(absl_logging.WARNING)
    import jax
    import ml_collections
    import orbax.checkpoint as ocp
    from tensorboardX import SummaryWriter

    from rl_scaling import evaluate, metrics as metrics_lib, paths, train
    from rl_scaling.scaling import api

    workdir = paths.resolve(_WORKDIR.value)  # local or gs://
    config_path = paths.join(workdir, "config.json")
    if not paths.exists(config_path):
        raise SystemExit(f"{config_path} not found: is --workdir a training run's workdir?")
    config = ml_collections.ConfigDict(json.loads(paths.read_text(config_path)))
    out_dir = paths.join(workdir, "eval_fit")
    paths.makedirs(out_dir)
    evals_path = paths.join(out_dir, "evals.jsonl")
    done = {}
    if paths.exists(evals_path):
        done = {r["step"]: r for r in metrics_lib.read_records(evals_path)}  # a torn last line is dropped
        paths.write_text(evals_path, "".join(json.dumps(r) + "\n" for r in done.values()))  # and not kept

    mesh, task, gen_cfg, problems, abstract = evaluate.from_workdir_config(config)
    manager = ocp.CheckpointManager(paths.path(paths.join(workdir, "checkpoints")), item_names=("state", "meta"),
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    tb = SummaryWriter(paths.join(out_dir, "tb"))

    def evaluate_params(params, step):
        return evaluate.pass_rate(params, gen_cfg, task, problems, samples_per_prompt=config.eval.samples_per_prompt,
                                  batch_size=config.eval.batch_size, rng=jax.random.fold_in(jax.random.key(config.seed + 2), step),
                                  max_prompt_len=config.task.max_prompt_len, max_new_tokens=config.rollout.max_new_tokens,
                                  temperature=config.rollout.temperature)

    def record(row):
        done[row["step"]] = row  # the whole file is rewritten: gs:// objects cannot be appended to
        paths.write_text(evals_path, "".join(json.dumps(r) + "\n" for r in done.values()))
        tb.add_scalar("eval/pass_rate", row["pass_rate"], row["step"])

    warm = paths.join(workdir, "warmstart", "params")
    start = warm if paths.isdir(warm) else config.init_checkpoint  # the policy RL started from
    if 0 not in done and start:
        params = train.load_start_params(start, gen_cfg, mesh, abstract["params"])
        ev = evaluate_params(params, 0)
        record({"step": 0, "compute_flops": 0.0, "accel_seconds": 0.0, "pass_rate": ev["pass_rate"]})

    axis_key = {"flops": "compute_flops", "accel_hours": "accel_seconds", "steps": "step"}[_AXIS.value]
    scale = 1 / 3600.0 if _AXIS.value == "accel_hours" else 1.0
    last_new = time.time()
    while True:
        manager.reload()
        new_steps = [s for s in manager.all_steps() if s not in done]
        for step in sorted(new_steps):
            try:
                restored = manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - the trainer may have deleted it meanwhile
                logging.warning("skipping checkpoint %d: %s", step, str(e)[:200])
                continue
            ev = evaluate_params(restored["state"]["params"], step)
            meta = restored["meta"]
            record({"step": step, "compute_flops": meta["compute_flops"], "accel_seconds": meta["accel_seconds"],
                    "pass_rate": ev["pass_rate"]})
            last_new = time.time()
            records = [(r[axis_key] * scale, r["pass_rate"]) for r in sorted(done.values(), key=lambda r: r["step"])]
            fit = api.refit(records, target_compute=_TARGET.value)
            paths.write_text(paths.join(out_dir, "fit.json"), json.dumps(fit, indent=1, default=float))
            if fit["status"] == "ok":
                for key in ("A_fit", "B", "C_mid"):
                    tb.add_scalar(f"fit/{key}", fit[key], step)
                if fit.get("target"):
                    tb.add_scalar("fit/predicted_pass_rate", fit["target"]["pass_rate"], step)
            a_text = (f"A={fit['A']:.3f}" if fit.get("A") is not None else
                      f"A>={fit.get('A_lower_bound') or float('nan'):.3f} (not identifiable yet)")
            print(f"step {step}: pass rate {ev['pass_rate']:.3f}; fit {fit['status']}"
                  + (f" {a_text} B={fit['B']:.2f} C_mid={fit['C_mid']:.3g}" if fit["status"] == "ok" else ""), flush=True)
            tb.flush()
        finished = config.steps in done
        if _ONCE.value or finished or time.time() - last_new > _TIMEOUT.value:
            break
        time.sleep(_POLL.value)
    tb.close()


if __name__ == "__main__":
    app.run(main)
