"""Off-policy schemes end to end on the tiny RL loop: samples/s as ratios to synchronous, in one invocation.

    python launch/bench_modes.py --modes=sync,ppo8,pipeline8,remote8 [--steps=64] [--repeats=3] [--prompts=32]

Runs the tiny RL loop (launch/run.py's `train`, after one shared warm start) for each off-policy
scheme, each in a fresh process, and prints samples/s as a ratio to `sync` from the same invocation,
with the trainer's and the generator's idle fractions: sync (generate, then one update), ppo8
(PPO-off-policy-8: 8 x 32 prompts generated, 8 minibatch updates), pipeline8 (PipelineRL-8, JetStream
engine in the trainer's process on a second XLA CPU device), pipeline8_shared (the same on the
trainer's only device, where its computations queue behind the trainer's), remote8 (PipelineRL-8,
engine in a `launch/serve.py` process on loopback). The first quarter of the steps (compilation) is
not timed. --prompts sets the prompts per update (ppo8: 8 x that per generation), 32 as the tiny
config by default; tests use a few. Each process is pinned to 2 threads on XLA:CPU, as launch/bench.py's
CPU cases.
"""

import argparse
import json
import os
import subprocess
import sys
import time

try:  # two threads, as launch/bench.py's CPU cases (XLA sizes its pool from the affinity)
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
except (AttributeError, OSError):
    pass
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from configs import tiny

MODES = {  # scheme -> (config overrides, XLA CPU devices in the trainer's process)
    "sync": ({}, 1),
    "ppo8": ({"rl.num_minibatches": 8}, 1),  # and 8 x the prompts per generation (_mode_config)
    "pipeline8": ({"rollout.mode": "pipeline", "rollout.engine_devices": 1}, 2),  # the engine on its own device
    "pipeline8_shared": ({"rollout.mode": "pipeline"}, 1),  # the engine queues behind the trainer on one device
    "remote8": ({"rollout.mode": "pipeline"}, 1),  # + launch/serve.py in its own process
}


def _mode_config(mode, steps, init_checkpoint, prompts=32):
    config = tiny.get_config(f"prompts={prompts}")
    config.rollout.max_staleness = 8
    config.rollout.length_control = "none"  # the same for every scheme (config.py: no interruption in pipeline mode yet)
    config.steps = steps
    for dotted, value in MODES[mode][0].items():
        section, field = dotted.split(".")
        config[section][field] = value
    if mode == "ppo8":  # PPO-off-policy-8: 8 x the prompts per generation, 8 minibatch updates
        config.rollout.prompts_per_step = 8 * prompts
        config.steps = max(steps // 8, 4)
    config.eval_every = config.checkpoint_every = config.log_every = config.steps
    config.eval.num_prompts, config.eval.batch_size = 16, 64
    config.init_checkpoint = init_checkpoint
    return config


def _start_server(config, workdir):
    port_file = os.path.join(workdir, "port")
    if os.path.exists(port_file):
        os.remove(port_file)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "serve.py"), "--port=0",
                             f"--port_file={port_file}", "--num_devices=1",
                             f"--config.rollout.length_control={config.rollout.length_control}"], env=env,
                            stdout=open(os.path.join(workdir, "serve.log"), "w"), stderr=subprocess.STDOUT)
    for _ in range(240):
        if os.path.exists(port_file):
            return proc, f"127.0.0.1:{open(port_file).read().strip()}"
        if proc.poll() is not None:
            sys.exit(f"launch/serve.py exited with {proc.returncode}; see {workdir}/serve.log")
        time.sleep(0.5)
    proc.kill()
    sys.exit("launch/serve.py did not start within 120 s")


