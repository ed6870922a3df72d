"""The recipes table: every recipe builds and validates with the paper's settings; bad names
and conflicting switches fail with errors that name the fields and list the valid values."""

import os
import subprocess
import sys

import pytest

from configs import common, tiny
from rl_scaling import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_RECIPES = ("scalerl", "minimax", "dapo", "grpo", "magistral")


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_every_recipe_builds_and_validates(name):
    c = tiny.get_config(f"recipe={name}")
    config_lib.validate(c)
    assert c.recipe == name
    assert c.rl.kl_coef == 0.0  # the paper drops the KL term everywhere
    # compute-matched tiny budget: every recipe generates ~256k samples
    per_step = c.rollout.prompts_per_step * c.rollout.samples_per_prompt
    assert 256_000 <= c.steps * per_step < 256_000 + per_step


def test_recipes_match_the_paper_table():
    cfg = {name: tiny.get_config(f"recipe={name}") for name in PAPER_RECIPES}
    s, m, d, g, mg = (cfg[n] for n in PAPER_RECIPES)
    # ScaleRL: CISPO, prompt average, batch-level normalization, zero-variance filter, NPR,
    # forced interruption, FP32 heads on both sides
    assert (s.rl.loss, s.rl.aggregation, s.rl.adv_norm) == ("cispo", "prompt", "batch")
    assert s.rl.zero_var_filter and s.rl.no_positive_resampling and s.rl.npr_threshold == 0.9
    assert s.rollout.length_control == "interrupt" and s.rl.fp32_lm_head and s.rollout.fp32_lm_head
    # MiniMax-M1: CISPO, prompt average, FP32 head, zero-variance dropped, PPO-off-policy, batch 1280
    assert (m.rl.loss, m.rl.aggregation, m.rl.zero_var_filter, m.rl.fp32_lm_head) == ("cispo", "prompt", True, True)
    assert not m.rl.no_positive_resampling and m.rollout.length_control == "none"
    # DAPO: asymmetric clip 0.2 / 0.26, prompt average, zero-variance dropped, PPO-off-policy-8, batch 1280
    assert (d.rl.loss, d.rl.eps_low, d.rl.eps_high, d.rl.aggregation) == ("ppo_clip", 0.2, 0.26, "prompt")
    assert d.rl.zero_var_filter and d.rl.num_minibatches == 8 and not d.rl.fp32_lm_head
    # GRPO: symmetric clip 0.2, sample average, group std normalization, PPO-off-policy-8
    assert (g.rl.loss, g.rl.eps_low, g.rl.eps_high, g.rl.aggregation, g.rl.adv_norm) == \
        ("ppo_clip", 0.2, 0.2, "sample", "group")
    assert g.rl.num_minibatches == 8 and not g.rl.zero_var_filter
    # Magistral: as DAPO, prompt average
    assert (mg.rl.loss, mg.rl.eps_high, mg.rl.aggregation) == ("ppo_clip", 0.26, "prompt")
    # Batches: PPO-off-policy-8 generates 8 x the per-update batch; 1280 / 768 for DAPO and MiniMax
    assert s.rollout.prompts_per_step == mg.rollout.prompts_per_step == 32
    assert g.rollout.prompts_per_step == 8 * 32
    assert d.rollout.prompts_per_step == m.rollout.prompts_per_step == 8 * round(32 * 1280 / 768)
    for c in cfg.values():
        assert c.rollout.mode == "sync" and not c.rollout.dynamic_sampling


def test_recipe_table_rows_set_the_same_switches():
    keys = {name: set(r) - {"rl.eps_low", "rl.eps_high"} for name, r in common.RECIPES.items()}
    assert len({frozenset(k) for k in keys.values()}) == 1


def test_bad_recipe_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown recipe 'dapoo'; valid recipes: dapo, grpo, magistral, minimax, scalerl"):
        tiny.get_config("recipe=dapoo")
    with pytest.raises(ValueError, match="valid: recipe, seed, samples, evals"):
        tiny.get_config("recpie=dapo")


def _conflict(**fields):
    c = tiny.get_config()
    for dotted, value in fields.items():
        section, field = dotted.split("__")
        c[section][field] = value
    return c


