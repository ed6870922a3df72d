"""Speed of the sampler, the RL step and the train step, as ratios to peers measured in the same run.

    python launch/bench.py [--presets=tiny,small] [--cases=sampler,rl,train]
    python launch/bench.py --vs_tunix --rounds=5 [--presets=tiny,small] [--cases=sampler,rl]

Presets are the peer baselines' (`../shared/peers`): tiny = 2 layers, d 64, 4 heads, 2 kv heads,
ffn 256, vocab 32; small = 4 layers, d 256, 8 heads, 4 kv heads, ffn 1024, vocab 512; untied,
RMSNorm eps 1e-6, RoPE theta 1e6, float32, 2 threads. Cases, each printed as one JSON line:
  sampler: batch 64 random prompts of 16 tokens, 64 new tokens (no early stop: no stop token),
           temperature 1 over the full vocabulary, log-probs returned; tokens/s of a whole call.
  rl:      one RL step of 32 prompts x 8 samples (prompt 16, exactly 64 new tokens), generation
           with the prompt prefilled once per group, a host-side toy reward (share of token 3, as
           the tunix peer's), then the tiny config's CISPO update (one optimizer step); samples/s.
  train:   the update alone on those 256 sequences: model FLOP/s (compute.py's count, causal
           attention, every row's prompt) as a fraction of the jax float32 matmul FLOP/s measured
           in this process (frac_of_peak), and the FLOPs the step computes (each group's prompt
           once, train_step.shared_prompt_logprobs; attention over the whole KV cache, an upper
           bound: the completion pass's causal blocks skip some of it) as a
           fraction too (computed_frac_of_peak), next to XLA's cost_analysis of the jitted step,
           which counts what is computed (elementwise work and the optimizer too).
Each figure is the median of --reps timed calls after --warmup untimed ones.

--vs_tunix alternates this script's process with the tunix peer's (`tunix_sampler.py`,
`tunix_grpo.py --beta 0`, run with /tmp/peers/tunix-venv/bin/python) --rounds times per case and
prints the medians and the per-pair ratios (ours / tunix).

    python launch/bench.py --modes=sync,ppo8,pipeline8,remote8 [--steps=64] [--repeats=3] [--prompts=32]

runs the tiny RL loop (launch/run.py's `train`, after one shared warm start) for each
off-policy scheme, each in a fresh process, and prints samples/s as a ratio to `sync` from
the same invocation, with the trainer's and the generator's idle fractions: sync (generate,
then one update), ppo8 (PPO-off-policy-8: 8 x 32 prompts generated, 8 minibatch updates),
pipeline8 (PipelineRL-8, JetStream engine in the trainer's process on a second XLA CPU
device), pipeline8_shared (the same on the trainer's only device, where its computations
queue behind the trainer's), remote8 (PipelineRL-8, engine in a `launch/serve.py` process
on loopback). The first quarter of the steps (compilation) is not timed. With --modes the preset
cases run only when --presets is given. --prompts sets the prompts per update (ppo8: 8 x that per
generation), 32 as the tiny config by default; tests use a few.
"""

import argparse
import json
import os
import subprocess
import sys
import time


def _pin_threads(n=2):
    """Two threads, as the peers pin them: CPU affinity (XLA sizes its pool from it)."""
    try:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:n])
    except (AttributeError, OSError):
        pass


_pin_threads()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import tiny  # noqa: E402
from rl_scaling import compute, sharding  # noqa: E402
from rl_scaling.policy import model as model_lib  # noqa: E402
from rl_scaling.rl import train_step as ts  # noqa: E402
from rl_scaling.rollout import sampler  # noqa: E402

PROMPT_LEN, NEW_TOKENS, GEN_BATCH, PROMPTS, G = 16, 64, 64, 32, 8
PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "peers")
TUNIX_PYTHON = "/tmp/peers/tunix-venv/bin/python"
PRESETS = {  # the peers' presets (layers, d_model, heads, kv_heads, ffn, vocab)
    "tiny": (2, 64, 4, 2, 256, 32),
    "small": (4, 256, 8, 4, 1024, 512),
}
TOY_TOKEN = 3  # the tunix peer's toy reward: the share of completion tokens equal to 3


