"""launch/preregister.py freeze-ceiling / score-ceiling on synthetic workdirs (test fixtures with a known
ceiling, not results of runs): fresh seeds of the same curve keep every claim, a higher curve breaks them."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


prereg = _load("preregister_cli", os.path.join(ROOT, "launch", "preregister.py"))
fit_cli = _load("fit_cli_prereg", os.path.join(ROOT, "launch", "fit.py"))
write_workdir = _load("scaling_io_helpers_prereg", os.path.join(ROOT, "tests", "test_scaling_io.py")).write_workdir
START = 100 * 256  # the fixture logs 256 samples a step: windows from step 100


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    root = tmp_path_factory.mktemp("prereg")
    for k, off in enumerate((-0.01, 0.01)):  # the shipped pair: the same curve, A = 0.6, seeds +-0.01 apart
        write_workdir(root / "shipped" / "big" / f"seed{k}", A=0.6, seed_offset=off, config={"recipe": "big", "seed": k})
        write_workdir(root / "shipped" / "small" / f"seed{k}", A=0.6, seed_offset=off, config={"recipe": "small", "seed": k})
    assert fit_cli.main([str(root / "shipped"), f"--out={root / 'fit'}", "--n-boot=200", f"--start-samples={START}"]) == 0
    out = root / "prereg.json"
    prereg.main(["freeze-ceiling", f"--fit={root / 'fit' / 'fit.json'}", "--recipe=big", "--reference=small",
                 f"--out={out}"])
    return root, json.loads(out.read_text())


def _fresh(root, name, A, offsets=(-0.005, 0.005)):
    for k, off in zip((2, 3), offsets):
        write_workdir(root / name / "big" / f"seed{k}", A=A, seed_offset=off, config={"recipe": "big", "seed": k})
    return root / name


def test_freeze_widens_the_interval_by_sqrt2_for_a_new_pair(frozen):
    _, pre = frozen
    a, (lo, hi) = pre["fitted"]["A"], pre["fitted"]["ci"]
    assert abs(a - 0.6) < 0.01 and pre["start_samples"] == START and pre["fitted"]["seeds"] == ["0", "1"]
    assert pre["band"] == pytest.approx([a - 2 ** 0.5 * (a - lo), a + 2 ** 0.5 * (hi - a)])


def test_fresh_seeds_of_the_same_curve_keep_every_claim(frozen, tmp_path):
    root, _ = frozen
    held = prereg.main(["score-ceiling", f"--prereg={root / 'prereg.json'}", f"--runs={_fresh(root, 'same', 0.6)}",
                        f"--out={tmp_path / 'c.md'}"])
    assert held == {"identifiable": True, "ceiling_in_band": True, "not_above_reference": True}
    assert "3 of 3 claims held" in (tmp_path / "c.md").read_text()
    assert json.loads((tmp_path / "c.json").read_text())["held"] == held


def test_a_higher_ceiling_breaks_the_claims(frozen):
    root, _ = frozen
    held = prereg.main(["score-ceiling", f"--prereg={root / 'prereg.json'}", f"--runs={_fresh(root, 'higher', 0.7)}"])
    assert held["identifiable"] and not held["ceiling_in_band"] and not held["not_above_reference"]


def test_the_frozen_seeds_are_not_fresh(frozen):
    root, _ = frozen
    with pytest.raises(SystemExit, match="other than the frozen fit's"):
        prereg.main(["score-ceiling", f"--prereg={root / 'prereg.json'}", f"--runs={root / 'shipped'}"])
