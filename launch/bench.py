"""Speed of the sampler and the RL step on this machine, as ratios, not absolute claims.

    python launch/bench.py [--dims=tiny,small,medium] [--hf]

For each model size it prints sampler tokens/s (batch 64, 64 new tokens, no early
stop), the RL step's samples/s and tokens/s (256 samples = 32 prompts x 8; train step
alone, and generation + train), and the train step's model FLOP/s as a fraction of the
machine's matmul FLOP/s measured in the same process. With --hf it also runs Hugging
Face transformers' `generate` on a LlamaForCausalLM of the same dims, in the same
process, and prints our sampler's speed as a ratio to it.

Sizes: tiny = configs/tiny.py; small = 2 layers, d 64; medium = 4 layers, d 256 (the
dims at which the project compares itself with other JAX RL libraries).

    python launch/bench.py --dims= --modes=sync,ppo8,pipeline8,remote8 [--steps=64] [--repeats=3]

runs the tiny RL loop (launch/run.py's `train`, after one shared warm start) for each
off-policy scheme, each in a fresh process, and prints samples/s as a ratio to `sync` from
the same invocation, with the trainer's and the generator's idle fractions: sync (generate,
then one update), ppo8 (PPO-off-policy-8: 8 x 32 prompts generated, 8 minibatch updates),
pipeline8 (PipelineRL-8, JetStream engine in the trainer's process on a second XLA CPU
device), pipeline8_shared (the same on the trainer's only device, where its computations
queue behind the trainer's), remote8 (PipelineRL-8, engine in a `launch/serve.py` process
on loopback). The first quarter of the steps (compilation) is not timed.
"""

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import tiny  # noqa: E402
from rl_scaling import config as config_lib, sharding  # noqa: E402
from rl_scaling.policy import model as model_lib  # noqa: E402
from rl_scaling.rl import train_step as ts  # noqa: E402
from rl_scaling.rollout import sampler  # noqa: E402

PROMPT_LEN, NEW_TOKENS, GEN_BATCH, PROMPTS, G = 16, 64, 64, 32, 8


def sizes():
    base = config_lib.model_config(tiny.get_config())
    return {
        "tiny": base,
        "small": dataclasses.replace(base, vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                                     head_dim=16, mlp_dim=256),
        "medium": dataclasses.replace(base, vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8,
                                      head_dim=32, mlp_dim=1024),
    }


