"""Checks on an experiment config, each error naming the field at fault, its value and the fix.

`check_ranges` is the one table of numeric ranges; it needs no jax, so `launch/run.py` runs it before
anything is written to the workdir. `validate` runs it, then the checks between fields and the
choices (loss names, recipes' switches, model sizes).
"""

from __future__ import annotations

import math
import os

from rl_scaling.policy.model_config import ModelConfig

# The largest group a config may ask for: the rollout server's limit on samples per group too.
MAX_SAMPLES_PER_PROMPT = 4096
# Host bytes per token position of a batch (prompt and completion tokens, masks, log-probs, rewards).
HOST_BYTES_PER_TOKEN = 16


def _choice(config, dotted, valid):
    """A named choice; a field the config leaves out (a preset's model) keeps its checked default."""
    section, field = dotted.split(".")
    if field not in config[section]:
        return
    if config[section][field] not in valid:
        raise ValueError(f"config.{dotted}={config[section][field]!r} is not valid; choose one of {sorted(valid)}")


def _numbers(config, prefix="config"):
    """(dotted name, value) of every int and float field, nested sections included."""
    for key, value in config.items():
        name = f"{prefix}.{key}"
        if hasattr(value, "items"):
            yield from _numbers(value, name)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, value


def _fmt(v):
    return "inf" if v == math.inf else f"{v:g}"


# dotted field -> (low, high, low_open, high_open, what it is / how to fix it). Every int and float
# field of base_config() and the full-size configs is here; a field missing from a config is skipped.
_POS, _NONNEG = (0, math.inf, True, False), (0, math.inf, False, False)
_FRACTION_CO = (0, 1, False, True)  # [0, 1)
RANGES = {
    "seed": (*_NONNEG, "a non-negative integer"),
    "steps": (*_POS, "RL steps"),
    "eval_every": (*_POS, "RL steps between held-out evals"),
    "checkpoint_every": (*_POS, "RL steps between checkpoints"),
    "log_every": (*_POS, "RL steps between log lines"),
    "keep_checkpoints": (*_POS, "checkpoints kept on disk"),
    "preemption_grace_s": (1, math.inf, False, False, "seconds a signal gives the trainer to save its step; "
                           "the default is 60"),
    "task.max_prompt_len": (*_POS, "prompt tokens"),
    "task.heldout_fraction": (*_FRACTION_CO, "the share of problems held out; the default is 0.02"),
    "model.vocab_size": (*_POS, ""), "model.d_model": (*_POS, ""), "model.n_layers": (*_POS, ""),
    "model.n_heads": (*_POS, ""), "model.n_kv_heads": (*_POS, ""), "model.head_dim": (*_POS, ""),
    "model.mlp_dim": (*_POS, ""), "model.rope_theta": (*_POS, ""), "model.norm_eps": (*_POS, ""),
    "model.num_experts": (*_NONNEG, "0 = a dense model"),
    "model.num_experts_per_tok": (1, math.inf, False, False, ""),
    "model.moe_mlp_dim": (*_NONNEG, ""),
    "model.attn_query_chunk": (*_NONNEG, "0 = all queries at once"),
    "model.moe_token_chunk": (*_NONNEG, "0 = all tokens at once"),
    "model.router_aux_loss_coef": (*_NONNEG, ""),
    "rollout.prompts_per_step": (*_POS, ""),
    "rollout.samples_per_prompt": (2, MAX_SAMPLES_PER_PROMPT, False, False,
                                   "advantages compare the samples of a prompt"),
    "rollout.max_new_tokens": (*_POS, ""),
    "rollout.temperature": (*_POS, ""),
    "rollout.cache_segments": (*_POS, ""),
    "rollout.max_staleness": (*_NONNEG, "k of PipelineRL-k"),
    "rollout.queue_size": (*_NONNEG, "0 = 2 x prompts_per_step"),
    "rollout.engine_slots": (*_NONNEG, "0 = prompts_per_step x samples_per_prompt"),
    "rollout.engine_devices": (*_NONNEG, ""),
    "rollout.reconnect_s": (*_POS, "seconds"),
    "rollout.think_budget_lo": (*_NONNEG, ""), "rollout.think_budget_hi": (*_NONNEG, ""),
    "rollout.answer_budget": (*_NONNEG, ""),
    "rollout.dynamic_sampling_rounds": (*_NONNEG, ""),
    "rl.eps_max": (*_POS, "CISPO's importance-weight cap"),
    "rl.eps_low": (*_FRACTION_CO, "PPO's lower clip"), "rl.eps_high": (*_POS, "PPO's upper clip"),
    "rl.gspo_eps_low": (*_FRACTION_CO, ""), "rl.gspo_eps_high": (*_POS, ""),
    "rl.num_minibatches": (*_POS, ""),
    "rl.grad_accum": (*_POS, "microbatches per update"),
    "rl.logprob_chunk": (*_NONNEG, "positions per LM-head chunk; 0 = all at once"),
    "rl.temperature": (*_POS, ""),
    "rl.kl_coef": (*_NONNEG, "0 = off"),
    "rl.npr_threshold": (0, 1, True, False, "a pass rate; the paper's is 0.9"),
    "rl.overlong_max_len": (*_NONNEG, "0 = rollout.max_new_tokens"),
    "rl.overlong_cache": (*_NONNEG, ""),
    "optim.lr": (*_POS, ""), "optim.warmup_steps": (*_NONNEG, ""),
    "optim.b1": (*_FRACTION_CO, ""), "optim.b2": (*_FRACTION_CO, ""),
    "optim.eps": (*_NONNEG, ""), "optim.weight_decay": (*_NONNEG, ""), "optim.grad_clip": (*_POS, ""),
    "warmstart.max_steps": (*_POS, ""), "warmstart.batch_size": (*_POS, ""), "warmstart.lr": (*_POS, ""),
    "warmstart.eval_every": (*_POS, ""), "warmstart.probe_prompts": (*_POS, ""),
    "warmstart.target_pass_rate": (0, 1, False, False, "a pass rate"),
    "eval.num_prompts": (*_POS, ""),
    "eval.samples_per_prompt": (1, MAX_SAMPLES_PER_PROMPT, False, False, "samples of each held-out prompt"),
    "eval.batch_size": (*_POS, "sequences per eval batch"),
    "tpu.hbm_gib": (*_NONNEG, "0 = the chip's capacity"),
    "storage.timeout_s": (*_POS, "seconds a gs:// access may take"),
    "storage.retries": (*_NONNEG, ""),
}
MESH_FIELDS = ("mesh", "tpu.gen_mesh")  # each axis: a positive size, or -1 for the devices left over


