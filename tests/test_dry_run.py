"""Ahead-of-time compilation for TPU slices (rl_scaling/dry_run.py) on this CPU-only machine.

The slow tests run `launch/run.py --dry_run` on the full-size configs (minutes each: the TPU
compiler on two cores) and on a deliberately oversized one; the fast ones exercise the same
machinery on the tiny model and a 4-chip v5e slice."""

import os
import re
import subprocess
import sys

import pytest

from configs import dense_8b, tiny
from rl_scaling import dry_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("libtpu", reason="the TPU compiler (requirements-tpu.txt) is not installed")


def tiny_tpu_config(**tpu):
    config = tiny.get_config()
    config.rollout.prompts_per_step, config.rollout.samples_per_prompt = 4, 4
    config.rollout.engine_slots = 8
    config.rl.grad_accum = 1
    config.tpu.train_topology = config.tpu.gen_topology = "v5e:2x2"
    config.tpu.gen_mesh = dict(data=2, fsdp=1, tensor=2, expert=1)
    config.mesh.fsdp = -1
    for k, v in tpu.items():
        config.tpu[k] = v
    return config


@pytest.fixture(scope="module")
def tiny_results():
    return dry_run.run(tiny_tpu_config(), print_fn=lambda s: None)


def test_tiny_dry_run_compiles_train_decode_prefill(tiny_results):
    steps = {r["step"]: r for r in tiny_results}
    assert set(steps) == {"train", "decode", "prefill"}
    for r in tiny_results:
        assert r["chips"] == 4 and r["chip"] == "TPU v5e" and r["capacity_gib"] == 16
        assert 0 < r["memory_gib"]["total"] < 1  # a 0.2M-parameter model
        assert r["hw_flops"] >= r["model_flops"] > 0
        assert "HBM per chip" in dry_run.format_result(r)
    assert steps["train"]["mesh"]["fsdp"] == 4 and steps["decode"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2,
                                                                                 "expert": 1}
    assert 0 < steps["train"]["mfu_est"] < steps["train"]["mfu_roofline"] <= 1


def test_oversized_step_fails_naming_step_need_and_capacity(tiny_results):
    train = next(r for r in tiny_results if r["step"] == "train")
    with pytest.raises(dry_run.DoesNotFit, match=r"train step does not fit on v5e:2x2: it needs .* GiB per chip.*"
                                                  r"capacity 0\.0 GiB per chip"):
        dry_run.check_fit(train, 1e-6)


def test_bad_topologies_are_clear():
    with pytest.raises(dry_run.DryRunError, match="unknown chip 'v9'"):
        dry_run.chip_of("v9:2x2")
    with pytest.raises(dry_run.DryRunError, match="train_topology is empty"):
        dry_run.run(tiny.get_config())
    with pytest.raises(dry_run.DryRunError, match="config.mesh .* v5e:2x2 .*4 chips"):
        config = tiny_tpu_config()
        config.mesh.fsdp = 8
        dry_run.run(config, steps=("train",))


def test_flop_counts_match_compute_accounting():
    from rl_scaling import compute, config as config_lib

    config = dense_8b.get_config()
    cfg = config_lib.model_config(config)
    model, hw = dry_run.train_flops(cfg, config.rl, 768, 16384)
    _, want = compute.sequence_flops(cfg, [2048] * 768, [16384 - 2048 - 1] * 768)
    assert model == pytest.approx(want, rel=1e-9)
    assert 1.3 < hw / model < 2.0  # remat, chunk recompute, no causal skipping


def _dry_run(config_arg, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the fake CPU devices of conftest are not needed
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "run.py"), f"--config={config_arg}",
                           "--dry_run", *flags], env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)


