"""launch/fit.py end to end on synthetic workdirs (test fixtures, not results of runs)."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, path):
    # by path, so this works whatever pytest's import mode and without a tests package
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cli():
    return _load("fit_cli", os.path.join(ROOT, "launch", "fit.py"))


write_workdir = _load("scaling_io_helpers", os.path.join(ROOT, "tests", "test_scaling_io.py")).write_workdir


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    for k in range(2):
        write_workdir(root / "strong" / f"seed{k}", A=0.7, seed_offset=0.003 * k)
        write_workdir(root / "weak" / f"seed{k}", A=0.55, seed_offset=0.003 * k)
    return root


def test_cli_writes_fit_json_and_figures(workdirs, tmp_path):
    out = tmp_path / "out"
    rc = _cli().main([str(workdirs), f"--out={out}", "--n-boot=200", "--predict-at=3e15", "--c-min=0"])
    assert rc == 0
    data = json.loads((out / "fit.json").read_text())
    s = data["recipes"]["strong"]
    for key in ("A", "B", "C_mid", "R0", "ci", "window", "identifiable", "extrapolation", "sigmoid_vs_power_law"):
        assert key in s
    assert s["n_seeds"] == 2 and s["bootstrap"]["method"] == "seeds"
    assert abs(s["A"] - 0.7) < 0.02 and s["predictions"][0]["compute"] == 3e15
    assert data["comparison"]["ranking"][0]["name"] == "strong"
    for png in ("fit_strong.png", "fit_weak.png", "asymptotes.png", "heatmap.png"):
        assert (out / png).stat().st_size > 1000


def test_cli_grid_method_and_bad_input(workdirs, tmp_path, capsys):
    cli = _cli()
    out = tmp_path / "grid"
    rc = cli.main([str(workdirs / "strong"), f"--out={out}", "--n-boot=100", "--method=grid",
                   "--a-grid=0.6:0.8:0.01", "--axis=steps", "--holdout=0"])
    assert rc == 0
    s = json.loads((out / "fit.json").read_text())["recipes"]["strong"]
    assert s["method"] == "grid" and s["grid"]["a_grid"][:2] == [0.6, 0.8] and "extrapolation" not in s
    bad = tmp_path / "bad.csv"
    bad.write_text("compute,pass\n0,0.1\n")
    assert cli.main([str(bad), f"--out={tmp_path / 'x'}"]) == 2
    assert "missing column 'pass_rate'" in capsys.readouterr().err
    few = tmp_path / "few.csv"
    few.write_text("compute,pass_rate\n0,0.1\n1,0.2\n2,0.3\n")
    assert cli.main([str(few), f"--out={tmp_path / 'y'}"]) == 1
    assert json.loads((tmp_path / "y" / "fit.json").read_text())["recipes"]["few"]["status"] == "error"


def test_cli_prints_named_warnings_and_no_ranking_from_unmeasured_ceilings(tmp_path, capsys):
    """Runs that stop well before C_mid (step 600): every A is a lower bound."""
    root = tmp_path / "early"
    for name, A in (("x", 0.7), ("y", 0.55)):
        write_workdir(root / name / "seed0", A=A, steps=range(0, 301, 10), eval_every=20)
    out = tmp_path / "out"
    assert _cli().main([str(root), f"--out={out}", "--n-boot=200", "--c-min=0"]) == 0
    text = capsys.readouterr().out
    assert "warning [not_identifiable]" in text and "x vs y: undecided" in text
    assert not any(ln.startswith("ranking:") for ln in text.splitlines()) and "no ranking" in text
    data = json.loads((out / "fit.json").read_text())
    assert data["comparison"]["ranking"] == [] and data["comparison"]["pairs"][0]["winner"] == "undecided"
    assert "not_identifiable" in {f["code"] for f in data["recipes"]["x"]["flags"]}
    assert data["budgets"]["shown"]["x"][-1] is False  # 8x the data: hidden in the heat map


def test_start_samples_gives_runs_of_different_lengths_one_window_start(tmp_path, capsys):
    """The fixture logs samples = 256 x step and compute = 1e12 x step, evals every 100 steps."""
    root = tmp_path / "sizes"
    write_workdir(root / "short" / "seed0", steps=range(0, 1001, 50))
    write_workdir(root / "long" / "seed0", steps=range(0, 2001, 50))
    out = tmp_path / "default"
    assert _cli().main([str(root), f"--out={out}", "--n-boot=50"]) == 0
    win = {k: v["window"] for k, v in json.loads((out / "fit.json").read_text())["recipes"].items()}
    # default: from 1.5/16 of each recipe's own largest compute, the first eval at or after it
    assert win["short"]["c_min"] == 100e12 and win["long"]["c_min"] == 200e12
    out = tmp_path / "start"
    assert _cli().main([str(root), f"--out={out}", "--n-boot=50", f"--start-samples={250 * 256}"]) == 0
    win = {k: v["window"] for k, v in json.loads((out / "fit.json").read_text())["recipes"].items()}
    assert win["short"]["c_min"] == win["long"]["c_min"] == 300e12  # the first eval after 250 steps' samples
    assert win["short"]["c_max"] == 1000e12 and win["long"]["start_samples"] == 250 * 256
    assert win["long"]["n_points"] == 18 and win["short"]["n_points"] == 8
    csv = tmp_path / "curve.csv"  # a CSV has no samples column: said, naming the file
    csv.write_text("compute,pass_rate\n" + "".join(f"{c},{0.1 + 0.04 * c}\n" for c in range(12)))
    capsys.readouterr()
    assert _cli().main([str(csv), f"--out={tmp_path / 'csv'}", "--start-samples=5"]) == 1
    err = capsys.readouterr().err
    assert "a window from 5 samples needs the generated samples at each eval" in err and "curve.csv" in err