def preset_config(name):
    L, D, N, K, F, V = PRESETS[name]
    return model_lib.ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=N, n_kv_heads=K, head_dim=D // N,
                                 mlp_dim=F, rope_theta=1e6, norm_eps=1e-6, scan_layers=False)


def median_time(fn, reps, warmup):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times)), times


def matmul_flops_per_s(reps=7):
    """jax float32 square matmul FLOP/s (2 n^3), median of reps, best size: the peers' MFU denominator."""
    best = 0.0
    for n in (1024, 2048):
        a = jnp.ones((n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        best = max(best, 2 * n**3 / median_time(lambda: f(a), reps, 2)[0])
    return best


def _setup(cfg):
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    config = tiny.get_config()
    opt = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(cfg, opt, mesh)
    state = ts.init_state(cfg, opt, jax.random.key(0), mesh, state_sh)
    return mesh, config, opt, state_sh, state


def bench_sampler(cfg, reps, warmup):
    _, _, _, _, state = _setup(cfg)
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, cfg.vocab_size, size=(GEN_BATCH, PROMPT_LEN)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    keys = iter(jax.random.split(jax.random.key(1), reps + warmup))

    def gen():
        out = sampler.sample(state["params"], prompts, mask, next(keys), cfg=cfg, max_new_tokens=NEW_TOKENS)
        return out.tokens_BT, out.logprobs_BT

    t, times = median_time(gen, reps, warmup)
    n = GEN_BATCH * NEW_TOKENS
    return {"tok_s_median": n / t, "tok_s_min": n / max(times), "tok_s_max": n / min(times),
            "batch": GEN_BATCH, "new_tokens": NEW_TOKENS}


def _rl_parts(cfg):
    mesh, config, opt, state_sh, state = _setup(cfg)
    B, L = PROMPTS * G, PROMPT_LEN + NEW_TOKENS
    rng = np.random.default_rng(0)
    step = ts.jit_step(ts.rl_step, state_sh, mesh, model_cfg=cfg, rl_cfg=config.rl, optimizer=opt,
                       prompt_len=PROMPT_LEN)
    holder = {"state": state, "key": jax.random.key(2)}
    loss_pad = np.zeros((B, PROMPT_LEN), np.float32)

    def one_step():
        prompts = rng.integers(2, cfg.vocab_size, size=(PROMPTS, PROMPT_LEN)).astype(np.int32)
        holder["key"], key = jax.random.split(holder["key"])
        out = sampler.sample(holder["state"]["params"], prompts, np.ones_like(prompts, bool), key, cfg=cfg,
                             max_new_tokens=NEW_TOKENS, group_size=G)
        tokens_BT, logprobs_BT = np.asarray(out.tokens_BT), np.asarray(out.logprobs_BT)
        rewards = (tokens_BT == TOY_TOKEN).mean(1).astype(np.float32)  # host-side reward, per sample
        batch = {"tokens": np.concatenate([np.repeat(prompts, G, 0), tokens_BT], 1),
                 "token_mask": np.ones((B, L), bool),
                 "loss_mask": np.concatenate([loss_pad, np.ones((B, NEW_TOKENS), np.float32)], 1),
                 "old_logp": np.concatenate([loss_pad, logprobs_BT], 1),
                 "rewards": rewards.reshape(PROMPTS, G)}
        holder["state"], metrics = step(holder["state"], batch)
        return batch, metrics

    return step, holder, one_step


def bench_rl(cfg, reps, warmup):
    _, _, one_step = _rl_parts(cfg)
    t, times = median_time(lambda: one_step()[1], reps, warmup)
    n = PROMPTS * G
    return {"samples_s_median": n / t, "samples_s_min": n / max(times), "samples_s_max": n / min(times),
            "step_s_median": t, "prompts": PROMPTS, "group": G, "new_tokens": NEW_TOKENS}


def bench_train(cfg, reps, warmup, peak):
    step, holder, one_step = _rl_parts(cfg)
    batch, _ = one_step()
    t, _ = median_time(lambda: step_update(step, holder, batch), reps, warmup)
    B, L = batch["tokens"].shape
    lens = np.full(B, L, np.float64)
    # compute.py: causal attention over the L-1 positions the trainer feeds.
    _, model_flops = compute.sequence_flops(cfg, np.zeros(B), lens - 1)
    # What the step computes: each group's prompt once (its PROMPT_LEN tokens, then the B rows'
    # L-1-PROMPT_LEN completion positions), every query scoring the L-1 slots of the KV cache (an
    # upper bound: the completion pass's causal blocks skip the slots after each block's last query).
    tokens = B // G * PROMPT_LEN + B * (L - 1 - PROMPT_LEN)
    computed = 3.0 * compute.forward_flops(cfg, tokens, tokens * (L - 1))
    return {"train_s_median": t, "model_gflop_s": model_flops / t / 1e9, "peak_gflop_s": peak / 1e9,
            "frac_of_peak": model_flops / t / peak, "computed_frac_of_peak": computed / t / peak,
            "model_flops_causal": model_flops, "model_flops_computed": computed,
            **xla_flops(cfg, holder["state"], batch, computed)}


def step_update(step, holder, batch):
    holder["state"], metrics = step(holder["state"], batch)
    return metrics


def xla_flops(cfg, state, batch, computed):
    """XLA's cost_analysis of the step compiled with one microbatch: it counts a loop body once,
    so the tiny config's 8 accumulated microbatches would show as 1/8 (the gradient is the same)."""
    config = tiny.get_config()
    config.rl.grad_accum = 1
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    opt = ts.make_optimizer(config.optim)
    step = ts.jit_step(ts.rl_step, ts.state_shardings(cfg, opt, mesh), mesh, model_cfg=cfg, rl_cfg=config.rl,
                       optimizer=opt, prompt_len=PROMPT_LEN)
    cost = step.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0)) if cost else 0.0
    return {"xla_flops": flops, "xla_vs_computed": flops / computed if flops else None}