def _check_report(proc, steps=("train", "decode", "prefill")):
    assert proc.returncode == 0, proc.stderr[-4000:]
    for step in steps:
        assert f"[{step}]" in proc.stdout
    for line in proc.stdout.splitlines():
        if "HBM per chip:" in line:
            need, cap = line.split("HBM per chip:")[1].split(" GiB of ")
            assert float(need) < float(cap.split(" GiB")[0]), line


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense_8b", "scout_moe"])
def test_full_size_dry_run_fits(name):
    proc = _dry_run(os.path.join("configs", f"{name}.py"))
    print(proc.stdout)
    _check_report(proc)
    if name == "scout_moe":  # experts sharded: tokens travel by ragged all-to-all, traffic reported
        assert "'expert': 16}" in proc.stdout.split("[train]")[1].splitlines()[0]
        assert "model.moe_impl='expert_parallel', rl.routing_replay='r3'" in proc.stdout  # the batch's routing fits
        n_ragged = int(re.search(r"'ragged-all-to-all': (\d+)", proc.stdout).group(1))
        assert n_ragged >= 2
        ep, gather = (float(re.search(rf"{v} +(\d+) GB per chip", proc.stdout).group(1)) for v in ("expert_parallel", "gather"))
        assert 0 < ep < gather


def test_moe_traffic_matches_hand_count():
    from rl_scaling.policy import presets

    cfg = presets.tiny_moe(d_model=8, moe_mlp_dim=4, n_layers=2, num_experts=4, dtype="bfloat16", remat=True)
    t = dry_run.moe_traffic(cfg, {"fsdp": 2, "expert": 4}, n_seq=16, seq_len=5, microbatches=2)
    # 10 tokens a chip; 3 passes x 2 layers x 2 directions x 10 x k=1 x 8 values x 2 bytes x 3/4 off-chip
    assert t["expert_parallel"]["tokens"] == pytest.approx(3 * 2 * 2 * 10 * 8 * 2 * 0.75)
    # one local expert (3*8*4 values, 2 bytes) gathered over fsdp 2: half of it arrives; 3 x 2 layers x 2 mb
    assert t["expert_parallel"]["weights"] == pytest.approx(3 * 8 * 4 * 2 * 0.5 * 3 * 2 * 2)
    # all 4 experts over 8 shards: 7/8 of them arrive
    assert t["gather"]["weights"] == pytest.approx(4 * 3 * 8 * 4 * 2 * 7 / 8 * 3 * 2 * 2)
    assert dry_run.moe_traffic(dense_8b_cfg(), {"fsdp": 4}, 1, 1, 1) == {}


def dense_8b_cfg():
    from rl_scaling import config as config_lib

    return config_lib.model_config(dense_8b.get_config())


@pytest.mark.slow
def test_dense_8b_without_microbatches_does_not_fit():
    proc = _dry_run("configs/dense_8b.py", "--config.rl.grad_accum=1", "--dry_run_steps=train")
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "dry run failed: train step does not fit on v5p:2x2x4" in proc.stderr, proc.stderr[-3000:]
    assert "per chip" in proc.stderr


def test_bench_dry_run_reports_the_aot_estimate_beside_the_cases():
    """launch/bench.py --preset=1b --smoke --dry_run=v5e:2x2: one JSON line per compiled step, the
    train step on the rl case's rows, the decode step on the sampler case's."""
    import json

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "bench.py"), "--preset=1b", "--smoke",
                           "--cases=", "--dry_run=v5e:2x2"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    by = {r["step"]: r for r in lines if r["case"] == "dry_run"}
    assert sorted(by) == ["decode", "prefill", "train"]
    assert by["train"]["chips"] == 4 and by["train"]["mesh"]["fsdp"] == 4
    assert "16 sequences of 32 tokens" in by["train"]["batch"]  # the smoke rl case: 4 prompts x 4, 16 + 16
    assert 0 < by["train"]["memory_gib"]["total"] < by["train"]["capacity_gib"]
    assert 0 < by["train"]["mfu_est"] < by["train"]["mfu_roofline"] <= 1
    assert by["decode"]["bound"] in ("memory", "compute") and by["decode"]["tokens_per_s"] > 0
