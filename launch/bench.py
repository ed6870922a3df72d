"""Speed of the sampler, the RL step and the train step, on CPU, GPU or TPU, with peers in the same run.

    python launch/bench.py [--presets=tiny,small] [--cases=sampler,rl,train]
    python launch/bench.py --preset=1b [--cases=train,sampler,rl,hf] [--smoke]

Presets. tiny and small are the CPU peer baselines' (`../shared/peers`): tiny = 2 layers, d 64, 4
heads, 2 kv heads, ffn 256, vocab 32; small = 4 layers, d 256, 8 heads, 4 kv heads, ffn 1024, vocab
512; untied, RMSNorm eps 1e-6, RoPE theta 1e6, float32, unrolled layers, the process pinned to 2
threads and to XLA:CPU (JAX_PLATFORMS=cpu unless set). 1b is a Llama-3.2-1B-shaped dense policy for
accelerators: 16 layers, d 2048, 32 heads, 8 kv heads, head dim 64, ffn 8192, vocab 128256, untied,
bfloat16 params and body, float32 LM head, scanned layers, on whatever backend jax picks (CPU, GPU,
TPU); `--smoke` shrinks its dims and shapes (2 layers, d 128, vocab 1024, a few rows) so the same
code runs in seconds on a CPU (the test suite's smoke test).

Cases, each printed as one JSON line (every field named; `tool`, `case`, `preset`, `backend`,
`device`, `dtype`, `params_matmul`, `reps`, `warmup`, `first_call_s` (compile included) on each):
  sampler: tiny/small: batch 64 random prompts of 16 tokens, 64 new tokens; 1b: 64 prompts of 128,
           512 new. No early stop (no stop token), temperature 1 over the full vocabulary, log-probs
           returned. tok_s_* (new tokens per second of whole calls, prefill included), step_ms (call
           time / new tokens), and the memory roofline: weight_bytes (every matmul weight and norm
           read once per decode step: all params but the embedding table, unless tied) and
           kv_bytes_read (each step reads its rows' valid KV slots: sum over steps of rows x slots x
           layers x 2 x kv heads x head dim x itemsize), roofline_s = (new tokens x weight_bytes +
           kv_bytes_read) / copy_gb_s (a copy's read+write bytes per second measured in this
           process), roofline_frac = roofline_s / call time (1.0: memory-bound at the copy rate).
  rl:      one RL step: tiny/small 32 prompts x 8 samples (prompt 16, exactly 64 new tokens); 1b 32
           x 8 (prompt 512, 512 new); generation with the prompt prefilled once per group, a
           host-side toy reward (share of token 3, as the tunix peer's), then a CISPO update (one
           optimizer step; the tiny config's 8 microbatches, 1b: 16); samples/s and the split
           gen_s / host_s / update_s (medians).
  train:   the update alone on the rl case's batch: model FLOP/s (compute.py's count, causal
           attention, every row's prompt) as a fraction of a square matmul's FLOP/s measured in this
           process (frac_of_peak = mfu; tiny/small: float32 at n = 1024, 2048; 1b: the policy's dtype,
           bfloat16, at n = 4096, 8192 on accelerators, 256, 512 with --smoke), and the FLOPs the step
           computes (each group's prompt once where train_step.shared_prompt_logprobs applies;
           attention over the whole KV cache, an upper bound) as computed_frac_of_peak; tiny/small
           add XLA's cost_analysis of the step (a second compile; off at 1b: --xla_flops).
  hf:      Hugging Face `generate` (torch, LlamaForCausalLM of the same dims, dtype and float32
           head, random weights, sdpa attention) on the same device at the sampler case's shapes
           and sampling settings (do_sample, temperature 1, top_k 0, top_p 1, exactly the new
           tokens: no EOS); one entry per setting tried (static cache with torch.compile, CUDA only;
           static cache; dynamic cache; the 1b preset times one call after the first), the
           fastest, and ours / HF tok/s ratios (our sampler's figure from this run's sampler case,
           or measured here). HF returns no log-probs here (ours do). A setting that would start
           with less than 150 s (compiled) or 60 s left of --budget_s is skipped and says so. On
           TPU (no torch device) the line says it was skipped.
Each figure is the median of --reps timed calls after --warmup untimed ones (the 1b preset: 3 and
1 by default); first_call_s is the first call's time, compiles included (unless an earlier case
compiled the same shapes: train and rl share the update and the generation). Results and history:
docs/benchmarks.md.
  dry_run: `--dry_run=TOPOLOGY` (e.g. v5p:2x2x1; libtpu) adds the ahead-of-time estimate for a TPU
           slice next to the measured figures: rl_scaling/dry_run.py compiles the rl case's update
           (FSDP over the slice) and a decode step of the sampler case's rows over the rl case's
           prompt + new tokens of KV cache (replicas tensor-parallel over up to kv-heads chips), and
           prints per-chip HBM, the roofline and assumed-utilisation step times and MFU.

Side by side with the tunix peer (alternating processes): launch/bench_tunix.py. The off-policy
schemes end to end on the tiny RL loop (sync, PPO-off-policy-8, PipelineRL-8): launch/bench_modes.py.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

ACCELERATOR_PRESETS = ("1b",)  # the others are the CPU peers' presets


def _accelerator_run(argv) -> bool:
    """Whether the command line names an accelerator preset (--preset(s)=1b): then jax picks its
    backend and the process keeps all its cores; else the CPU peers' setup below."""
    for i, arg in enumerate(argv):
        if arg.startswith("--preset"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if any(p in ACCELERATOR_PRESETS for p in value.split(",")):
                return True
    return False


def _pin_threads(n=2):
    """Two threads, as the peers pin them: CPU affinity (XLA sizes its pool from it)."""
    try:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:n])
    except (AttributeError, OSError):
        pass