def best_time(fn, repeats=5):
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_flops_per_s():
    best = 0.0
    for n in (256, 512, 1024):
        a = jnp.ones((n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        best = max(best, 2 * n**3 / best_time(lambda: f(a), 10))
    return best


def bench_size(name, cfg, peak):
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    rl_cfg = tiny.get_config().rl
    opt = ts.make_optimizer(tiny.get_config().optim)
    state_sh = ts.state_shardings(cfg, opt, mesh)
    state = ts.init_state(cfg, opt, jax.random.key(0), mesh, state_sh)
    rng = np.random.default_rng(0)
    prompts = rng.integers(5, cfg.vocab_size, size=(GEN_BATCH, PROMPT_LEN)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    gen = lambda: sampler.sample(state["params"], prompts, mask, jax.random.key(1), cfg=cfg,  # noqa: E731
                                 max_new_tokens=NEW_TOKENS)
    t_gen = best_time(gen)
    sampler_tps = GEN_BATCH * NEW_TOKENS / t_gen

    B, L = PROMPTS * G, PROMPT_LEN + NEW_TOKENS
    rl_prompts = rng.integers(5, cfg.vocab_size, size=(B, PROMPT_LEN)).astype(np.int32)
    rl_gen = lambda p: sampler.sample(p, rl_prompts, np.ones_like(rl_prompts, bool), jax.random.key(2),  # noqa: E731
                                      cfg=cfg, max_new_tokens=NEW_TOKENS)
    out = rl_gen(state["params"])
    tokens = np.concatenate([rl_prompts, np.asarray(out.tokens_BT)], 1)
    loss_mask = np.concatenate([np.zeros((B, PROMPT_LEN)), np.ones((B, NEW_TOKENS))], 1).astype(np.float32)
    old_logp = np.concatenate([np.zeros((B, PROMPT_LEN)), np.asarray(out.logprobs_BT)], 1).astype(np.float32)
    batch = {"tokens": tokens, "token_mask": np.ones((B, L), bool), "loss_mask": loss_mask, "old_logp": old_logp,
             "rewards": rng.integers(0, 2, size=(PROMPTS, G)).astype(np.float32)}
    step = ts.jit_step(ts.rl_step, state_sh, mesh, model_cfg=cfg, rl_cfg=rl_cfg, optimizer=opt)
    holder = {"state": state}

    def train_only():
        holder["state"], m = step(holder["state"], batch)
        return m

    def gen_and_train():
        jax.block_until_ready(rl_gen(holder["state"]["params"]))
        return train_only()

    t_train = best_time(train_only)
    t_both = best_time(gen_and_train, 3)
    n = model_lib.compute_params(cfg)
    model_flops = 6.0 * n * B * L / t_train
    print(f"[{name}] layers={cfg.n_layers} d={cfg.d_model} params(matmul)={n:,}")
    print(f"  sampler: {sampler_tps:,.0f} tokens/s (batch {GEN_BATCH}, {NEW_TOKENS} new tokens)")
    print(f"  RL train step: {B / t_train:,.1f} samples/s, {B * L / t_train:,.0f} tokens/s")
    print(f"  RL step incl. generation: {B / t_both:,.1f} samples/s")
    print(f"  train step model FLOP/s: {model_flops / 1e9:.1f} G = {model_flops / peak:.2f} of measured matmul peak")
    return sampler_tps


def hf_sampler_tps(cfg):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                                      intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.n_layers,
                                      num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                                      head_dim=cfg.head_dim, max_position_embeddings=256)).eval()
    ids = torch.randint(5, cfg.vocab_size, (GEN_BATCH, PROMPT_LEN))
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **kw)
        best = min(_timed(lambda: hf.generate(ids, **kw)) for _ in range(3))
    return GEN_BATCH * NEW_TOKENS / best


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="tiny,small,medium")
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate at the same dims")
    parser.add_argument("--modes", default="", help="off-policy schemes to compare on the tiny RL loop: "
                        "sync,ppo8,pipeline8,remote8 (empty: skip)")
    parser.add_argument("--steps", type=int, default=64, help="RL steps per scheme for --modes (ppo8: steps/8)")
    parser.add_argument("--workdir", default="/tmp/rl_scaling/bench_modes")
    parser.add_argument("--init_checkpoint", default="", help="params to start from (default: one warm start)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of --modes (median reported)")
    parser.add_argument("--one_mode", default="", help=argparse.SUPPRESS)  # internal: one scheme, in this process
    parser.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_mode:
        import json

        result = run_one_mode(args.one_mode, args.steps, os.path.join(args.workdir, args.one_mode), args.init_checkpoint)
        with open(args.json, "w") as f:
            json.dump(result, f)
        return
    if args.modes:
        bench_modes(args.modes.split(","), args.steps, args.workdir, args.init_checkpoint, args.repeats)
    peak = matmul_flops_per_s()
    print(f"machine: {jax.devices()[0].platform}, {os.cpu_count()} cores; matmul {peak / 1e9:.1f} GFLOP/s (float32)")
    all_sizes = sizes()
    for name in filter(None, args.dims.split(",")):
        if name not in all_sizes:
            sys.exit(f"--dims: unknown size {name!r}; valid: {', '.join(all_sizes)}")
        tps = bench_size(name, all_sizes[name], peak)
        if args.hf:
            ref = hf_sampler_tps(all_sizes[name])
            print(f"  transformers generate: {ref:,.0f} tokens/s -> ours/theirs = {tps / ref:.1f}x")


