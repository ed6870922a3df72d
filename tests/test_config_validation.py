"""Config validation names the field at fault; an init_checkpoint of other shapes lists only the
leaves that differ."""

import os
import sys

import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import tiny  # noqa: E402
from rl_scaling import checkpoint, config as config_lib  # noqa: E402


@pytest.mark.parametrize("field, value, message", [
    ("optim.lr", float("nan"), "config.optim.lr=nan must be a finite number"),
    ("optim.eps", -1e-8, "config.optim.eps must be >= 0"),
    ("optim.b2", 1.0, "config.optim.b2=1.0 must be in [0, 1)"),
    ("warmstart.max_steps", 0, "config.warmstart.max_steps must be positive"),
    ("rollout.temperature", float("nan"), "config.rollout.temperature=nan must be a finite number"),
    ("rl.temperature", float("inf"), "config.rl.temperature=inf must be a finite number"),
    ("preemption_grace_s", 0.0, "config.preemption_grace_s must be positive"),
    ("warmstart.target_pass_rate", float("nan"), "config.warmstart.target_pass_rate=nan must be a finite number"),
])
def test_bad_numbers_are_rejected_naming_the_field(field, value, message):
    config = tiny.get_config()
    section, _, name = field.rpartition(".")
    (config[section] if section else config)[name] = value
    with pytest.raises(ValueError) as e:
        config_lib.validate(config)
    assert message in str(e.value)


def test_the_defaults_pass():
    config_lib.validate(tiny.get_config())


def test_init_checkpoint_of_other_shapes_lists_only_the_differences(tmp_path):
    saved = {"embed": jnp.zeros((64, 8)), "layer": {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}, "head": jnp.zeros((8, 4))}
    checkpoint.save_params(str(tmp_path / "params"), saved)
    wanted = {"embed": jnp.zeros((64, 16)), "layer": {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)},
              "norm": jnp.zeros(16)}
    with pytest.raises(ValueError) as e:
        checkpoint.load_params(str(tmp_path / "params"), wanted)
    lines = str(e.value).splitlines()
    assert "does not match config.model (3 differing leaves)" in lines[0]
    assert sorted(line.strip() for line in lines[1:]) == [
        "['embed']: checkpoint (64, 8), config (64, 16)",
        "['head']: in the checkpoint only ((8, 4))",
        "['norm']: missing from the checkpoint (config (16,))",
    ]
