"""launch/run.py's user errors: one line on stderr (the field, the value, the fix), exit status 1,
the traceback only with --verbose, and nothing left in the workdir; --print_config lists the fields."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "launch", "run.py")


def run(*flags, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run([sys.executable, RUN, *flags], capture_output=True, text=True, timeout=timeout, env=env)


def error_lines(res):
    return [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("flag, names", [
    ("--config.mesh.data=0", ["config.mesh.data=0", "--config.mesh.data=1"]),
    ("--config.rl.logprob_chunk=-1", ["config.rl.logprob_chunk=-1", ">= 0"]),
    ("--config.task.heldout_fraction=1.5", ["config.task.heldout_fraction=1.5", "[0, 1)"]),
    ("--config.task.heldout_fraction=-0.5", ["config.task.heldout_fraction=-0.5", "[0, 1)"]),
    ("--config.eval.samples_per_prompt=1000000000", ["config.eval.samples_per_prompt=1000000000", "[1, 4096]"]),
    ("--config.preemption_grace_s=0.02", ["config.preemption_grace_s=0.02", ">= 1"]),
])
def test_out_of_range_number_is_one_line_and_touches_nothing(tmp_path, flag, names):
    workdir = tmp_path / "new" / "run"
    res = run(f"--workdir={workdir}", flag)
    assert res.returncode == 1, res.stderr[-2000:]
    assert len(error_lines(res)) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    for name in names:
        assert name in error_lines(res)[0]
    assert not (tmp_path / "new").exists()  # checked before anything is written


def test_misspelt_field_is_one_line_naming_it(tmp_path):
    res = run(f"--workdir={tmp_path / 'w'}", "--config.rl.eps_mx=5")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr[-3000:]
    line = error_lines(res)[0]
    assert "--config.rl.eps_mx=5" in line and '"eps_max"' in line and "--print_config" in line
    assert not (tmp_path / "w").exists()


def test_bad_config_file_arg_is_one_line(tmp_path):
    res = run(f"--workdir={tmp_path / 'w'}", "--config=configs/tiny.py:recipe=dapoo")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "unknown recipe 'dapoo'" in error_lines(res)[0]


def test_verbose_shows_the_traceback(tmp_path):
    res = run(f"--workdir={tmp_path / 'w'}", "--config.rl.eps_mx=5", "--verbose")
    assert res.returncode == 1
    assert "Traceback" in res.stderr and len(error_lines(res)) == 1
    res = run(f"--workdir={tmp_path / 'w'}", "--config.mesh.data=0", "--verbose")
    assert res.returncode == 1 and "Traceback" in res.stderr and "config.mesh.data=0" in error_lines(res)[0]


def test_init_checkpoint_of_another_architecture_is_one_line_and_leaves_nothing(tmp_path):
    import jax.numpy as jnp

    sys.path.insert(0, ROOT)
    from rl_scaling import checkpoint

    params = tmp_path / "params"
    checkpoint.save_params(str(params), {"embed": jnp.zeros((64, 8)), "head": jnp.zeros((8, 4))})
    kept = tmp_path / "existing"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for workdir in (tmp_path / "new" / "run", kept):
        res = run(f"--workdir={workdir}", f"--config.init_checkpoint={params}", timeout=300)
        assert res.returncode == 1, res.stderr[-3000:]
        assert "Traceback" not in res.stderr and len(error_lines(res)) == 1, res.stderr[-3000:]
        line = error_lines(res)[0]
        assert f"config.init_checkpoint={params}" in line and "differing leaves" in line and "['embed']" in line
    assert not (tmp_path / "new").exists()  # no config.json, trainer.lock or empty checkpoints/
    assert sorted(os.listdir(kept)) == ["notes.txt"]


def test_print_config_lists_fields_and_defaults(tmp_path):
    res = run(f"--workdir={tmp_path / 'w'}", "--print_config", "--config.rl.eps_max=5")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert "rl.loss = 'cispo'" in lines and "eval.samples_per_prompt = 4" in lines
    assert "rl.eps_max = 5.0  # set by --config.rl.eps_max" in lines
    assert any(ln.startswith("model.d_model = ") for ln in lines)
    assert not (tmp_path / "w").exists()


def test_print_config_into_a_closed_pipe_exits_quietly():
    """`--print_config | head -3`: the reader closes the pipe early; no BrokenPipeError traceback."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, RUN, "--print_config"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, bufsize=0)
    assert proc.stdout.read(10)  # one line's worth, then the reader is gone
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]