def run_one_mode(mode, steps, run_dir, init_checkpoint, prompts=32) -> dict:
    """One scheme in this process: train, then samples/s and idle fractions from metrics.jsonl."""
    import shutil

    from rl_scaling import train

    config = _mode_config(mode, steps, init_checkpoint, prompts)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    server, extra_devices = None, 0
    if mode == "remote8":
        server, config.rollout.server = _start_server(config, run_dir)
        extra_devices = 1
    try:
        train.train(config, run_dir)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        per_step = {r["step"]: r for r in map(json.loads, f) if "time/rollout_s" in r}
    skip = max(config.steps // 4, 1)
    timed = [per_step[s] for s in sorted(per_step) if s > skip]
    wall = (timed[-1]["accel_seconds"] - per_step[skip]["accel_seconds"]) / (jax.device_count() + extra_devices)
    samples = timed[-1]["samples"] - per_step[skip]["samples"]
    if config.rollout.mode == "pipeline":
        t_idle = float(np.mean([r["rollout/trainer_idle_frac"] for r in timed]))
        g_idle = float(np.mean([r["rollout/gen_idle_frac"] for r in timed]))
        stale = float(np.mean([r["rollout/staleness_mean"] for r in timed]))
    else:  # one thread: the trainer waits while generating, the generator while training
        t_idle = sum(r["time/rollout_s"] for r in timed) / wall
        g_idle, stale = 1.0 - t_idle, 0.0
    return {"samples_per_s": samples / wall, "trainer_idle": t_idle, "gen_idle": g_idle, "staleness": stale}


def one_mode_command(mode, steps, workdir, init_checkpoint, out, prompts=32) -> list[str]:
    """The command that runs one scheme in a fresh process (every flag one that main() parses)."""
    return [sys.executable, os.path.abspath(__file__), f"--one_mode={mode}", f"--steps={steps}",
            f"--workdir={workdir}", f"--init_checkpoint={init_checkpoint}", f"--prompts={prompts}", f"--json={out}"]


def bench_modes(modes, steps, workdir, init_checkpoint, repeats, prompts=32):
    """Each scheme in a fresh process (its own XLA device layout), `repeats` interleaved rounds."""
    for mode in modes:
        if mode not in MODES:
            sys.exit(f"--modes: unknown scheme {mode!r}; valid: {', '.join(MODES)}")
    os.makedirs(workdir, exist_ok=True)
    if not init_checkpoint:  # one warm start, shared by every scheme
        ws_dir = os.path.join(workdir, "warmstart_run")
        init_checkpoint = os.path.join(ws_dir, "warmstart", "params")
        if not os.path.isdir(init_checkpoint):
            from rl_scaling import train

            train.train(_mode_config("sync", 1, "", prompts), ws_dir)
    results = {m: [] for m in modes}
    for r in range(repeats):
        for mode in modes:
            out = os.path.join(workdir, f"{mode}.json")
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={MODES[mode][1]}")
            log = os.path.join(workdir, f"{mode}.log")
            with open(log, "w") as err:
                rc = subprocess.run(one_mode_command(mode, steps, workdir, init_checkpoint, out, prompts), env=env,
                                    stdout=subprocess.DEVNULL, stderr=err).returncode
            if rc:
                sys.exit(f"--modes: scheme {mode} failed (exit status {rc}); see {log}")
            with open(out) as f:
                results[mode].append(json.load(f))
            print(f"round {r + 1}: {mode}: {results[mode][-1]['samples_per_s']:.1f} samples/s", flush=True)
    med = {m: {k: float(np.median([x[k] for x in v])) for k in v[0]} for m, v in results.items()}
    base = med.get("sync", {}).get("samples_per_s")
    print(f"\nsamples/s on {os.cpu_count()} cores, median of {repeats} interleaved round(s) (tiny config, "
          f"{prompts} prompts x 8 samples per update; {steps} steps, the first quarter untimed)")
    print(f"{'scheme':<17} {'samples/s':>10} {'vs sync':>8} {'trainer idle':>13} {'generator idle':>15} {'staleness':>10}")
    for mode, m in med.items():
        ratio = f"{m['samples_per_s'] / base:.2f}x" if base else "-"
        print(f"{mode:<17} {m['samples_per_s']:>10.1f} {ratio:>8} {m['trainer_idle']:>13.2f} {m['gen_idle']:>15.2f} "
              f"{m['staleness']:>10.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,ppo8,pipeline8,remote8", help=f"schemes, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=64, help="RL steps per scheme (ppo8: steps/8)")
    parser.add_argument("--workdir", default="/tmp/rl_scaling/bench_modes")
    parser.add_argument("--init_checkpoint", default="", help="params to start from (default: one warm start)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds (median reported)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per update (ppo8: 8 x that generated per step)")
    parser.add_argument("--one_mode", default="", help=argparse.SUPPRESS)  # internal: one scheme, in this process
    parser.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_mode:
        result = run_one_mode(args.one_mode, args.steps, os.path.join(args.workdir, args.one_mode), args.init_checkpoint,
                              args.prompts)
        with open(args.json, "w") as f:
            json.dump(result, f)
        return
    bench_modes(args.modes.split(","), args.steps, args.workdir, args.init_checkpoint, args.repeats, args.prompts)


if __name__ == "__main__":
    main()
