"""The notebooks top to bottom with nbclient (slow): small_scale_fit.ipynb on the shipped results
and on a run's workdir, train_and_fit.ipynb training a short run; the fit values they print are
those of the library's own fit of the same runs. And the Colab clone URL: written from the
checkout's git remote, and a clear message when there is none."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NOTEBOOK = os.path.join(NOTEBOOKS, "small_scale_fit.ipynb")
TRAIN_NOTEBOOK = os.path.join(NOTEBOOKS, "train_and_fit.ipynb")
NUM = r"(-?[\d.]+(?:e[+-]?\d+)?)"
# "<recipe>: A = 0.612 [0.590, 0.640], B = 1.83 [1.20, 2.50], C_mid = 3.1e+13, R0 = 0.148"
# or "<recipe>: A >= 0.580, B = ...": the notebook's line per fitted recipe.
FIT_LINE = re.compile(rf"^(\S+): A (=|>=) {NUM}(?: \[{NUM}, {NUM}\])?, B = {NUM} \[{NUM}, {NUM}\], "
                      rf"C_mid = {NUM}, R0 = {NUM}$", re.M)
# train_and_fit's line after each eval once the fit is ok:
# "step 12: 13 evals, pass rate 0.094; fit: A >= 0.2, B = 1.20, C_mid = 3e+11; predicted at 5e+11: 0.101 (...)"
LIVE_LINE = re.compile(rf"^step (\d+): (\d+) evals, pass rate {NUM}; fit: (?:(ok)|A (=|>=) {NUM}, B = {NUM}, "
                       rf"C_mid = {NUM}; predicted at {NUM}: {NUM} \(95% PI \[{NUM}, {NUM}\]\))?(too_few_points)?$",
                       re.M)


def printed_digits_tol(text):
    """Half a unit in the last printed digit: the rounding the notebook's format applied."""
    mantissa = text.lower().split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(text.lower().split("e")[1]) if "e" in text.lower() else 0
    return 0.5 * 10.0 ** (exponent - decimals) * (1 + 1e-9)


def assert_shown(pairs, where):
    for shown, value in pairs:
        assert abs(float(shown) - value) <= printed_digits_tol(shown), (where, shown, value)


def execute(path, env=None, timeout=600):
    """Run a notebook in a fresh kernel (env: extra environment variables); its printed text."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    saved = dict(os.environ)
    os.environ.update(env or {})  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def assert_prints_library_fit(text, inputs):
    """Every recipe's fit line equals the library's fit of the same runs with the notebook's settings."""
    from rl_scaling.scaling import api, io

    groups = io.group_runs(io.load_inputs(inputs, axis="flops"))
    printed = {m[0]: m for m in FIT_LINE.findall(text)}
    assert sorted(printed) == sorted(groups), text[-3000:]
    for recipe, runs in groups.items():
        s = api.fit_runs(runs, name=recipe, n_boot=1000, holdout=0.5).summary()
        name, relation, a, a_lo, a_hi, b, b_lo, b_hi, c_mid, r0 = printed[recipe]
        (ci_a_lo, ci_a_hi), (ci_b_lo, ci_b_hi) = s["ci"]["A"], s["ci"]["B"]
        if s["identifiable"]:
            want = {a: s["A"], a_lo: ci_a_lo, a_hi: ci_a_hi}
            assert relation == "="
        else:
            want = {a: s["A_lower_bound"]}
            assert relation == ">=" and not a_lo
        assert_shown(list(want.items()) + [(b, s["B"]), (b_lo, ci_b_lo), (b_hi, ci_b_hi), (c_mid, s["C_mid"]),
                                           (r0, s["R0"])], recipe)


@pytest.mark.slow
def test_small_scale_fit_notebook_prints_the_library_fit():
    results = os.environ.get("RL_SCALING_RESULTS", os.path.join(ROOT, "notebooks", "results"))
    paths = sorted(glob.glob(os.path.join(results, "*", "seed*", "metrics.jsonl")))
    if not paths:
        pytest.skip(f"no shipped results of real runs under {results}/<recipe>/seed<k>/metrics.jsonl yet")
    text = execute(NOTEBOOK, {"RL_SCALING_RESULTS": results})
    assert f"repository: {ROOT}" in text
    assert_prints_library_fit(text, paths)
    # Each ablation is set against the longest label it extends: the FP32-head ablation against the
    # bfloat16 body with FP32 heads, not against the float32 ScaleRL.
    labels = {os.path.basename(os.path.dirname(os.path.dirname(p))) for p in paths}
    refs = dict(re.findall(r"^(scalerl\+\S+): A .*; A - A_(\S+) ", text, re.M))
    for label in (x for x in labels if x.startswith("scalerl+")):
        parts = label.split("+")
        want = next("+".join(parts[:n]) for n in range(len(parts) - 1, 0, -1) if "+".join(parts[:n]) in labels)
        assert refs.get(label) == want, (label, refs.get(label), want)


LIVE_OK = re.compile(rf"^step (\d+): (\d+) evals, pass rate {NUM}; fit: A (=|>=) {NUM}, B = {NUM}, C_mid = {NUM}; "
                     rf"predicted at {NUM}: {NUM} \(95% PI \[{NUM}, {NUM}\]\)$", re.M)