@pytest.mark.parametrize("fields, message", [
    (dict(rollout__interrupt_phrase="time is up"), r"config.rollout.interrupt_phrase='time is up' must end with '</think>'"),
    (dict(rollout__length_control="truncate"),
     r"config.rollout.length_control='truncate' is not valid; choose one of \['none', 'interrupt', 'overlong'\]"),
    (dict(rollout__think_budget_lo=9), "think_budget_lo=9 and think_budget_hi=8"),
    (dict(rollout__answer_budget=0), "config.rollout.answer_budget=0"),
    (dict(rl__num_minibatches=3), "config.rollout.prompts_per_step=32 must be divisible by config.rl.num_minibatches"),
    (dict(rl__npr_threshold=1.5), r"config.rl.npr_threshold=1.5 must be in \(0, 1\]"),
    (dict(rl__npr_threshold=0.0), r"config.rl.npr_threshold=0.0 must be in \(0, 1\]"),
    (dict(rl__loss="reinforce", rl__num_minibatches=2), "config.rl.loss='reinforce' has no importance weight"),
    (dict(rl__loss="ppo"), r"config.rl.loss='ppo' is not valid; choose one of \['cispo', 'gspo', 'ppo_clip', 'reinforce'\]"),
    (dict(rl__aggregation="seq"), r"config.rl.aggregation='seq' is not valid; choose one of \['prompt', 'sample', 'token'\]"),
    (dict(rl__adv_norm="std"), r"config.rl.adv_norm='std' is not valid; choose one of \['batch', 'group', 'none'\]"),
    (dict(rl__loss="gspo", rl__gspo_eps_high=0.0), "config.rl.gspo_eps_high=0.0 must be positive"),
    (dict(rl__eps_low=1.2), r"config.rl.eps_low=1.2 must be in \[0, 1\)"),
    (dict(rl__kl_coef=-0.1), "config.rl.kl_coef=-0.1 must be >= 0"),
    (dict(rollout__mode="pipeline", rollout__length_control="none", rollout__dynamic_sampling=True),
     "config.rollout.dynamic_sampling=True is not supported with config.rollout.mode='pipeline'"),
    (dict(rollout__dynamic_sampling=True, rollout__dynamic_sampling_rounds=0), "config.rollout.dynamic_sampling_rounds=0"),
    (dict(rollout__length_control="overlong", rl__overlong_cache=16), "config.rl.overlong_cache=16"),
    (dict(rollout__length_control="overlong", rl__overlong_max_len=20), "config.rl.overlong_max_len=20"),
])
def test_conflicting_switches_fail_naming_the_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        config_lib.validate(_conflict(**fields))


def test_ablation_switches_are_independent():
    """The paper's leave-one-out list, each one flag away from ScaleRL, validates."""
    ablations = [
        dict(rl__loss="ppo_clip", rl__eps_high=0.26),  # DAPO loss instead of CISPO
        dict(rl__loss="gspo"),
        dict(rl__aggregation="sample"), dict(rl__aggregation="token"),
        dict(rl__adv_norm="group"), dict(rl__adv_norm="none"),
        dict(rl__zero_var_filter=False), dict(rl__no_positive_resampling=False),
        dict(rollout__length_control="overlong"), dict(rollout__length_control="none"),
        dict(rl__fp32_lm_head=False, rollout__fp32_lm_head=False),
        dict(rl__num_minibatches=8), dict(rollout__dynamic_sampling=True), dict(rl__kl_coef=0.01),
        dict(rollout__mode="pipeline"),  # PipelineRL-k, forced interruption in the engine
    ]
    for fields in ablations:
        config_lib.validate(_conflict(**fields))


def test_flags_reach_the_config_and_bad_ones_fail_in_run_py(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), f"--workdir={tmp_path}",
           "--config=configs/tiny.py:recipe=grpoo"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))
    assert res.returncode != 0 and "valid recipes: dapo, grpo, magistral, minimax, scalerl" in res.stderr


def test_a_label_naming_another_recipe_is_flagged():
    for name in PAPER_RECIPES:
        assert common.recipe_deviations(tiny.get_config(f"recipe={name}")) == []
    c = tiny.get_config()
    c.recipe = "dapo"  # `--config.recipe=dapo` relabels; it does not select DAPO
    assert "rl.loss='cispo' (recipe: 'ppo_clip')" in common.recipe_deviations(c)
    c.recipe = "scalerl+rl.no_positive_resampling=False"  # an ablation's own label
    assert common.recipe_deviations(c) == []