START = time.time()
if _accelerator_run(sys.argv[1:]):
    # jax and torch share the device in one process (the hf case): jax takes a fixed share of its
    # memory instead of 75%.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")
else:
    _pin_threads()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from configs import tiny
from rl_scaling import compute, sharding
from rl_scaling.policy import model as model_lib
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import sampler

PROMPT_LEN, NEW_TOKENS, GEN_BATCH, PROMPTS, G = 16, 64, 64, 32, 8  # the peer presets' shapes
PRESETS = {  # (layers, d_model, heads, kv_heads, ffn, vocab); tiny, small: the peers' presets
    "tiny": (2, 64, 4, 2, 256, 32),
    "small": (4, 256, 8, 4, 1024, 512),
    "1b": (16, 2048, 32, 8, 8192, 128256),  # Llama-3.2-1B
}
SMOKE_DIMS = (2, 128, 4, 2, 512, 1024)  # --preset=1b --smoke: the 1b preset's code at CPU-test size
TOY_TOKEN = 3  # the tunix peer's toy reward: the share of completion tokens equal to 3


@dataclasses.dataclass(frozen=True)
class Shapes:
    gen_batch: int  # sampler case: prompts (one sample each)
    prompt: int
    new: int
    prompts: int  # rl / train cases: prompts x group samples
    group: int
    rl_prompt: int
    rl_new: int
    grad_accum: int  # microbatches of the update (0: the tiny config's)


SHAPES = {
    "peers": Shapes(GEN_BATCH, PROMPT_LEN, NEW_TOKENS, PROMPTS, G, PROMPT_LEN, NEW_TOKENS, 0),
    "1b": Shapes(64, 128, 512, 32, 8, 512, 512, 16),
    "1b_smoke": Shapes(8, 16, 16, 4, 4, 16, 16, 2),
}


def preset_config(name, smoke=False):
    if name in ACCELERATOR_PRESETS:
        L, D, N, K, F, V = SMOKE_DIMS if smoke else PRESETS[name]
        return model_lib.ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=N, n_kv_heads=K, head_dim=D // N,
                                     mlp_dim=F, rope_theta=500000.0, norm_eps=1e-5, dtype="bfloat16",
                                     param_dtype="bfloat16", fp32_lm_head=True, scan_layers=True)
    L, D, N, K, F, V = PRESETS[name]
    return model_lib.ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=N, n_kv_heads=K, head_dim=D // N,
                                 mlp_dim=F, rope_theta=1e6, norm_eps=1e-6, scan_layers=False)