LIVE_ANY = re.compile(r"^step (\d+): (\d+) evals, pass rate [\d.]+; fit: (.*)$", re.M)


@pytest.mark.slow
def test_train_and_fit_notebook_then_the_fit_notebook_on_its_workdir(tmp_path):
    """A short real run in place of the notebook's 1,000 steps (150 warm-start steps give a
    non-zero pass rate, 12 RL steps with an eval after each); the fit notebook then takes that
    single workdir, as it would take `make run`'s runs/tiny."""
    from rl_scaling import metrics
    from rl_scaling.scaling import api
    from tests.test_run import overrides

    workdir = str(tmp_path / "tiny")
    flags = overrides() + ["--config.warmstart.max_steps=150", "--config.warmstart.eval_every=150",
                           "--config.eval.num_prompts=32"]
    env = {"RL_SCALING_NB_CONFIG": "configs/tiny.py:samples=3072,evals=12", "RL_SCALING_NB_FLAGS": " ".join(flags),
           "RL_SCALING_NB_WORKDIR": workdir, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    text = execute(TRAIN_NOTEBOOK, env, timeout=900)
    assert f"repository: {ROOT}" in text and "trained: 12 steps" in text, text[-3000:]

    evals = [r for r in metrics.read_records(os.path.join(workdir, "metrics.jsonl")) if "eval/pass_rate" in r]
    assert [r["step"] for r in evals] == list(range(13))
    live = LIVE_ANY.findall(text)
    counts = [int(n) for _, n, _ in live]
    assert len(live) >= 2 and counts == sorted(set(counts)) and counts[-1] == 13, live  # refitted as evals came
    # The last live fit is the library's refit of all 13 evals, at the compute of the run's last step.
    step, n, rate, rel, a, b, c_mid, target, pred, lo, hi = LIVE_OK.findall(text)[-1]
    assert (int(step), int(n)) == (12, 13)
    records = [(r["compute_flops"], r["eval/pass_rate"]) for r in evals]
    s = api.refit(records, target_compute=evals[-1]["compute_flops"], n_boot=300)
    assert s["status"] == "ok" and rel == ("=" if s["identifiable"] else ">=")
    t = s["target"]
    assert_shown([(a, s["A"] if s["identifiable"] else s["A_lower_bound"]), (b, s["B"]), (c_mid, s["C_mid"]),
                  (target, evals[-1]["compute_flops"]), (pred, t["pass_rate"]), (lo, t["pi"][0]), (hi, t["pi"][1]),
                  (rate, evals[-1]["eval/pass_rate"])], "live fit")
    assert_prints_library_fit(text, [workdir])

    text = execute(NOTEBOOK, {"RL_SCALING_RESULTS": workdir})
    assert_prints_library_fit(text, [workdir])


def _first_cell(path):
    with open(path) as f:
        return "".join(next(c for c in json.load(f)["cells"] if c["cell_type"] == "code")["source"])


@pytest.mark.parametrize("path", [NOTEBOOK, TRAIN_NOTEBOOK])
def test_colab_without_a_url_names_what_to_set(path, tmp_path):
    """The first cell as Colab runs it (google.colab imported) with no URL: it stops before cloning."""
    (tmp_path / "google").mkdir()
    (tmp_path / "google" / "__init__.py").write_text("")
    (tmp_path / "google" / "colab.py").write_text("")
    script = "import google.colab\n" + _first_cell(path)
    env = {k: v for k, v in os.environ.items() if k != "RL_SCALING_REPO"}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=dict(env, PYTHONPATH=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and not (tmp_path / "rl_scaling_repo").exists()
    assert "REPO_URL is empty" in res.stderr and "RL_SCALING_REPO" in res.stderr, res.stderr
    assert "OWNER" not in _first_cell(path)


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_set_repo_url_writes_the_origin_remote(tmp_path):
    """notebooks/set_repo_url.py in a checkout with an ssh origin writes its https URL into each
    notebook's first cell (and nothing else changes); without a remote it fails saying what to set."""
    repo = tmp_path / "checkout"
    (repo / "notebooks").mkdir(parents=True)
    for src in (NOTEBOOK, TRAIN_NOTEBOOK, os.path.join(NOTEBOOKS, "set_repo_url.py")):
        (repo / "notebooks" / os.path.basename(src)).write_bytes(open(src, "rb").read())
    _git(repo, "init", "-q")
    script = str(repo / "notebooks" / "set_repo_url.py")
    res = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "no git remote 'origin'" in res.stderr and "RL_SCALING_REPO" in res.stderr

    _git(repo, "remote", "add", "origin", "git@github.com:example-org/rl_scaling.git")
    subprocess.run([sys.executable, script], check=True, capture_output=True, timeout=60)
    for name in ("small_scale_fit.ipynb", "train_and_fit.ipynb"):
        with open(os.path.join(NOTEBOOKS, name)) as f:
            before = json.load(f)
        with open(repo / "notebooks" / name) as f:
            after = json.load(f)
        want = 'REPO_URL = os.environ.get("RL_SCALING_REPO") or "https://github.com/example-org/rl_scaling.git"'
        assert want in _first_cell(repo / "notebooks" / name)
        assert [c["source"] for c in after["cells"][2:]] == [c["source"] for c in before["cells"][2:]]