MODES = {  # scheme -> (config overrides, XLA CPU devices in the trainer's process)
    "sync": ({}, 1),
    "ppo8": ({"rollout.prompts_per_step": 8 * 32, "rl.num_minibatches": 8}, 1),
    "pipeline8": ({"rollout.mode": "pipeline", "rollout.engine_devices": 1}, 2),  # the engine on its own device
    "pipeline8_shared": ({"rollout.mode": "pipeline"}, 1),  # the engine queues behind the trainer on one device
    "remote8": ({"rollout.mode": "pipeline"}, 1),  # + launch/serve.py in its own process
}


def _mode_config(mode, steps, init_checkpoint):
    config = tiny.get_config()
    config.rollout.max_staleness = 8
    config.rollout.length_control = "none"  # the same for every scheme (config.py: no interruption in pipeline mode yet)
    config.steps = steps
    for dotted, value in MODES[mode][0].items():
        section, field = dotted.split(".")
        config[section][field] = value
    if mode == "ppo8":  # PPO-off-policy-8: 8 x 32 prompts per generation, 8 minibatch updates
        config.steps = max(steps // 8, 4)
    config.eval_every = config.checkpoint_every = config.log_every = config.steps
    config.eval.num_prompts, config.eval.batch_size = 16, 64
    config.init_checkpoint = init_checkpoint
    return config


def _start_server(config, workdir):
    import subprocess

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


def run_one_mode(mode, steps, run_dir, init_checkpoint) -> dict:
    """One scheme in this process: train, then samples/s and idle fractions from metrics.jsonl."""
    import json
    import shutil

    from rl_scaling import train

    config = _mode_config(mode, steps, init_checkpoint)
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


def bench_modes(modes, steps, workdir, init_checkpoint, repeats):
    """Each scheme in a fresh process (its own XLA device layout), `repeats` interleaved rounds."""
    import json
    import subprocess

    for mode in modes:
        if mode not in MODES:
            sys.exit(f"--modes: unknown scheme {mode!r}; valid: {', '.join(MODES)}")
    os.makedirs(workdir, exist_ok=True)
    if not init_checkpoint:  # one warm start, shared by every scheme
        ws_dir = os.path.join(workdir, "warmstart_run")
        init_checkpoint = os.path.join(ws_dir, "warmstart", "params")
        if not os.path.isdir(init_checkpoint):
            from rl_scaling import train

            train.train(_mode_config("sync", 1, ""), ws_dir)
    results = {m: [] for m in modes}
    for r in range(repeats):
        for mode in modes:
            out = os.path.join(workdir, f"{mode}.json")
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={MODES[mode][1]}")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--dims=", f"--one_mode={mode}",
                            f"--steps={steps}", f"--workdir={workdir}", f"--init_checkpoint={init_checkpoint}",
                            f"--json={out}"], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, f"{mode}.log"), "w"))
            with open(out) as f:
                results[mode].append(json.load(f))
            print(f"round {r + 1}: {mode}: {results[mode][-1]['samples_per_s']:.1f} samples/s", flush=True)
    med = {m: {k: float(np.median([x[k] for x in v])) for k in v[0]} for m, v in results.items()}
    base = med.get("sync", {}).get("samples_per_s")
    print(f"\nsamples/s on {os.cpu_count()} cores, median of {repeats} interleaved round(s) (tiny config, "
          f"32 prompts x 8 samples per update; {steps} steps, the first quarter untimed)")
    print(f"{'scheme':<17} {'samples/s':>10} {'vs sync':>8} {'trainer idle':>13} {'generator idle':>15} {'staleness':>10}")
    for mode, m in med.items():
        ratio = f"{m['samples_per_s'] / base:.2f}x" if base else "-"
        print(f"{mode:<17} {m['samples_per_s']:>10.1f} {ratio:>8} {m['trainer_idle']:>13.2f} {m['gen_idle']:>15.2f} "
              f"{m['staleness']:>10.2f}")


if __name__ == "__main__":
    main()
