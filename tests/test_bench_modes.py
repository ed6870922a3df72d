"""launch/bench_modes.py: the README's command parses, the per-scheme subprocess command it builds
parses, and a smoke run at tiny shapes prints a ratio to sync for each scheme."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "launch", "bench_modes.py")


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_mode_command_is_accepted_by_the_parser(monkeypatch, tmp_path):
    """bench_modes() runs each scheme as `bench_modes.py <flags>`: main() must accept every one of them."""
    bench = _bench_module()
    out = str(tmp_path / "o.json")
    cmd = bench.one_mode_command("sync", 4, "/tmp/w", "/tmp/p", out, prompts=4)
    seen = []
    monkeypatch.setattr(sys, "argv", cmd[1:])
    monkeypatch.setattr(bench, "run_one_mode", lambda *a: seen.append(a) or {"samples_per_s": 1.0})
    bench.main()
    assert seen == [("sync", 4, os.path.join("/tmp/w", "sync"), "/tmp/p", 4)]


def _init_params(path):
    import jax

    sys.path.insert(0, ROOT)
    from configs import tiny
    from rl_scaling import checkpoint, config as config_lib, sharding
    from rl_scaling.rl import train_step as ts

    config = tiny.get_config()
    cfg = config_lib.model_config(config)
    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    opt = ts.make_optimizer(config.optim)
    state = ts.init_state(cfg, opt, jax.random.key(0), mesh, ts.state_shardings(cfg, opt, mesh))
    checkpoint.save_params(path, state["params"])


def _smoke(tmp_path, modes):
    params = str(tmp_path / "params")
    _init_params(params)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    res = subprocess.run([sys.executable, BENCH, f"--modes={modes}", "--steps=4", "--prompts=4",
                          f"--workdir={tmp_path / 'w'}", f"--init_checkpoint={params}"],
                         capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    table = res.stdout.split("scheme")[-1].splitlines()[1:]
    rows = {line.split()[0]: line.split() for line in table if line.strip()}
    assert sorted(rows) == sorted(modes.split(","))
    for row in rows.values():
        assert float(row[1]) > 0, row  # samples/s
        assert row[2].endswith("x")  # the ratio to sync
    assert rows["sync"][2] == "1.00x"


@pytest.mark.slow  # ~60 s on 2 shared cores: two fresh processes, each compiling the tiny RL step
def test_modes_smoke_sync_ppo8(tmp_path):
    _smoke(tmp_path, "sync,ppo8")


@pytest.mark.slow
def test_modes_smoke_every_scheme(tmp_path):
    _smoke(tmp_path, "sync,ppo8,pipeline8,remote8")