def preset_shapes(name, smoke=False):
    if name in ACCELERATOR_PRESETS:
        return SHAPES[f"{name}_smoke" if smoke else name]
    return SHAPES["peers"]


# ---- timing, and the peaks the fractions are taken against --------------------------------------

def median_time(fn, reps, warmup):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times)), times


def timed(fn, reps, warmup):
    """(median, times, first call's seconds: compile included) of fn's calls (warmup >= 1)."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t
    med, times = median_time(fn, reps, max(warmup - 1, 0))
    return med, times, first


def matmul_flops_per_s(reps=7, dtype=jnp.float32, sizes=(1024, 2048)):
    """jax square matmul FLOP/s (2 n^3) in `dtype`, median of reps, best size: the MFU denominator."""
    best = 0.0
    for n in sizes:
        a = jnp.ones((n, n), dtype)
        f = jax.jit(lambda x: x @ x)
        best = max(best, 2 * n**3 / median_time(lambda: f(a), reps, 2)[0])
    return best


def copy_bytes_per_s(n_bytes, reps=10):
    """Bytes per second that x + 1 reads and writes over an n_bytes float32 array (median): the
    memory bandwidth the sampler's roofline divides by."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    return 2 * x.nbytes / median_time(lambda: f(x), reps, 2)[0]


# ---- our cases: sampler, RL step, train step ----------------------------------------------------

def _setup(cfg, grad_accum=0):
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    config = tiny.get_config()
    if grad_accum:
        config.rl.grad_accum = grad_accum
    opt = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(cfg, opt, mesh)
    state = ts.init_state(cfg, opt, jax.random.key(0), mesh, state_sh)
    return mesh, config, opt, state_sh, state


def decode_bytes(cfg, params, rows, prompt, new):
    """(weight bytes a decode step reads, KV-cache bytes the call's decode steps read): the
    sampler's memory roofline. Every param but the embedding table (a step looks up only its rows;
    tied, the table is the LM head), and at step t each row's prompt + t + 1 valid slots."""
    weight = sum(x.nbytes for x in jax.tree.leaves(params))
    if not cfg.tie_embeddings:
        weight -= params["embed"].nbytes
    per_slot = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(model_lib.DTYPES[cfg.dtype]).itemsize
    slots = sum(prompt + t + 1 for t in range(new))
    return weight, rows * slots * per_slot


