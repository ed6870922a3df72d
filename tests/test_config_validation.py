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
    ("optim.eps", -1e-8, "config.optim.eps=-1e-08 must be >= 0"),
    ("optim.b2", 1.0, "config.optim.b2=1.0 must be in [0, 1)"),
    ("warmstart.max_steps", 0, "config.warmstart.max_steps=0 must be positive"),
    ("rollout.temperature", float("nan"), "config.rollout.temperature=nan must be a finite number"),
    ("rl.temperature", float("inf"), "config.rl.temperature=inf must be a finite number"),
    ("preemption_grace_s", 0.0, "config.preemption_grace_s=0.0 must be >= 1"),
    ("preemption_grace_s", 0.02, "config.preemption_grace_s=0.02 must be >= 1"),
    ("mesh.data", 0, "config.mesh.data=0 is not a mesh axis size"),
    ("mesh.fsdp", -2, "config.mesh.fsdp=-2 is not a mesh axis size"),
    ("tpu.gen_mesh.tensor", 0, "config.tpu.gen_mesh.tensor=0 is not a mesh axis size"),
    ("rl.logprob_chunk", -1, "config.rl.logprob_chunk=-1 must be >= 0"),
    ("task.heldout_fraction", 1.5, "config.task.heldout_fraction=1.5 must be in [0, 1)"),
    ("task.heldout_fraction", 1.0, "config.task.heldout_fraction=1.0 must be in [0, 1)"),
    ("task.heldout_fraction", -0.5, "config.task.heldout_fraction=-0.5 must be in [0, 1)"),
    ("eval.samples_per_prompt", 10**9, "config.eval.samples_per_prompt=1000000000 must be in [1, 4096]"),
    ("eval.samples_per_prompt", 0, "config.eval.samples_per_prompt=0 must be in [1, 4096]"),
    ("eval.batch_size", 10**12, "GiB of host memory per eval batch"),
    ("rollout.samples_per_prompt", 1, "config.rollout.samples_per_prompt=1 must be in [2, 4096]"),
    ("rollout.max_staleness", -1, "config.rollout.max_staleness=-1 must be >= 0"),
    ("model.attn_query_chunk", -8, "config.model.attn_query_chunk=-8 must be >= 0"),
    ("warmstart.target_pass_rate", 1.5, "config.warmstart.target_pass_rate=1.5 must be in [0, 1]"),
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


@pytest.mark.parametrize("name", ["tiny", "dense_8b", "scout_moe"])
def test_every_numeric_field_has_a_range(name):
    """RANGES (or MESH_FIELDS) covers every int and float field of the shipped configs, which pass."""
    import importlib

    config = importlib.import_module(f"configs.{name}").get_config()
    config_lib.check_ranges(config)
    meshes = tuple(f"config.{m}." for m in config_lib.MESH_FIELDS)
    missing = [n for n, _ in config_lib._numbers(config)
               if n[len("config."):] not in config_lib.RANGES and not n.startswith(meshes)]
    assert not missing


def test_range_checks_need_no_jax():
    """launch/run.py checks the ranges before it locks the workdir, without importing jax."""
    import subprocess

    code = ("import sys; sys.path.insert(0, '.'); from configs import common; from rl_scaling import config; "
            "config.check_ranges(common.base_config()); print('jax' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


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


@pytest.mark.parametrize("flag,value", [("rl.routing_replay", "r4"), ("model.moe_indivisible", "ignore")])
def test_moe_switches_are_named_choices(flag, value):
    from rl_scaling import config as config_lib

    config = tiny.get_config()
    section, field = flag.split(".")
    config[section][field] = value
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        config_lib.validate(config)


def test_full_size_configs_validate():
    """The pod configs pass the same checks as tiny (their model sections come from a preset)."""
    from configs import dense_8b, scout_moe

    for mod in (dense_8b, scout_moe):
        config = mod.get_config()
        config_lib.validate(config)
        cfg = config_lib.model_config(config)
        assert cfg.remat and cfg.attn_query_chunk and cfg.dtype == "bfloat16" and cfg.param_dtype == "float32"
        assert cfg.fp32_lm_head and config.rl.logprob_chunk
        assert (config.rollout.prompts_per_step, config.rollout.samples_per_prompt) == (48, 16)
        assert config.task.max_prompt_len + config.rollout.max_new_tokens == 16384
        assert (config.optim.lr, config.optim.warmup_steps, config.optim.eps, config.optim.weight_decay) == (
            5e-7, 100, 1e-15, 0.01)
    assert config_lib.model_config(scout_moe.get_config()).num_experts == 16

