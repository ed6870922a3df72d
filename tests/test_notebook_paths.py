"""notebooks/train_and_fit.ipynb resolves RL_SCALING_NB_WORKDIR once (relative or gs://) through the
path layer and names the paths when no eval arrives; set_repo_url.py warns about a local-path remote.
Fast: the notebook's cells run in this process with a trainer that exits at once."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "train_and_fit.ipynb")


def _code_cells():
    with open(NOTEBOOK) as f:
        nb = json.load(f)
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _run_cells(indices, env, cwd, monkeypatch):
    """Execute the notebook's code cells `indices` (0 = its first code cell) in one namespace."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "path", list(sys.path))
    ns = {"__name__": "__main__"}
    cells = _code_cells()
    for i in indices:
        # the first cell finds the repository from the notebook's folder; the kernel may then move
        monkeypatch.chdir(os.path.join(ROOT, "notebooks") if i == 0 else cwd)
        exec(compile(cells[i], f"cell{i}", "exec"), ns)
    return ns


def test_relative_workdir_is_resolved_once(tmp_path, monkeypatch):
    ns = _run_cells([0, 1], {"RL_SCALING_NB_WORKDIR": "rel/run"}, tmp_path, monkeypatch)
    assert ns["WORKDIR"] == str(tmp_path / "rel" / "run")
    assert ns["METRICS"] == str(tmp_path / "rel" / "run" / "metrics.jsonl")
    assert ns["LOG_PATH"] == str(tmp_path / "rel" / "run" / "train.log")


def test_gcs_workdir_stays_a_url_and_its_log_stays_local(tmp_path, monkeypatch):
    ns = _run_cells([0, 1], {"RL_SCALING_NB_WORKDIR": "gs://bucket/runs/nb"}, tmp_path, monkeypatch)
    assert ns["WORKDIR"] == "gs://bucket/runs/nb" and ns["METRICS"] == "gs://bucket/runs/nb/metrics.jsonl"
    assert os.path.isabs(ns["LOG_PATH"]) and "gs:" not in ns["LOG_PATH"]
    assert not os.path.exists(tmp_path / "gs:") and not os.path.exists(os.path.join(ROOT, "notebooks", "gs:"))


def test_no_eval_names_the_paths(tmp_path, monkeypatch):
    """A trainer that ends without an eval (here --print_config: exit 0, nothing trained) stops the
    cell with a message naming the metrics file and the log, not an IndexError."""
    env = {"RL_SCALING_NB_WORKDIR": "rel/run", "RL_SCALING_NB_FLAGS": "--print_config", "JAX_PLATFORMS": "cpu"}
    with pytest.raises(SystemExit) as e:
        _run_cells([0, 1, 2], env, tmp_path, monkeypatch)
    message = str(e.value)
    assert "no eval arrived" in message
    assert str(tmp_path / "rel" / "run" / "metrics.jsonl") in message
    assert str(tmp_path / "rel" / "run" / "train.log") in message


def _set_repo_url():
    import importlib.util

    spec = importlib.util.spec_from_file_location("set_repo_url", os.path.join(ROOT, "notebooks", "set_repo_url.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("url, local", [
    ("/srv/git/rl_scaling", True), ("../rl_scaling", True), ("file:///srv/git/rl_scaling.git", True),
    ("https://github.com/owner/rl_scaling.git", False), ("ssh://git@host/owner/rl_scaling", False),
    ("git@github.com:owner/rl_scaling.git", False),
])
def test_local_remote_is_recognized(url, local):
    assert _set_repo_url().is_local(url) is local


def test_set_repo_url_warns_about_a_local_path_remote(tmp_path):
    """A checkout whose origin is a local path: the URL is written, with a warning that Colab cannot clone it."""
    repo = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", "/srv/git/rl_scaling"], check=True)
    (repo / "notebooks").mkdir()
    script = repo / "notebooks" / "set_repo_url.py"
    script.write_text(open(os.path.join(ROOT, "notebooks", "set_repo_url.py")).read())
    nb = repo / "notebooks" / "train_and_fit.ipynb"
    nb.write_text(open(NOTEBOOK).read())
    res = subprocess.run([sys.executable, str(script), str(nb)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "warning" in res.stderr and "cannot clone" in res.stderr and "/srv/git/rl_scaling" in res.stderr
    first = next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
    assert 'or "/srv/git/rl_scaling"' in "".join(first["source"])