def bench_sampler(cfg, shapes, reps, warmup, bandwidth):
    _, _, _, _, state = _setup(cfg)
    rng = np.random.default_rng(0)
    B, P, N = shapes.gen_batch, shapes.prompt, shapes.new
    prompts = rng.integers(2, cfg.vocab_size, size=(B, P)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    keys = iter(jax.random.split(jax.random.key(1), reps + warmup))

    def gen():
        out = sampler.sample(state["params"], prompts, mask, next(keys), cfg=cfg, max_new_tokens=N)
        return out.tokens_BT, out.logprobs_BT

    t, times, first = timed(gen, reps, warmup)
    n = B * N
    weight, kv = decode_bytes(cfg, state["params"], B, P, N)
    bandwidth = bandwidth()  # measured after the timed calls, which it must not disturb
    roofline = (N * weight + kv) / bandwidth
    return {"tok_s_median": n / t, "tok_s_min": n / max(times), "tok_s_max": n / min(times),
            "batch": B, "prompt_len": P, "new_tokens": N, "call_s_median": t, "step_ms": 1e3 * t / N,
            "first_call_s": first, "weight_bytes": weight, "kv_bytes_read": kv, "copy_gb_s": bandwidth / 1e9,
            "roofline_s": roofline, "roofline_frac": roofline / t}


class RLParts:
    """The RL step's pieces, built once per preset and shared by the rl and train cases (one
    compile of the update)."""

    def __init__(self, cfg, shapes):
        mesh, config, opt, state_sh, state = _setup(cfg, shapes.grad_accum)
        self.cfg, self.shapes, self.mesh, self.config = cfg, shapes, mesh, config
        P, Gs = shapes.rl_prompt, shapes.group
        self.rows, self.length = shapes.prompts * Gs, P + shapes.rl_new
        self.step = ts.jit_step(ts.rl_step, state_sh, mesh, model_cfg=cfg, rl_cfg=config.rl, optimizer=opt,
                                prompt_len=P)
        self.state, self.key = state, jax.random.key(2)
        self.rng = np.random.default_rng(0)
        self.first_update_s = None

    def one_step(self):
        """One RL step: (batch, metrics, gen_s, host_s, update_s)."""
        s, cfg = self.shapes, self.cfg
        B, P, N = self.rows, s.rl_prompt, s.rl_new
        t0 = time.perf_counter()
        prompts = self.rng.integers(2, cfg.vocab_size, size=(s.prompts, P)).astype(np.int32)
        self.key, key = jax.random.split(self.key)
        out = sampler.sample(self.state["params"], prompts, np.ones_like(prompts, bool), key, cfg=cfg,
                             max_new_tokens=N, group_size=s.group)
        tokens_BT, logprobs_BT = np.asarray(out.tokens_BT), np.asarray(out.logprobs_BT)
        t1 = time.perf_counter()
        loss_pad = np.zeros((B, P), np.float32)
        rewards = (tokens_BT == TOY_TOKEN).mean(1).astype(np.float32)  # host-side reward, per sample
        batch = {"tokens": np.concatenate([np.repeat(prompts, s.group, 0), tokens_BT], 1),
                 "token_mask": np.ones((B, self.length), bool),
                 "loss_mask": np.concatenate([loss_pad, np.ones((B, N), np.float32)], 1),
                 "old_logp": np.concatenate([loss_pad, logprobs_BT], 1),
                 "rewards": rewards.reshape(s.prompts, s.group)}
        t2 = time.perf_counter()
        metrics = self.update(batch)
        return batch, metrics, t1 - t0, t2 - t1, time.perf_counter() - t2

    def update(self, batch):
        t = time.perf_counter()
        self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready(metrics)
        if self.first_update_s is None:
            self.first_update_s = time.perf_counter() - t
        return metrics


def bench_rl(parts, reps, warmup):
    s = parts.shapes
    t = time.perf_counter()
    parts.one_step()
    first = time.perf_counter() - t
    for _ in range(max(warmup - 1, 0)):
        parts.one_step()
    splits = [parts.one_step()[2:] for _ in range(reps)]
    totals = [sum(x) for x in splits]
    t = float(np.median(totals))
    gen_s, host_s, update_s = (float(np.median(col)) for col in zip(*splits))
    n = parts.rows
    return {"samples_s_median": n / t, "samples_s_min": n / max(totals), "samples_s_max": n / min(totals),
            "step_s_median": t, "gen_s": gen_s, "host_s": host_s, "update_s": update_s,
            "gen_frac": gen_s / t, "update_frac": update_s / t, "gen_tok_s": n * s.rl_new / gen_s,
            "first_call_s": first, "prompts": s.prompts, "group": s.group, "prompt_len": s.rl_prompt,
            "new_tokens": s.rl_new, "microbatches": parts.config.rl.grad_accum}


def bench_train(parts, reps, warmup, peak, with_xla_flops):
    batch = parts.one_step()[0]
    t, _, first = timed(lambda: parts.update(batch), reps, warmup)
    cfg, s = parts.cfg, parts.shapes
    P, Gs = s.rl_prompt, s.group
    B, L = batch["tokens"].shape
    lens = np.full(B, L, np.float64)
    # compute.py: causal attention over the L-1 positions the trainer feeds.
    _, model_flops = compute.sequence_flops(cfg, np.zeros(B), lens - 1)
    shared = ts.shares_prompts(cfg, parts.config.rl, B // parts.config.rl.grad_accum, Gs, P, parts.mesh)
    if shared:
        # Each group's prompt once (its P tokens, then the B rows' L-1-P completion positions), every
        # query scoring the L-1 slots of the KV cache (an upper bound: the completion pass's causal
        # blocks skip the slots after each block's last query).
        tokens = B // Gs * P + B * (L - 1 - P)
        computed = 3.0 * compute.forward_flops(cfg, tokens, tokens * (L - 1))
    else:  # every row's prompt: the model FLOPs (causal attention; its blocks compute a bit more)
        computed = model_flops
    res = {"train_s_median": t, "first_call_s": parts.first_update_s or first, "model_gflop_s": model_flops / t / 1e9,
           "peak_gflop_s": peak / 1e9, "mfu": model_flops / t / peak, "frac_of_peak": model_flops / t / peak,
           "computed_frac_of_peak": computed / t / peak, "model_flops_causal": model_flops,
           "model_flops_computed": computed, "shared_prompts": shared, "rows": B, "seq_len": L,
           "microbatches": parts.config.rl.grad_accum}
    if with_xla_flops:
        res.update(xla_flops(cfg, parts.state, batch, computed, P))
    else:
        res.update({"xla_flops": None, "xla_vs_computed": None})
    return res


def xla_flops(cfg, state, batch, computed, prompt_len=PROMPT_LEN):
    """XLA's cost_analysis of the step compiled with one microbatch: it counts a loop body once,
    so the tiny config's 8 accumulated microbatches would show as 1/8 (the gradient is the same)."""
    config = tiny.get_config()
    config.rl.grad_accum = 1
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    opt = ts.make_optimizer(config.optim)
    step = ts.jit_step(ts.rl_step, ts.state_shardings(cfg, opt, mesh), mesh, model_cfg=cfg, rl_cfg=config.rl,
                       optimizer=opt, prompt_len=prompt_len)
    cost = step.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0)) if cost else 0.0
    return {"xla_flops": flops, "xla_vs_computed": flops / computed if flops else None}