def run_cases(presets, cases, reps, warmup):
    peak = matmul_flops_per_s() if "train" in cases else None
    for name in presets:
        cfg = preset_config(name)
        for case in cases:
            if case == "sampler":
                res = bench_sampler(cfg, reps, warmup)
            elif case == "rl":
                res = bench_rl(cfg, reps, warmup)
            elif case == "train":
                res = bench_train(cfg, reps, warmup, peak)
            else:
                sys.exit(f"--cases: unknown case {case!r}; valid: sampler, rl, train")
            res = {"tool": "rl_scaling", "case": case, "preset": name,
                   "params_matmul": model_lib.compute_params(cfg), "threads": len(os.sched_getaffinity(0)),
                   "reps": reps, "warmup": warmup, **{k: _round(v) for k, v in res.items()},
                   "loadavg": list(os.getloadavg())}
            print(json.dumps(res), flush=True)


def _round(v):
    return round(v, 4) if isinstance(v, float) and abs(v) < 1e6 else v


def _last_json(cmd, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def vs_tunix(presets, cases, rounds, reps, warmup):
    """Alternate our process and tunix's, `rounds` times per case; medians and per-pair ratios."""
    ours_key = {"sampler": "tok_s_median", "rl": "samples_s_median"}
    peer = {"sampler": ("tunix_sampler.py", [f"--batch={GEN_BATCH}", f"--reps={reps}", f"--warmup={warmup}"],
                        "tok_s_median"),
            "rl": ("tunix_grpo.py", [f"--prompts={PROMPTS}", f"--group={G}", "--beta=0"], "samples_s_median")}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    summary = []
    for name in presets:
        for case in cases:
            script, flags, key = peer[case]
            if case == "rl" and name == "small":
                flags = flags + ["--steps=3"]  # ~10 s a tunix step at small
            ours, theirs = [], []
            for r in range(rounds):
                mine = _last_json([sys.executable, os.path.abspath(__file__), f"--presets={name}", f"--cases={case}",
                                   f"--reps={reps}", f"--warmup={warmup}"], env)
                ours.append(mine[ours_key[case]])
                tx = _last_json([TUNIX_PYTHON, os.path.join(PEERS, script), f"--preset={name}",
                                 f"--prompt_len={PROMPT_LEN}", f"--new_tokens={NEW_TOKENS}", "--threads=2", *flags], env)
                theirs.append(tx[key])
                print(f"round {r + 1} {case} {name}: ours {ours[-1]:.1f}, tunix {theirs[-1]:.1f}, "
                      f"ratio {ours[-1] / theirs[-1]:.2f}", file=sys.stderr, flush=True)
            pairs = [a / b for a, b in zip(ours, theirs)]
            res = {"tool": "rl_scaling_vs_tunix", "case": case, "preset": name, "rounds": rounds,
                   "unit": "tok/s" if case == "sampler" else "samples/s",
                   "ours_median": _round(float(np.median(ours))), "tunix_median": _round(float(np.median(theirs))),
                   "ratio_of_medians": _round(float(np.median(ours) / np.median(theirs))),
                   "pair_ratios": [round(p, 3) for p in pairs], "pair_ratio_median": round(float(np.median(pairs)), 3),
                   "ours": [round(x, 1) for x in ours], "tunix": [round(x, 1) for x in theirs]}
            print(json.dumps(res), flush=True)
            summary.append(res)
    print(f"\n{'case':<8} {'preset':<6} {'ours':>10} {'tunix':>10} {'ratio':>6}  per-pair ratios", file=sys.stderr)
    for s in summary:
        print(f"{s['case']:<8} {s['preset']:<6} {s['ours_median']:>10.1f} {s['tunix_median']:>10.1f} "
              f"{s['ratio_of_medians']:>5.2f}x  {s['pair_ratios']}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="tiny,small (the default without --modes)")
    parser.add_argument("--cases", default="sampler,rl,train")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per case (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (compile)")
    parser.add_argument("--vs_tunix", action="store_true", help="alternate our process with the tunix peer's")
    parser.add_argument("--rounds", type=int, default=5, help="processes of each side for --vs_tunix")
    parser.add_argument("--modes", default="", help="off-policy schemes to compare on the tiny RL loop: "
                        "sync,ppo8,pipeline8,remote8 (empty: skip)")
    parser.add_argument("--steps", type=int, default=64, help="RL steps per scheme for --modes (ppo8: steps/8)")
    parser.add_argument("--workdir", default="/tmp/rl_scaling/bench_modes")
    parser.add_argument("--init_checkpoint", default="", help="params to start from (default: one warm start)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of --modes (median reported)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per update for --modes (ppo8: 8 x that "
                        "generated per step)")
    parser.add_argument("--one_mode", default="", help=argparse.SUPPRESS)  # internal: one scheme, in this process
    parser.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_mode:
        result = run_one_mode(args.one_mode, args.steps, os.path.join(args.workdir, args.one_mode), args.init_checkpoint,
                              args.prompts)
        with open(args.json, "w") as f:
            json.dump(result, f)
        return
    if args.modes:
        bench_modes(args.modes.split(","), args.steps, args.workdir, args.init_checkpoint, args.repeats, args.prompts)
    if args.presets is None:
        args.presets = "" if args.modes else "tiny,small"
    presets, cases = list(filter(None, args.presets.split(","))), list(filter(None, args.cases.split(",")))
    for name in presets:
        if name not in PRESETS:
            sys.exit(f"--presets: unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    if args.vs_tunix:
        vs_tunix(presets, [c for c in cases if c != "train"], args.rounds, args.reps, args.warmup)
    elif presets:
        run_cases(presets, cases, args.reps, args.warmup)


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
    return [sys.executable, os.path.abspath(__file__), "--presets=", f"--one_mode={mode}", f"--steps={steps}",
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


if __name__ == "__main__":
    main()