def _get(config, dotted):
    node = config
    for part in dotted.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return None
        node = node[part]
    return node


def _range_error(dotted, value, lo, hi, lo_open, hi_open, hint):
    if hi == math.inf:
        need = "positive" if (lo == 0 and lo_open) else (f"> {_fmt(lo)}" if lo_open else f">= {_fmt(lo)}")
    else:
        need = f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    hint = f" ({hint})" if hint else ""
    return ValueError(f"config.{dotted}={value!r} must be {need}{hint}: set --config.{dotted} to a value "
                      f"{'that is ' if need == 'positive' else ''}{need}")


def check_ranges(config) -> None:
    """Every numeric field finite and in its range (RANGES, MESH_FIELDS), and the host memory of one
    batch within this machine's; the first violation raises a ValueError naming the field, its value
    and the fix. Needs no jax: `launch/run.py` runs it before it touches the workdir."""
    for name, value in _numbers(config):  # first: NaN compares false with every bound below
        if not math.isfinite(value):
            raise ValueError(f"{name}={value} must be a finite number; set --{name}=VALUE")
    for dotted, (lo, hi, lo_open, hi_open, hint) in RANGES.items():
        value = _get(config, dotted)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        below = value <= lo if lo_open else value < lo
        above = value >= hi if hi_open else value > hi
        if below or above:
            raise _range_error(dotted, value, lo, hi, lo_open, hi_open, hint)
    for section in MESH_FIELDS:
        mesh = _get(config, section)
        if mesh is None:
            continue
        for axis, size in mesh.items():
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                raise ValueError(f"config.{section}.{axis}={size!r} is not a mesh axis size: give a positive "
                                 f"number of devices, or -1 for the devices the other axes leave; set "
                                 f"--config.{section}.{axis}=1")
        if list(mesh.values()).count(-1) > 1:
            raise ValueError(f"config.{section}: at most one axis may be -1, got {dict(mesh)}; set the others to "
                             "sizes")
    _check_host_memory(config)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def host_batch_bytes(config) -> dict:
    """Estimated host bytes of the largest batch of each kind: an RL step's rollouts (with every
    extra round of dynamic sampling) and an eval batch (whole prompts: at least one prompt's samples)."""
    rc, ev = config.rollout, config.eval
    tokens = config.task.max_prompt_len + rc.max_new_tokens
    rounds = 1 + (rc.dynamic_sampling_rounds if rc.get("dynamic_sampling") else 0)
    eval_rows = max(ev.batch_size // ev.samples_per_prompt, 1) * ev.samples_per_prompt
    return {"rollout": rc.prompts_per_step * rc.samples_per_prompt * rounds * tokens * HOST_BYTES_PER_TOKEN,
            "eval": eval_rows * tokens * HOST_BYTES_PER_TOKEN}


def _check_host_memory(config) -> None:
    total = _physical_memory()
    if not total:
        return
    need = host_batch_bytes(config)
    gib = 2.0**30
    if need["eval"] > total / 2:
        ev = config.eval
        raise ValueError(
            f"config.eval.batch_size={ev.batch_size} with config.eval.samples_per_prompt={ev.samples_per_prompt} "
            f"needs ~{need['eval'] / gib:.1f} GiB of host memory per eval batch, more than half of this machine's "
            f"{total / gib:.1f} GiB; lower --config.eval.batch_size (a batch holds whole prompts, at least one) "
            "or --config.eval.samples_per_prompt")
    if need["rollout"] > total / 2:
        rc = config.rollout
        raise ValueError(
            f"config.rollout.prompts_per_step={rc.prompts_per_step} x config.rollout.samples_per_prompt="
            f"{rc.samples_per_prompt} needs ~{need['rollout'] / gib:.1f} GiB of host memory per step, more than half "
            f"of this machine's {total / gib:.1f} GiB; lower --config.rollout.prompts_per_step")


def validate(config) -> None:
    from rl_scaling.rl import losses

    check_ranges(config)  # every numeric field's range
    _choice(config, "rl.loss", losses.LOSSES)
    _choice(config, "rl.aggregation", losses.AGGREGATIONS)
    _choice(config, "rl.adv_norm", losses.ADV_NORMS)
    _choice(config, "rl.routing_replay", ("off", "r2", "r3"))  # rl/train_step.py REPLAY
    _choice(config, "model.moe_indivisible", ("error", "warn"))  # policy/moe.py INDIVISIBLE
    P, M, A = config.rollout.prompts_per_step, config.rl.num_minibatches, config.rl.grad_accum
    if P % M:  # minibatches of whole prompts (advantages and aggregation are per prompt)
        raise ValueError(f"config.rollout.prompts_per_step={P} must be divisible by config.rl.num_minibatches={M}")
    if (P // M * config.rollout.samples_per_prompt) % A:  # microbatches of whole samples
        raise ValueError(
            f"the {P // M * config.rollout.samples_per_prompt} samples of a minibatch (config.rollout.prompts_per_step "
            f"/ config.rl.num_minibatches x config.rollout.samples_per_prompt) must be divisible by "
            f"config.rl.grad_accum={A}")
    if config.rollout.temperature != config.rl.temperature:
        raise ValueError("config.rl.temperature must equal config.rollout.temperature (the IS ratio needs the same policy)")
    recipe_switches(config)
    model_config(config)  # raises on bad model sizes


def recipe_switches(config) -> None:
    """The recipe zoo's switches (configs/common.py RECIPES) and combinations that cannot work."""
    from rl_scaling.rollout import length_control

    rc, rl = config.rollout, config.rl
    for name in ("rl.zero_var_filter", "rl.no_positive_resampling", "rl.fp32_lm_head", "rollout.fp32_lm_head",
                 "rollout.dynamic_sampling"):
        section, field = name.split(".")
        if not isinstance(config[section][field], bool):
            raise ValueError(f"config.{name}={config[section][field]!r} must be True or False")
    length_control.check(config)
    if rl.no_positive_resampling and not 0.0 < rl.npr_threshold <= 1.0:
        raise ValueError(f"config.rl.npr_threshold={rl.npr_threshold} must be in (0, 1] with "
                         "config.rl.no_positive_resampling=True (the paper: 0.9)")
    if rc.dynamic_sampling and rc.dynamic_sampling_rounds < 1:
        raise ValueError(f"config.rollout.dynamic_sampling_rounds={rc.dynamic_sampling_rounds} must be >= 1 with "
                         "config.rollout.dynamic_sampling=True")
    for low, high in (("eps_low", "eps_high"), ("gspo_eps_low", "gspo_eps_high")):
        if not (0.0 <= rl[low] < 1.0 and rl[high] > 0.0):
            raise ValueError(f"config.rl.{low}={rl[low]} must be in [0, 1) and config.rl.{high}={rl[high]} positive")
    if rl.eps_max <= 0 or rl.kl_coef < 0:
        raise ValueError(f"config.rl.eps_max={rl.eps_max} must be positive and config.rl.kl_coef={rl.kl_coef} >= 0")
    if rl.loss == "reinforce" and (rl.num_minibatches > 1 or rc.mode == "pipeline"):
        raise ValueError(f"config.rl.loss='reinforce' has no importance weight and needs on-policy data, but "
                         f"config.rl.num_minibatches={rl.num_minibatches} / config.rollout.mode={rc.mode!r} train on "
                         "off-policy data; use rl.loss in ['cispo', 'gspo', 'ppo_clip'] or num_minibatches=1, mode='sync'")
    if rc.mode == "pipeline":  # the engine (rollout/engine.py) does forced interruption, not dynamic sampling
        if rc.dynamic_sampling:
            raise ValueError("config.rollout.dynamic_sampling=True is not supported with config.rollout.mode='pipeline'; "
                             "use mode='sync'")


def model_config(config, fp32_lm_head: bool | None = None) -> ModelConfig:
    """config.model as a ModelConfig: a named preset (policy/presets.py) with the section's other
    fields as overrides, or, with preset "", the explicit fields."""
    from rl_scaling.policy import presets

    fields = dict(config.model)
    preset = fields.pop("preset", "")
    fields["fp32_lm_head"] = config.rl.fp32_lm_head if fp32_lm_head is None else fp32_lm_head
    if preset:
        try:
            return presets.get(preset, **fields)
        except TypeError as e:  # a field the ModelConfig does not have
            raise ValueError(f"config.model: {e}") from e
    return ModelConfig(**fields)
