"""Checks on an experiment config, each error naming the field at fault."""

from __future__ import annotations

import math

from rl_scaling.policy import model as model_lib, presets
from rl_scaling.rl import losses
from rl_scaling.rollout import length_control


def _positive(config, *dotted):
    for name in dotted:
        section, field = name.split(".") if "." in name else (None, name)
        value = config[section][field] if section else config[field]
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"config.{name} must be positive, got {value!r}")


def _choice(config, dotted, valid):
    section, field = dotted.split(".")
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


def _at_least(config, bound, *dotted):
    for name in dotted:
        section, field = name.split(".") if "." in name else (None, name)
        value = config[section][field] if section else config[field]
        if not isinstance(value, (int, float)) or value < bound:
            raise ValueError(f"config.{name} must be >= {bound}, got {value!r}")


def validate(config) -> None:
    for name, value in _numbers(config):  # first: NaN compares false with every bound below
        if not math.isfinite(value):
            raise ValueError(f"{name}={value} must be a finite number")
    _positive(config, "steps", "eval_every", "checkpoint_every", "log_every", "keep_checkpoints")
    _positive(config, "rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.max_new_tokens",
              "rollout.temperature", "rollout.cache_segments", "rl.num_minibatches", "rl.temperature", "optim.lr",
              "optim.grad_clip",
              "eval.num_prompts", "eval.samples_per_prompt", "eval.batch_size", "task.max_prompt_len",
              "warmstart.batch_size", "warmstart.eval_every", "warmstart.probe_prompts", "warmstart.max_steps",
              "warmstart.lr", "preemption_grace_s", "rollout.reconnect_s")
    _at_least(config, 0, "optim.eps", "optim.weight_decay", "optim.warmup_steps", "seed")
    for name in ("optim.b1", "optim.b2"):
        if not 0.0 <= config.optim[name.split(".")[1]] < 1.0:
            raise ValueError(f"config.{name}={config.optim[name.split('.')[1]]} must be in [0, 1)")
    _choice(config, "rl.loss", losses.LOSSES)
    _choice(config, "rl.aggregation", losses.AGGREGATIONS)
    _choice(config, "rl.adv_norm", losses.ADV_NORMS)
    if config.rollout.samples_per_prompt < 2:
        raise ValueError("config.rollout.samples_per_prompt must be at least 2: advantages compare samples of a prompt")
    _positive(config, "rl.grad_accum")
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


def model_config(config, fp32_lm_head: bool | None = None) -> model_lib.ModelConfig:
    """config.model as a ModelConfig: a named preset (policy/presets.py) with the section's other
    fields as overrides, or, with preset "", the explicit fields."""
    fields = dict(config.model)
    preset = fields.pop("preset", "")
    fields["fp32_lm_head"] = config.rl.fp32_lm_head if fp32_lm_head is None else fp32_lm_head
    if preset:
        try:
            return presets.get(preset, **fields)
        except TypeError as e:  # a field the ModelConfig does not have
            raise ValueError(f"config.model: {e}") from e
    return model_lib.ModelConfig(**fields)
