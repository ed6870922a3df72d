"""Disaggregated PipelineRL vs synchronous generation: samples/s as a ratio, in one invocation.

    python launch/bench_pipeline.py [--replicas=2] [--steps=40] [--workdir=/tmp/rl_scaling/bench_pipeline]

Both schemes run the tiny RL loop (tests' sizes: 32 prompts x 8 samples, 16 new tokens, no length
control) from one shared warm start. `pipeline` is PipelineRL-8 against `--replicas` launch/serve.py
processes (each its own process and XLA CPU device), the trainer a further process. Each scheme runs
twice, `steps` and `steps / 4` RL steps, and samples/s is the difference of the two runs' samples
over the difference of their wall times: start-up, compilation and evals cancel out. The replicas
compile in an untimed 1-step pipeline run first (their caches outlive a trainer), so the first
timed run does not pay for it. `steady_*` is a second estimate from the long run alone: samples
over the time between the console lines (every `log_every` steps) from step `steps / 4` to the
last before the final step and its eval.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OVERRIDES = ["--config.rollout.length_control=none", "--config.eval_every=100000", "--config.checkpoint_every=100000",
             "--config.eval.num_prompts=8", "--config.rl.no_positive_resampling=False"]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return env


def start_replica(workdir, i):
    port_file = os.path.join(workdir, f"replica{i}.port")
    if os.path.exists(port_file):
        os.remove(port_file)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "serve.py"), "--port=0",
                             f"--port_file={port_file}", "--config.rollout.length_control=none"],
                            env=_env(), stdout=open(os.path.join(workdir, f"replica{i}.log"), "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.time() > deadline:
            sys.exit(f"launch/serve.py replica {i} did not start; see {workdir}/replica{i}.log")
        time.sleep(0.2)
    return proc, f"127.0.0.1:{open(port_file).read().strip()}"


def run(workdir, name, steps, extra):
    """One launch/run.py: (wall s, samples, steady samples/s). The steady rate is timed inside the run,
    between the first console line at or after step steps/4 and the last before the final step (no
    start-up, no final eval)."""
    out = os.path.join(workdir, f"{name}_{steps}")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), f"--workdir={out}", f"--config.steps={steps}",
           *OVERRIDES, *extra]
    t, seen, tail = time.perf_counter(), {}, []
    with open(os.path.join(workdir, f"{name}_{steps}.stdout"), "w") as stdout:
        proc = subprocess.Popen(cmd, env=_env(), stdout=stdout, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:  # the trainer flushes one progress line per step
            m = re.match(r"step (\d+)/", line)
            if m:
                seen.setdefault(int(m.group(1)), time.perf_counter())
            tail = (tail + [line])[-60:]
        proc.wait()
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.exit(f"{name} failed:\n{''.join(tail)[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    samples = {r["step"]: r["samples"] for r in rows if "samples" in r}
    logged = sorted(k for k in seen if steps // 4 <= k < steps and k in samples)  # every config.log_every steps
    a, b = (logged[0], logged[-1]) if logged else (0, 0)
    steady = (samples[b] - samples[a]) / (seen[b] - seen[a]) if a < b else float("nan")
    return wall, max(samples.values()), steady


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workdir", default="/tmp/rl_scaling/bench_pipeline")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    warm = os.path.join(args.workdir, "sync_warm")
    run(args.workdir, "sync_warm", 1, [])  # one warm start, shared by every run below
    init = [f"--config.init_checkpoint={os.path.join(warm + '_1', 'warmstart', 'params')}"]
    replicas = [start_replica(args.workdir, i) for i in range(args.replicas)]
    try:
        servers = ",".join(a for _, a in replicas)
        schemes = {"sync": init, "pipeline": init + ["--config.rollout.mode=pipeline", "--config.rollout.max_staleness=8",
                                                     f"--config.rollout.servers={servers}"]}
        run(args.workdir, "pipeline_warm", 1, schemes["pipeline"])  # the replicas compile here, not in a timed run
        result, walls, steady = {}, {}, {}
        for name, extra in schemes.items():
            short, full = run(args.workdir, name, max(1, args.steps // 4), extra), run(args.workdir, name, args.steps, extra)
            walls[name] = [round(short[0], 1), round(full[0], 1)]
            steady[name] = full[2]
            if full[0] <= short[0]:  # start-up noise swamps the extra steps: the number would mean nothing
                sys.exit(f"{name}: {args.steps} steps took {full[0]:.1f} s, {args.steps // 4} took {short[0]:.1f} s; "
                         "raise --steps")
            result[name] = (full[1] - short[1]) / (full[0] - short[0])
    finally:
        for proc, _ in replicas:
            proc.terminate()
            proc.wait(30)
    print(json.dumps({"tool": "bench_pipeline", "replicas": args.replicas, "steps": args.steps,
                      "sync_samples_s": round(result["sync"], 1), "pipeline_samples_s": round(result["pipeline"], 1),
                      "pipeline_vs_sync": round(result["pipeline"] / result["sync"], 3),
                      "steady_sync_samples_s": round(steady["sync"], 1),
                      "steady_pipeline_samples_s": round(steady["pipeline"], 1),
                      "steady_pipeline_vs_sync": round(steady["pipeline"] / steady["sync"], 3),
                      "wall_s": {k: dict(zip([args.steps // 4, args.steps], v)) for k, v in walls.items()},
                      "cpus": len(os.sched_getaffinity(0)), "loadavg": list(os.getloadavg())}), flush=True)


if __name__ == "__main__":
    main()
