"""Several processes: rl_scaling.distributed. The two-process test starts two CPU processes
joined by jax.distributed on localhost (gloo collectives), runs one RL step on a mesh spanning
both with the batch fed per process, and compares it with this process's single-device step."""

import ast
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from rl_scaling import distributed, sharding
from tests.test_train_step import random_batch, run_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_single_process_helpers_are_identity(mesh1):
    batch = random_batch(0)
    assert distributed.global_batch(batch, mesh1) is batch
    assert not distributed.multiprocess() and distributed.is_main()
    assert distributed.local_rows(sharding.batch_sharding(mesh1, 2), (32, 5)) == (0, 32)
    x = jax.numpy.arange(4)
    np.testing.assert_array_equal(distributed.to_host({"x": x})["x"], np.arange(4))


def test_initialize_without_settings_is_single_process(monkeypatch):
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_SWITCH):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() is False
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.delenv(distributed.ENV_NUM_PROCESSES, raising=False)
    with pytest.raises(ValueError, match="RL_SCALING_NUM_PROCESSES"):
        distributed.initialize()


def _pci(root, **devices):
    for name, (vendor, device) in devices.items():
        (root / name).mkdir(parents=True)
        (root / name / "vendor").write_text(vendor + "\n")
        (root / name / "device").write_text(device + "\n")
    return str(root)


def test_cloud_tpu_vm_is_read_from_the_pci_bus(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setenv("TPU_LIBRARY_PATH", "/opt/libtpu.so")  # libtpu "installed"
    gvnic = ("0x1ae0", "0x0042")  # Google's network card on every GCE VM: not a TPU
    assert distributed._on_cloud_tpu_vm(_pci(tmp_path / "gpu_vm", nic=gvnic, gpu=("0x10de", "0x2335"))) is False
    v5e = _pci(tmp_path / "tpu_vm", nic=gvnic, **{f"chip{i}": ("0x1ae0", "0x0063") for i in range(4)})
    assert distributed._on_cloud_tpu_vm(v5e) is True
    assert distributed._on_cloud_tpu_vm(str(tmp_path / "no_sysfs")) is False
    monkeypatch.delenv("TPU_LIBRARY_PATH")  # chips but no libtpu to drive them
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert distributed._on_cloud_tpu_vm(v5e) is False


def _single_process_samples(mesh):
    from configs import tiny
    from rl_scaling import tasks
    from rl_scaling.rl import train_step as ts
    from rl_scaling.rollout import collect
    from tests.conftest import TINY

    config = tiny.get_config()
    opt = ts.make_optimizer(config.optim)
    state = ts.init_state(TINY, opt, jax.random.key(0), mesh)
    task = tasks.make_task(config.task, 0)
    problems = [task.train_problem(i) for i in range(4)]
    return collect.generate(state["params"], TINY, task, problems, 2, jax.random.key(1),
                            max_prompt_len=config.task.max_prompt_len, max_new_tokens=6, temperature=1.0)[2]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(*args):
    """Run tests/multiprocess_worker.py as processes 0 and 1 of one job; returns their output."""
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   RL_SCALING_COORDINATOR=f"127.0.0.1:{port}", RL_SCALING_NUM_PROCESSES="2",
                   RL_SCALING_PROCESS_ID=str(pid), PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "multiprocess_worker.py"),
                                       *map(str, args)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("rows_given", ["local", "global"])
def test_two_processes_match_one(tmp_path, mesh1, rows_given):
    """One RL step (and one sampling call) on a mesh over both processes' devices, each process
    feeding its own rows, equals the single-device step on the same global batch."""
    _run_two(tmp_path / "out.npz", rows_given)
    got = np.load(tmp_path / "out.npz")

    gen = [np.load(f"{tmp_path / 'out.npz'}.gen{pid}.npz") for pid in range(2)]
    for k in ("tokens", "logprobs", "rewards"):
        np.testing.assert_array_equal(gen[0][k], gen[1][k])  # every process got all samples
    want = _single_process_samples(mesh1)
    np.testing.assert_array_equal(gen[0]["tokens"], want.tokens_BT)
    np.testing.assert_allclose(gen[0]["logprobs"], want.logprobs_BT, rtol=1e-4, atol=1e-5)

    params, metrics = run_step(mesh1, {"grad_accum": 2})
    np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=1e-5, atol=1e-7)
    for path, want in jax.tree_util.tree_leaves_with_path(params):
        np.testing.assert_allclose(got[jax.tree_util.keystr(path)], want, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_two_process_training_run(tmp_path):
    """The run loop on two processes: both finish, agree, and only process 0 writes metrics."""
    outs = _run_two(tmp_path, "train")
    lines = [next(line for line in out.splitlines() if line.startswith("result")) for out in outs]
    results = [ast.literal_eval(line.split(" ", 2)[2]) for line in lines]
    for r in results:
        r.pop("accel_seconds")  # wall-clock: differs per process
    assert results[0] == results[1] and results[0]["step"] == 2  # same counters and eval on both
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoints").exists()