# ---- the Hugging Face peer -----------------------------------------------------------------------

HF_SETTINGS = ("static_compiled", "static", "dynamic")  # the likely fastest first: --budget_s drops the last


def hf_model(cfg, device):
    """LlamaForCausalLM with the dims of `cfg`, random weights, in its dtype; the LM head in float32
    with cfg.fp32_lm_head (its input cast up, as ours)."""
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=1 << 16, bos_token_id=1,
        eos_token_id=None, pad_token_id=0)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    if cfg.fp32_lm_head and dtype != torch.float32 and not cfg.tie_embeddings:
        model.lm_head.float()
        model.lm_head.register_forward_pre_hook(lambda _, args: tuple(a.float() for a in args))
    return model


def bench_hf(cfg, shapes, reps, warmup, ours_tok_s, budget_s, settings=HF_SETTINGS):
    """HF generate at the sampler case's shapes, per setting; ours / HF ratios."""
    base = {"batch": shapes.gen_batch, "prompt_len": shapes.prompt, "new_tokens": shapes.new,
            "ours_tok_s": ours_tok_s}
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu"):
        return {**base, "skipped": f"no torch device for the {backend} backend"}
    import torch
    import transformers

    if backend == "gpu" and not torch.cuda.is_available():
        return {**base, "skipped": "torch has no CUDA here"}
    device = "cuda" if backend == "gpu" else "cpu"
    if device == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        settings = [s for s in settings if s != "static_compiled"]  # torch.compile: CUDA only here
    model = hf_model(cfg, device)
    rng = np.random.default_rng(0)
    prompts = torch.as_tensor(rng.integers(2, cfg.vocab_size, size=(shapes.gen_batch, shapes.prompt)),
                              dtype=torch.long, device=device)
    n = shapes.gen_batch * shapes.new
    results = {}
    for setting in settings:
        left = budget_s - (time.time() - START)
        if left < (150 if setting == "static_compiled" else 60):
            results[setting] = {"skipped": f"--budget_s: {left:.0f} s left"}
            continue
        gen_cfg = transformers.GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=shapes.new,
            min_new_tokens=shapes.new, eos_token_id=None, pad_token_id=0, bos_token_id=1,
            cache_implementation=None if setting == "dynamic" else "static",
            disable_compile=setting != "static_compiled")

        def call():
            with torch.inference_mode():
                out = model.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=gen_cfg)
            if device == "cuda":
                torch.cuda.synchronize()
            assert out.shape == (shapes.gen_batch, shapes.prompt + shapes.new), out.shape
            return out

        t, times, first = timed(call, reps, warmup)
        results[setting] = {"tok_s_median": n / t, "call_s_median": t, "step_ms": 1e3 * t / shapes.new,
                            "first_call_s": first}
    measured = {k: v["tok_s_median"] for k, v in results.items() if "tok_s_median" in v}
    fastest = max(measured, key=measured.get) if measured else None
    return {**base, "settings": results, "fastest": fastest, "hf_tok_s": measured.get(fastest),
            "ours_vs_hf": ours_tok_s / measured[fastest] if fastest else None,
            "ours_vs_hf_by_setting": {k: ours_tok_s / v for k, v in measured.items()},
            "attn_implementation": getattr(model.config, "_attn_implementation", None), "torch": torch.__version__,
            "transformers": transformers.__version__, "hf_logprobs": False}


