"""Ahead-of-time proof that a config's steps compile and fit on its TPU slices, on a CPU machine.

`python launch/run.py --config=configs/dense_8b.py --dry_run` compiles, for the TPU topologies in
`config.tpu` (libtpu's compiler, no TPU attached; `jax.experimental.topologies`):

  train    `rl_step` through `train_step.jit_step`, exactly as the run jits it: the full batch
           (rollout.prompts_per_step x samples_per_prompt sequences of task.max_prompt_len +
           rollout.max_new_tokens tokens), rl.grad_accum / rl.logprob_chunk / model.remat /
           model.attn_query_chunk, the state sharded by `config.mesh` over tpu.train_topology.
  decode   one generation step of the sampler (`rollout/sampler.py`, `rollout/engine.py`: one
           token for every slot, float32 logits, a sampled token and its log-prob) over the
           rollout.engine_slots rows of each generator replica, with a KV cache of the full
           length, on tpu.gen_mesh over tpu.gen_topology (`data` = replicas). The generator holds
           the trainer's params resharded to its mesh, cast to the body's dtype (the LM head stays
           float32 with rollout.fp32_lm_head, as ScaleRL's generators compute float32 logits).
  prefill  one prompt per replica (task.max_prompt_len tokens) into a fresh cache, as the
           engine's prefill does before inserting the prompt into a slot.

For each it prints per-chip HBM (`compiled.memory_analysis()`: arguments + outputs + temporaries -
aliased (donated) buffers, which is what the program holds at its peak) against the chip's capacity,
FLOPs and an estimated time, and raises `DoesNotFit` (launch/run.py exits non-zero) naming the step,
the need and the capacity when a step does not fit (or the TPU compiler itself runs out of HBM).

Estimates (stated assumptions, not measurements):
  model FLOPs    rl_scaling/compute.py's count: 2N per token forward (N: matmul parameters a token
                 touches, LM head included, routed experts only) + causal attention, x3 to train.
  hardware FLOPs what the compiled program executes: the forward once more for every level of
                 recompute (model.remat: the layer; logprob_chunk: the LM head; attn_query_chunk:
                 attention again inside the layer's backward) and attention over the full T x S
                 rectangle (no causal block skipping: 2x the causal count).
  time           compute-bound roofline: hardware FLOPs / (chips x bf16 peak), i.e. 100% of peak,
                 a lower bound; also shown at an assumed hardware-FLOPs utilisation (UTILISATION).
                 MFU = model FLOPs / (chips x peak x time). Decoding is memory-bound: a step
                 reads every parameter and the whole KV cache once per chip, so its time is
                 max(FLOPs / peak, bytes / HBM bandwidth) per chip.
  MoE traffic    `moe_traffic`: bytes per chip per train step that the routed experts move, for
                 expert parallelism and for the weight-gather variant on the same mesh (analytic:
                 the collectives sit in loops whose trip counts the compiled program's analyses do
                 not multiply in), and their time at the chip's full ICI bandwidth (a lower bound),
                 added to the step time as if nothing overlapped (an upper bound). The report also
                 counts the collective instructions the compiler was given.
  XLA cost       `compiled.cost_analysis()["flops"]` counts the body of a loop once (the layer scan,
                 the microbatch scan, the attention/log-prob chunk maps), so it is far below the
                 real count; it is printed as a cross-check of the per-iteration work only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
from flax import linen as nn

from rl_scaling import config as config_lib, sharding
from rl_scaling.policy import model as model_lib
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import engine, sampler

GIB = 2**30
UTILISATION = 0.5  # assumed achieved share of peak on hardware FLOPs, for the "realistic" time


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_gib: float  # HBM per chip
    peak_tflops: float  # dense bf16 peak per chip
    hbm_gbps: float  # HBM bandwidth per chip, GB/s
    ici_gbps: float  # inter-chip interconnect bandwidth per chip, Gbit/s (all links together)


# Public per-chip specs (cloud.google.com/tpu/docs/system-architecture-tpu-vm and the v4/v5e/v5p/v6e
# pages); a v4/v5p chip is one JAX device (megacore).
CHIPS = {
    "v4": Chip("TPU v4", 32, 275, 1228, 2400),
    "v5e": Chip("TPU v5e", 16, 197, 819, 1600),
    "v5p": Chip("TPU v5p", 95, 459, 2765, 4800),
    "v6e": Chip("TPU v6e", 32, 918, 1640, 3584),
}


class DoesNotFit(RuntimeError):
    """A step needs more HBM per chip than the slice has."""


class DryRunError(ValueError):
    """The config cannot be dry-run (no topology, a mesh that does not match it, ...)."""


def chip_of(topology: str) -> Chip:
    kind = topology.split(":")[0].lower()
    if kind not in CHIPS:
        raise DryRunError(f"TPU topology {topology!r}: unknown chip {kind!r}; known: {sorted(CHIPS)} "
                          "(write it like 'v5p:2x2x4')")
    return CHIPS[kind]


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
    """The devices of a TPU slice, for compiling only (libtpu's compiler; no TPU needed)."""
    from jax.experimental import topologies

    chip_of(topology)
    # libtpu's harmless "no TPU here" warnings; no lockfile: compiling only, several processes
    # (pytest -n 2) may hold libtpu at once.
    for var, value in (("TPU_STDERR_LOG_LEVEL", "3"), ("TPU_MIN_LOG_LEVEL", "3"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(var, value)
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # noqa: BLE001 - libtpu missing or an unknown shape
        raise DryRunError(f"cannot describe TPU topology {topology!r}: {e}\n(needs libtpu: "
                          "pip install -r requirements-tpu.txt)") from e
    return tuple(desc.devices)


def topology_mesh(topology: str, shape: dict, what: str):
    devices = list(topology_devices(topology))
    try:
        return sharding.make_mesh(dict(shape), devices)
    except ValueError as e:
        raise DryRunError(f"{what} on {topology} ({len(devices)} chips): {e}") from e


# ---- FLOPs -------------------------------------------------------------------------------------


def _flop_parts(cfg: model_lib.ModelConfig, tokens: float, ctx_sum: float) -> dict:
    """Forward FLOPs of `tokens` tokens whose attention contexts sum to ctx_sum."""
    head = 2.0 * cfg.d_model * cfg.vocab_size * tokens
    matmul = 2.0 * model_lib.compute_params(cfg) * tokens
    attn = 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * ctx_sum
    return {"body": matmul - head, "head": head, "attn": attn}


def train_flops(cfg: model_lib.ModelConfig, rl_cfg, n_seq: int, seq_len: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one rl_step over n_seq full-length sequences."""
    T = seq_len - 1  # token_logprobs feeds all but the last token
    f = _flop_parts(cfg, n_seq * T, n_seq * T * (T + 1) / 2.0)
    model = 3.0 * (f["body"] + f["head"] + f["attn"])  # k minibatches split the batch: one pass over it
    remat = 1.0 if cfg.remat else 0.0
    hw = ((3 + remat) * f["body"]
          + (3 + (1.0 if rl_cfg.logprob_chunk else 0.0)) * f["head"]
          + (3 + remat + (1.0 if cfg.attn_query_chunk else 0.0)) * 2.0 * f["attn"])
    return model, hw


def decode_flops(cfg: model_lib.ModelConfig, rows: int, cache_len: int, mean_ctx: float) -> tuple[float, float]:
    """(model FLOPs at the mean context, hardware FLOPs over the full cache) of one decode step."""
    model_f = _flop_parts(cfg, rows, rows * mean_ctx)
    hw_f = _flop_parts(cfg, rows, rows * cache_len)
    model = model_f["body"] + model_f["head"] + model_f["attn"]
    hw = hw_f["body"] + hw_f["head"] + hw_f["attn"]
    return model, hw


# ---- MoE traffic --------------------------------------------------------------------------------


def moe_traffic(cfg: model_lib.ModelConfig, mesh_shape: dict, n_seq: int, seq_len: int, microbatches: int) -> dict:
    """Bytes per chip that the routed experts move in one train step, for the two MoE variants
    on the same mesh (analytic; policy/moe.py's docstring derives it):

      expert_parallel  tokens: 2 exchanges (out and back) of T*k rows of D values per layer and
                       pass, the (n - 1) / n share of them that leaves the chip under balanced
                       routing (n = mesh expert); weights: each chip's E/n experts gathered over
                       fsdp, once per layer, pass and microbatch.
      gather           weights only: all E experts gathered over fsdp x expert, once per layer,
                       pass and microbatch.

    T: a chip's tokens per step (the batch split over data x fsdp x expert). Passes: forward,
    backward and, with model.remat, the recomputed forward (the backward pass's collectives are
    the transposes of the forward's: same bytes). Values travel in the body dtype (moe.py casts
    the weights before the shard_map)."""
    if not cfg.num_experts:
        return {}
    size = model_lib.DTYPES[cfg.dtype](0).dtype.itemsize
    n_ep, fsdp = mesh_shape.get("expert", 1), mesh_shape.get("fsdp", 1)
    tensor = mesh_shape.get("tensor", 1)
    batch_shards = mesh_shape.get("data", 1) * fsdp * n_ep
    passes = 3 if cfg.remat else 2
    tokens = n_seq * seq_len / batch_shards
    expert_bytes = 3 * cfg.d_model * cfg.moe_mlp_dim * size / tensor  # one expert's weights on a chip
    per_layer = passes * cfg.n_layers
    tokens_ep = 2 * tokens * cfg.num_experts_per_tok * cfg.d_model * size * (n_ep - 1) / n_ep * per_layer
    weights_ep = expert_bytes * cfg.num_experts / n_ep * (fsdp - 1) / fsdp * per_layer * microbatches
    shards = fsdp * n_ep
    weights_gather = expert_bytes * cfg.num_experts * (shards - 1) / shards * per_layer * microbatches
    return {"expert_parallel": {"tokens": tokens_ep, "weights": weights_ep, "total": tokens_ep + weights_ep},
            "gather": {"tokens": 0.0, "weights": weights_gather, "total": weights_gather}}


# ---- the steps ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _compile_errors(step: str, topology: str, capacity_gib: float):
    try:
        yield
    except Exception as e:  # noqa: BLE001 - XlaRuntimeError and friends
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Ran out of memory" in text:
            first = next((line for line in text.splitlines() if "memory" in line.lower()), text[:300])
            raise DoesNotFit(f"{step} step does not fit on {topology}: the TPU compiler ran out of HBM "
                             f"(capacity {capacity_gib:.1f} GiB per chip): {first.strip()} {HINTS.get(step, '')}") from e
        raise


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "temps": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes}
    out["total"] = out["arguments"] + out["outputs"] + out["temps"] - out["aliased"]
    return {k: v / GIB for k, v in out.items()}


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def check_fit(result: dict, capacity_gib: float) -> None:
    need = result["memory_gib"]["total"]
    if need > capacity_gib:
        raise DoesNotFit(
            f"{result['step']} step does not fit on {result['topology']}: it needs {need:.1f} GiB per chip "
            f"(arguments {result['memory_gib']['arguments']:.1f} + outputs {result['memory_gib']['outputs']:.1f} "
            f"+ temporaries {result['memory_gib']['temps']:.1f} - aliased {result['memory_gib']['aliased']:.1f}), "
            f"capacity {capacity_gib:.1f} GiB per chip. {HINTS.get(result['step'], '')}")


HINTS = {
    "train": "Raise rl.grad_accum, set model.remat / rl.logprob_chunk / model.attn_query_chunk, or use more chips.",
    "decode": "Lower rollout.engine_slots, or give each replica more chips (config.tpu.gen_mesh tensor).",
    "prefill": "Give each replica more chips (config.tpu.gen_mesh tensor).",
}


def compile_train(config) -> dict:
    tpu = config.tpu
    chip = chip_of(tpu.train_topology)
    capacity = tpu.hbm_gib or chip.hbm_gib
    mesh = topology_mesh(tpu.train_topology, config.mesh, "config.mesh (the trainer's)")
    cfg = config_lib.model_config(config, config.rl.fp32_lm_head)
    optimizer = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(cfg, optimizer, mesh)
    abstract_state = jax.eval_shape(lambda: ts.init_state(cfg, optimizer, jax.random.key(0), mesh, state_sh))
    P, G = config.rollout.prompts_per_step, config.rollout.samples_per_prompt
    L = config.task.max_prompt_len + config.rollout.max_new_tokens
    N = P * G
    batch = {"tokens": jax.ShapeDtypeStruct((N, L), jnp.int32), "token_mask": jax.ShapeDtypeStruct((N, L), bool),
             "loss_mask": jax.ShapeDtypeStruct((N, L), jnp.float32),
             "old_logp": jax.ShapeDtypeStruct((N, L), jnp.float32),
             "rewards": jax.ShapeDtypeStruct((P, G), jnp.float32)}
    replay = ts.replay_mode(config.rl, cfg)
    if replay == "r3":  # the generator's experts of every token and layer ride in the batch
        batch["routing"] = jax.ShapeDtypeStruct((N, L, cfg.n_layers, cfg.num_experts_per_tok), jnp.int32)
    step = ts.jit_step(ts.rl_step, state_sh, mesh, batch_keys=ts.rl_batch_keys(config.rl, cfg), model_cfg=cfg,
                       rl_cfg=config.rl, optimizer=optimizer)
    t0 = time.time()
    with _compile_errors("train", tpu.train_topology, capacity):
        compiled = step.lower(abstract_state, batch).compile()
    chips = mesh.devices.size
    model, hw = train_flops(cfg, config.rl, N, L)
    result = {"step": "train", "topology": tpu.train_topology, "chip": chip.name, "chips": chips,
              "mesh": dict(mesh.shape), "capacity_gib": capacity, "compile_s": time.time() - t0,
              "memory_gib": _memory(compiled), "xla_flops_per_chip": _xla_flops(compiled),
              "model_flops": model, "hw_flops": hw,
              "batch": f"{P} prompts x {G} samples = {N} sequences of {L} tokens, "
                       f"{config.rl.num_minibatches} update(s) x {config.rl.grad_accum} microbatches of "
                       f"{N // config.rl.num_minibatches // config.rl.grad_accum}"}
    peak = chips * chip.peak_tflops * 1e12
    result["time_roofline_s"] = hw / peak
    result["time_est_s"] = hw / (peak * UTILISATION)
    result["mfu_roofline"] = model / (peak * result["time_roofline_s"])
    result["mfu_est"] = model / (peak * result["time_est_s"])
    traffic = moe_traffic(cfg, dict(mesh.shape), N, L, config.rl.num_minibatches * config.rl.grad_accum)
    if traffic:
        result["moe_impl"] = cfg.moe_impl
        result["routing_replay"] = replay
        result["moe_traffic"] = {k: dict(v, time_s=v["total"] / (chip.ici_gbps / 8 * 1e9)) for k, v in traffic.items()}
        result["collectives"] = _collective_ops(compiled)
    return result


def _collective_ops(compiled) -> dict:
    """How many all-to-all, ragged-all-to-all and all-gather instructions the compiled program
    has (loop bodies once): shows which exchange the TPU compiler was given."""
    text = compiled.as_text()
    return {op: text.count(f" {op}(") for op in ("ragged-all-to-all", "all-to-all", "all-gather")}


def gen_params_abstract(cfg: model_lib.ModelConfig, mesh, layout=None):
    """Abstract generator params on `mesh` as the engine holds them: split per layer
    (model_lib.split_layers) on the engine's shardings (engine.generator_layout), the body in
    cfg.dtype, the LM head float32 when cfg.fp32_lm_head (what the trainer pushes, resharded and cast)."""
    shapes = jax.eval_shape(lambda: model_lib.split_layers(nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))))
    shardings = (layout or engine.generator_layout(cfg, mesh)).split_params
    body = model_lib.DTYPES[cfg.dtype]

    def leaf(path, x, s):
        keep_f32 = cfg.fp32_lm_head and "lm_head" in jax.tree_util.keystr(path)
        dtype = jnp.float32 if keep_f32 else (body if x.dtype == jnp.float32 else x.dtype)
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=s)

    return jax.tree_util.tree_map_with_path(leaf, shapes, shardings), shardings


def generation_layout(config, devices) -> dict:
    """What the dry run compiles generation with, over `devices` (the generator slice's chips):
    the mesh config.tpu.gen_mesh names (`data` = replicas), the engine's layout on it
    (engine.generator_layout, the function every engine is built with), the abstract params and
    the abstract KV cache of all replicas' slots, and the mesh one replica's engine builds
    (engine.generator_mesh over one replica's chips: what `launch/serve.py` runs)."""
    devices = list(devices)
    try:
        mesh = sharding.make_mesh(dict(config.tpu.gen_mesh), devices)
    except ValueError as e:
        raise DryRunError(f"config.tpu.gen_mesh on {len(devices)} chips: {e}") from e
    cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    layout = engine.generator_layout(cfg, mesh)
    rc = config.rollout
    replicas = mesh.shape["data"]
    slots = rc.engine_slots or rc.prompts_per_step * rc.samples_per_prompt
    rows = replicas * slots
    params, _ = gen_params_abstract(cfg, mesh, layout)
    cache_len = config.task.max_prompt_len + rc.max_new_tokens
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(lambda: model_lib.init_cache(cfg, rows, cache_len)), layout.cache)
    per_replica = len(devices) // replicas
    replica_mesh = engine.generator_mesh(config.tpu.gen_mesh, devices[:per_replica])
    return {"mesh": mesh, "cfg": cfg, "layout": layout, "params": params, "cache": cache, "replicas": replicas,
            "slots": slots, "rows": rows, "cache_len": cache_len, "replica_mesh": replica_mesh,
            "replica_layout": engine.generator_layout(cfg, replica_mesh)}


def decode_step(params, cache, token_B, pos_B, active_B, rng, *, cfg, temperature):
    """One token for every row: the sampler's loop body (float32 logits, sample, log-prob)."""
    logits_B1V, cache = model_lib.Decoder(cfg).apply({"params": params}, token_B[:, None], pos_B[:, None],
                                                     active_B[:, None], cache)
    scaled_BV = logits_B1V[:, 0].astype(jnp.float32) / temperature
    next_B = sampler.categorical(rng, scaled_BV)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(scaled_BV), next_B[:, None], axis=1)[:, 0]
    return next_B, logp_B, cache


def prefill_step(params, tokens_BP, mask_BP, *, cfg, cache_len):
    """A fresh KV cache for B prompts (the engine's prefill; the first generate step feeds the
    prompt's last token, so no logits are needed here)."""
    cache = model_lib.init_cache(cfg, tokens_BP.shape[0], cache_len)
    _, cache = model_lib.Decoder(cfg).apply({"params": params}, tokens_BP, model_lib.positions_from_mask(mask_BP),
                                            mask_BP, cache)
    return cache


def compile_generation(config) -> list[dict]:
    tpu = config.tpu
    chip = chip_of(tpu.gen_topology)
    capacity = tpu.hbm_gib or chip.hbm_gib
    gen = generation_layout(config, topology_devices(tpu.gen_topology))
    mesh, cfg, layout, params, cache = gen["mesh"], gen["cfg"], gen["layout"], gen["params"], gen["cache"]
    rc = config.rollout
    replicas, slots, rows, S = gen["replicas"], gen["slots"], gen["rows"], gen["cache_len"]
    chips, chips_per_replica = mesh.devices.size, mesh.devices.size // replicas
    param_sh, cache_sh, row_sh, rep = layout.split_params, layout.cache, layout.rows, layout.replicated
    fn = functools.partial(decode_step, cfg=cfg, temperature=rc.temperature)
    jitted = jax.jit(fn, in_shardings=(param_sh, cache_sh, row_sh, row_sh, row_sh, rep),
                     out_shardings=(row_sh, row_sh, cache_sh), donate_argnums=1)
    B = jax.ShapeDtypeStruct
    args = (params, cache, B((rows,), jnp.int32), B((rows,), jnp.int32), B((rows,), bool),
            jax.eval_shape(lambda: jax.random.key(0)))
    t0 = time.time()
    with _compile_errors("decode", tpu.gen_topology, capacity), sharding.tracing_mesh(mesh):
        compiled = jitted.lower(*args).compile()
    mem = _memory(compiled)
    mean_ctx = config.task.max_prompt_len + rc.max_new_tokens / 2.0
    model, hw = decode_flops(cfg, rows, S, mean_ctx)
    peak, bw = chips * chip.peak_tflops * 1e12, chip.hbm_gbps * 1e9
    # Every chip reads its share of the parameters and of the cache once per step.
    t_compute, t_memory = hw / peak, mem["arguments"] * GIB / bw
    t_step = max(t_compute, t_memory)
    decode = {"step": "decode", "topology": tpu.gen_topology, "chip": chip.name, "chips": chips,
              "mesh": dict(mesh.shape), "capacity_gib": capacity, "compile_s": time.time() - t0,
              "memory_gib": mem, "xla_flops_per_chip": _xla_flops(compiled), "model_flops": model, "hw_flops": hw,
              "batch": f"{replicas} replicas x {slots} slots ({chips_per_replica} chips each), KV cache of {S} tokens",
              "time_roofline_s": t_step, "bound": "memory" if t_memory >= t_compute else "compute",
              "tokens_per_s": rows / t_step, "mfu_roofline": model / (peak * t_step),
              "layout": f"{replicas} replica(s) of {chips_per_replica} chips, each an engine with "
                        f"{gen['replica_layout'].describe()} (launch/serve.py --num_devices={chips_per_replica} "
                        "builds it from config.tpu.gen_mesh)"}
    gen_tokens = rc.prompts_per_step * rc.samples_per_prompt * rc.max_new_tokens
    decode["step_batch_s"] = gen_tokens / decode["tokens_per_s"]  # all samples at the full budget
    results = [decode]

    # Prefill: one prompt per replica into a prompt-length cache (JetStream prefill, then insert).
    Pl = config.task.max_prompt_len
    fn = functools.partial(prefill_step, cfg=cfg, cache_len=Pl)
    pre_cache_sh = layout.cache
    jitted = jax.jit(fn, in_shardings=(param_sh, row_sh, row_sh), out_shardings=pre_cache_sh)
    t0 = time.time()
    with _compile_errors("prefill", tpu.gen_topology, capacity), sharding.tracing_mesh(mesh):
        compiled = jitted.lower(params, B((replicas, Pl), jnp.int32), B((replicas, Pl), bool)).compile()
    f = _flop_parts(cfg, replicas * Pl, replicas * Pl * (Pl + 1) / 2.0)
    model = f["body"] + f["attn"]  # no LM head: the cache is all prefill keeps
    hw = f["body"] + 2.0 * f["attn"]
    results.append({"step": "prefill", "topology": tpu.gen_topology, "chip": chip.name, "chips": chips,
                    "mesh": dict(mesh.shape), "capacity_gib": capacity, "compile_s": time.time() - t0,
                    "memory_gib": _memory(compiled), "xla_flops_per_chip": _xla_flops(compiled),
                    "model_flops": model, "hw_flops": hw, "batch": f"{replicas} prompts of {Pl} tokens",
                    "time_roofline_s": hw / peak, "mfu_roofline": model / hw})
    return results


# ---- report ------------------------------------------------------------------------------------


def _fmt_flops(x: float) -> str:
    return f"{x:.3g}"


def format_result(r: dict) -> str:
    m = r["memory_gib"]
    lines = [
        f"[{r['step']}] {r['chips']} x {r['chip']} ({r['topology']}), mesh {r['mesh']}; {r['batch']}",
        f"  compiled in {r['compile_s']:.0f} s",
        f"  HBM per chip: {m['total']:.2f} GiB of {r['capacity_gib']:.1f} GiB ({100 * m['total'] / r['capacity_gib']:.0f}%)"
        f" = arguments {m['arguments']:.2f} + outputs {m['outputs']:.2f} + temporaries {m['temps']:.2f}"
        f" - aliased {m['aliased']:.2f}",
        f"  FLOPs per step: model {_fmt_flops(r['model_flops'])}, hardware (incl. recompute) {_fmt_flops(r['hw_flops'])};"
        f" XLA cost_analysis {_fmt_flops(r['xla_flops_per_chip'])} per chip (loop bodies counted once)",
    ]
    if r["step"] == "train":
        lines.append(f"  est. step time: {r['time_roofline_s']:.1f} s at 100% of bf16 peak (MFU {100 * r['mfu_roofline']:.0f}%),"
                     f" {r['time_est_s']:.1f} s at {100 * UTILISATION:.0f}% (MFU {100 * r['mfu_est']:.0f}%)")
        if "moe_traffic" in r:
            lines.append(f"  routed experts (model.moe_impl={r['moe_impl']!r}, rl.routing_replay={r['routing_replay']!r}; "
                         f"compiled: {r['collectives']}):")
            for name, t in r["moe_traffic"].items():
                lines.append(f"    {name:15s} {t['total'] / 1e9:7.0f} GB per chip per step (tokens {t['tokens'] / 1e9:.0f}"
                             f" + weights {t['weights'] / 1e9:.0f}), {t['time_s']:.1f} s at full ICI bandwidth;"
                             f" est. step {r['time_est_s'] + t['time_s']:.1f} s without overlap")
    elif r["step"] == "decode":
        lines.append(f"  generator layout: {r['layout']}")
        lines.append(f"  est. decode step: {1e3 * r['time_roofline_s']:.1f} ms ({r['bound']}-bound roofline), "
                     f"{r['tokens_per_s']:.0f} tokens/s over the slice, MFU {100 * r['mfu_roofline']:.1f}%;"
                     f" one RL step's samples at the full budget in {r['step_batch_s']:.0f} s")
    else:
        lines.append(f"  est. prefill: {1e3 * r['time_roofline_s']:.1f} ms at 100% of peak")
    return "\n".join(lines)


def run(config, steps=("train", "generation"), print_fn=print) -> list[dict]:
    """Compile and check the config's steps; returns their reports, raises DoesNotFit."""
    tpu = config.tpu
    if "train" in steps and not tpu.train_topology:
        raise DryRunError("config.tpu.train_topology is empty: name the trainer's TPU slice, e.g. 'v5p:2x2x4'")
    if "generation" in steps and not tpu.gen_topology:
        raise DryRunError("config.tpu.gen_topology is empty: name the generators' TPU slice, e.g. 'v5p:4x4x4'")
    config_lib.validate(config)
    results = []
    if "train" in steps:
        r = compile_train(config)
        print_fn(format_result(r))
        check_fit(r, r["capacity_gib"])
        results.append(r)
    if "generation" in steps:
        for r in compile_generation(config):
            print_fn(format_result(r))
            check_fit(r, r["capacity_gib"])
            results.append(r)
    return results


def summary(results: list[dict]) -> str:
    by = {r["step"]: r for r in results}
    parts = []
    if "train" in by and "decode" in by:
        t, d = by["train"], by["decode"]
        parts.append(f"PipelineRL overlaps the two: an RL step takes about max(train {t['time_est_s']:.0f} s, "
                     f"generation {d['step_batch_s']:.0f} s) on {t['chips']} + {d['chips']} chips "
                     "(train at the assumed utilisation; generation with every sample at the full budget).")
    return "\n".join(parts)
