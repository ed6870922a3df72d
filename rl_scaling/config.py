"""Checks on an experiment config, each error naming the field at fault."""

from __future__ import annotations

from rl_scaling.policy import model as model_lib
from rl_scaling.rl import losses


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


def validate(config) -> None:
    _positive(config, "steps", "eval_every", "checkpoint_every", "log_every", "keep_checkpoints")
    _positive(config, "rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.max_new_tokens",
              "rollout.temperature", "rl.num_minibatches", "rl.temperature", "optim.lr", "optim.grad_clip",
              "eval.num_prompts", "eval.samples_per_prompt", "eval.batch_size", "task.max_prompt_len",
              "warmstart.batch_size", "warmstart.eval_every", "warmstart.probe_prompts")
    _choice(config, "rl.loss", losses.LOSSES)
    _choice(config, "rl.aggregation", losses.AGGREGATIONS)
    _choice(config, "rl.adv_norm", losses.ADV_NORMS)
    if config.rollout.samples_per_prompt < 2:
        raise ValueError("config.rollout.samples_per_prompt must be at least 2: advantages compare samples of a prompt")
    if config.rollout.prompts_per_step % config.rl.num_minibatches:
        raise ValueError(
            f"config.rollout.prompts_per_step={config.rollout.prompts_per_step} must be divisible by "
            f"config.rl.num_minibatches={config.rl.num_minibatches}"
        )
    if config.rollout.temperature != config.rl.temperature:
        raise ValueError("config.rl.temperature must equal config.rollout.temperature (the IS ratio needs the same policy)")
    model_config(config)  # raises on bad model sizes


def model_config(config, fp32_lm_head: bool | None = None) -> model_lib.ModelConfig:
    fields = dict(config.model)
    fields["fp32_lm_head"] = config.rl.fp32_lm_head if fp32_lm_head is None else fp32_lm_head
    return model_lib.ModelConfig(**fields)