# ---- running the cases, and the ahead-of-time TPU estimate beside them --------------------------

def run_cases(presets, cases, reps, warmup, smoke=False, xla=None, budget_s=1e9):
    for case in cases:
        if case not in ("sampler", "rl", "train", "hf"):
            sys.exit(f"--cases: unknown case {case!r}; valid: sampler, rl, train, hf")
    device = jax.devices()[0]
    for name in presets:
        cfg, shapes = preset_config(name, smoke), preset_shapes(name, smoke)
        accel = name in ACCELERATOR_PRESETS
        pdtype = model_lib.DTYPES[cfg.dtype] if accel else jnp.float32
        peak = None
        if "train" in cases:
            sizes = (1024, 2048) if not accel else (256, 512) if smoke or jax.default_backend() == "cpu" else (4096, 8192)
            peak = matmul_flops_per_s(dtype=pdtype, sizes=sizes)
        big = accel and not smoke and jax.default_backend() != "cpu"

        def bandwidth():
            return copy_bytes_per_s((1 << 30) if big else (64 << 20))

        parts, ours_tok_s = None, None
        for case in cases:
            if case == "sampler" or (case == "hf" and ours_tok_s is None):
                res = bench_sampler(cfg, shapes, reps, warmup, bandwidth)
                ours_tok_s = res["tok_s_median"]
                if case == "hf":  # measured for the ratio only
                    print(json.dumps(_line(name, "sampler", cfg, device, reps, warmup, smoke, res)), flush=True)
            if case in ("rl", "train") and parts is None:
                parts = RLParts(cfg, shapes)
            if case == "rl":
                res = bench_rl(parts, reps, warmup)
            elif case == "train":
                res = bench_train(parts, reps, warmup, peak, not accel if xla is None else xla)
                res["peak_dtype"] = jnp.dtype(pdtype).name
            elif case == "hf":
                res = bench_hf(cfg, shapes, 1 if accel and not smoke else reps, warmup, ours_tok_s, budget_s)
            print(json.dumps(_line(name, case, cfg, device, reps, warmup, smoke, res)), flush=True)


def dry_run_config(cfg, shapes, topology):
    """An experiment config whose train step is the rl case's update (same dims, rows, microbatches)
    and whose decode step has the sampler case's rows per replica, on a TPU slice `topology`: the
    trainer FSDP over every chip, generator replicas tensor-parallel over up to kv-heads chips."""
    from rl_scaling import dry_run

    config = tiny.get_config()
    config.model.update({k: getattr(cfg, k) for k in (
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "rope_theta",
        "norm_eps", "dtype", "param_dtype", "scan_layers", "tie_embeddings")})
    config.rl.fp32_lm_head = config.rollout.fp32_lm_head = cfg.fp32_lm_head
    config.rollout.update(prompts_per_step=shapes.prompts, samples_per_prompt=shapes.group,
                          max_new_tokens=shapes.rl_new, engine_slots=shapes.gen_batch)
    config.task.max_prompt_len = shapes.rl_prompt
    config.rl.update(grad_accum=shapes.grad_accum or config.rl.grad_accum, num_minibatches=1)
    chips = len(dry_run.topology_devices(topology))
    tensor = next(t for t in range(min(chips, cfg.n_kv_heads), 0, -1) if chips % t == 0 and cfg.n_kv_heads % t == 0)
    config.mesh.update(data=1, fsdp=-1, tensor=1, expert=1)
    config.tpu.update(train_topology=topology, gen_topology=topology,
                      gen_mesh=dict(data=chips // tensor, fsdp=1, tensor=tensor, expert=1))
    return config


def bench_dry_run(cfg, shapes, topology):
    """The ahead-of-time TPU estimate (rl_scaling/dry_run.py) of the train and decode steps at this
    preset's shapes: per-chip HBM, and the step time and MFU its roofline and assumed utilisation give."""
    from rl_scaling import dry_run

    out = []
    for r in dry_run.run(dry_run_config(cfg, shapes, topology), steps=("train", "generation"), print_fn=lambda s: None):
        keep = ("step", "topology", "chip", "chips", "mesh", "compile_s", "memory_gib", "capacity_gib",
                "time_roofline_s", "time_est_s", "mfu_roofline", "mfu_est", "tokens_per_s", "bound", "batch")
        out.append({k: r[k] for k in keep if k in r})
    return out


# ---- JSON lines ----------------------------------------------------------------------------------

def _line(name, case, cfg, device, reps, warmup, smoke, res):
    return {"tool": "rl_scaling", "case": case, "preset": name, "smoke": smoke, "backend": jax.default_backend(),
            "device": getattr(device, "device_kind", str(device)), "dtype": cfg.dtype,
            "params_matmul": model_lib.compute_params(cfg), "threads": len(os.sched_getaffinity(0)),
            "reps": reps, "warmup": warmup, **{k: _round(v) for k, v in res.items()},
            "elapsed_s": round(time.time() - START, 1), "loadavg": list(os.getloadavg())}


def _round(v):
    # Six significant digits, not four decimals: small times (a smoke run's roofline_s, 0.003 s) keep
    # their precision.
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    return float(f"{v:.6g}") if isinstance(v, float) and abs(v) < 1e6 else v


# ---- the command line ---------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", "--preset", default="tiny,small", help="tiny,small (the peers'), 1b")
    parser.add_argument("--cases", default="sampler,rl,train", help="sampler,rl,train,hf")
    parser.add_argument("--smoke", action="store_true", help="the 1b preset at CPU-test size (dims and shapes)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per case (median reported; default 5, "
                        "1b: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (compile; default 2, 1b: 1)")
    parser.add_argument("--xla_flops", type=int, default=None, help="1/0: XLA's cost analysis of the train step (a "
                        "second compile; default on for tiny/small, off for 1b)")
    parser.add_argument("--budget_s", type=float, default=440.0, help="the hf case skips settings that would start "
                        "after this many seconds of the process (static_compiled needs 150 s left)")
    parser.add_argument("--dry_run", default="", metavar="TOPOLOGY",
                        help="also the AOT estimate of the preset's train and decode steps on this TPU slice (e.g. "
                             "v5p:2x2x1; needs libtpu, requirements-tpu.txt), one JSON line per step")
    args = parser.parse_args()
    presets, cases = list(filter(None, args.presets.split(","))), list(filter(None, args.cases.split(",")))
    for name in presets:
        if name not in PRESETS:
            sys.exit(f"--presets: unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    accel = any(p in ACCELERATOR_PRESETS for p in presets)
    reps = args.reps if args.reps is not None else 3 if accel and not args.smoke else 5
    warmup = args.warmup if args.warmup is not None else 1 if accel else 2
    if presets:
        run_cases(presets, cases, reps, warmup, args.smoke, None if args.xla_flops is None else bool(args.xla_flops),
                  args.budget_s)
    for name in presets if args.dry_run else ():
        for res in bench_dry_run(preset_config(name, args.smoke), preset_shapes(name, args.smoke), args.dry_run):
            print(json.dumps({"tool": "rl_scaling", "case": "dry_run", "preset": name, "smoke": args.smoke,
                              **{k: _round(v) for k, v in res.items()}}), flush=True)


if __name__ == "__main__":
    main()
