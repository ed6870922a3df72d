"""launch/preregister.py freeze-ceiling / score-ceiling on synthetic workdirs (test fixtures with a known
ceiling, not results of runs): fresh seeds of the same curve keep every claim, a higher curve breaks them."""

import importlib.util
import json
import os

import pytest

from rl_scaling.scaling.errors import ScalingDataError

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


def _jittered(d, A, jitter, recipe, seed):
    """A synthetic run whose evals alternate +-jitter about the curve (test fixture): the second-half
    spread is about sqrt(2) x jitter, and every training line logs keep_frac 0.05."""
    write_workdir(d, A=A, config={"recipe": recipe, "seed": seed})
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    sign = 1.0
    for r in rows:
        if "eval/pass_rate" in r:
            r["eval/pass_rate"] += sign * jitter
            sign = -sign
        else:
            r["keep_frac"] = 0.05
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def stability(tmp_path_factory, frozen):
    root, _ = frozen
    base = tmp_path_factory.mktemp("stability")
    for k in (0, 1):
        _jittered(base / "base" / "big" / f"seed{k}", 0.6, 0.03, "big", k)
    out = base / "pre.json"
    prereg.main(["freeze-stability", f"--baseline={base / 'base' / 'big'}", "--recipe=big+optim.lr=0.0001",
                 f"--reference-fit={root / 'fit' / 'fit.json'}", "--reference=small", "--spread-below=0.015",
                 f"--out={out}"])
    return base, json.loads(out.read_text())


def test_freeze_stability_records_the_baseline_spread(stability):
    base, pre = stability
    rows = [json.loads(ln) for ln in (base / "base" / "big" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    y = [r["eval/pass_rate"] for r in rows if "eval/pass_rate" in r and r["step"] >= 1000]  # the second half
    d = [b - a for a, b in zip(y, y[1:])]
    mean = sum(d) / len(d)
    want = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / 2) ** 0.5  # sd of the differences / sqrt 2
    assert pre["baseline_spread"]["0"] == pytest.approx(want, abs=1e-4) and want > 0.04
    assert pre["baseline"] == "big" and pre["spread_below"] == 0.015 and set(pre["claims"]) == {
        "steadier", "identifiable", "overlaps_s"}


def test_a_steady_plateau_keeps_the_claims_and_a_wandering_one_breaks_them(stability, tmp_path):
    base, _ = stability
    for name, jitter in (("steady", 0.002), ("wandering", 0.03)):
        for k in (0, 1):
            _jittered(base / name / "big+optim.lr=0.0001" / f"seed{k}", 0.6, jitter, "big+optim.lr=0.0001", k)
    held = prereg.main(["score-stability", f"--prereg={base / 'pre.json'}", f"--runs={base / 'steady'}",
                        f"--out={tmp_path / 's.md'}"])
    assert held == {"steadier": True, "identifiable": True, "overlaps_s": True}
    out = json.loads((tmp_path / "s.json").read_text())
    assert out["held"] == held and all(v < 0.004 for v in out["spread"].values())
    assert out["keep_frac"] == {"0": pytest.approx(0.05), "1": pytest.approx(0.05)}
    held = prereg.main(["score-stability", f"--prereg={base / 'pre.json'}", f"--runs={base / 'wandering'}"])
    assert not held["steadier"]


def test_score_stability_needs_two_seeds_of_the_frozen_recipe(stability):
    base, _ = stability
    with pytest.raises(SystemExit, match="needs 2 or more seeds"):
        prereg.main(["score-stability", f"--prereg={base / 'pre.json'}", f"--runs={base / 'base'}"])


def test_the_size_test_at_one_learning_rate_decides_each_pair_by_the_frozen_rule(tmp_path):
    """freeze-plateau / score-plateau on synthetic runs (test fixtures): every seed pair +-0.01 about its size's
    curve, so the pooled within-size sd is 0.01 x sqrt 2 with 3 df and each pair needs a seed-mean difference
    above t(0.95, 3) x 0.01 x sqrt 2 = 0.0333. l's curve sits well above s's and m's, m's just above s's."""
    budget = 2000 * 256  # write_workdir's last step logs 512,000 samples
    for size, A in (("small", 0.5), ("mid", 0.52), ("big", 0.6)):
        for k, off in enumerate((-0.01, 0.01)):
            where = "ref" if size == "big" else "new"
            write_workdir(tmp_path / where / f"{size}+lr" / f"seed{k}", A=A, seed_offset=off,
                          config={"recipe": f"{size}+lr", "seed": k})
    pre_path = tmp_path / "pre.json"
    prereg.main(["freeze-plateau", f"--reference-runs={tmp_path / 'ref'}", "--sizes=s:small+lr,m:mid+lr",
                 f"--samples={budget}", f"--out={pre_path}"])
    pre = json.loads(pre_path.read_text())
    assert list(pre["claims"]) == ["m_above_s", "l_above_s", "l_above_m"]
    held = prereg.main(["score-plateau", f"--prereg={pre_path}", f"--runs={tmp_path / 'new'}",
                        f"--out={tmp_path / 'p.md'}"])
    assert held == {"m_above_s": False, "l_above_s": True, "l_above_m": True}
    out = json.loads((tmp_path / "p.json").read_text())
    assert out["sd"] == pytest.approx(0.01 * 2 ** 0.5) and out["df"] == 3
    assert out["plateaus"]["l"]["1"] - out["plateaus"]["l"]["0"] == pytest.approx(0.02)
    assert "needs > 0.033" in (tmp_path / "p.md").read_text()


def test_the_size_test_refuses_runs_short_of_the_frozen_budget(tmp_path):
    for k in (0, 1):
        write_workdir(tmp_path / "ref" / "big" / f"seed{k}", config={"recipe": "big", "seed": k})
        write_workdir(tmp_path / "new" / "small" / f"seed{k}", steps=range(0, 1001, 50), config={"recipe": "small", "seed": k})
    with pytest.raises(SystemExit, match="expected size:recipe pairs"):
        prereg.main(["freeze-plateau", f"--reference-runs={tmp_path / 'ref'}", "--sizes=s", "--samples=512000",
                     f"--out={tmp_path / 'pre.json'}"])
    with pytest.raises(SystemExit, match="did not run to 1,024,000 samples"):
        prereg.main(["freeze-plateau", f"--reference-runs={tmp_path / 'ref'}", "--sizes=s:small", "--samples=1024000",
                     f"--out={tmp_path / 'pre.json'}"])
    prereg.main(["freeze-plateau", f"--reference-runs={tmp_path / 'ref'}", "--sizes=s:small", "--samples=512000",
                 f"--out={tmp_path / 'pre.json'}"])
    with pytest.raises(SystemExit, match=r"not at that budget: \['0', '1'\]"):
        prereg.main(["score-plateau", f"--prereg={tmp_path / 'pre.json'}", f"--runs={tmp_path / 'new'}"])


def test_the_size_test_pools_reference_seeds_from_several_sweeps(tmp_path):
    """Four seeds of the large size in two sweep directories form one reference (pooled sd over l's 4 seeds
    and s's 2: all +-0.01 about their curves, so sd^2 = (2 x 2e-4 + 2e-4) / 4 with 4 df); a seed in both is refused
    (by the loader)."""
    budget = 2000 * 256
    for k, off in enumerate((-0.01, 0.01, -0.01, 0.01)):
        write_workdir(tmp_path / ("ref" if k < 2 else "ref2") / "big" / f"seed{k}", A=0.6, seed_offset=off,
                      config={"recipe": "big", "seed": k})
    for k, off in zip((2, 3), (-0.01, 0.01)):
        write_workdir(tmp_path / "new" / "small" / f"seed{k}", A=0.5, seed_offset=off, config={"recipe": "small", "seed": k})
    refs = f"{tmp_path / 'ref'},{tmp_path / 'ref2'}"
    pre_path = tmp_path / "pre.json"
    prereg.main(["freeze-plateau", f"--reference-runs={refs}", "--sizes=s:small", f"--samples={budget}",
                 f"--out={pre_path}"])
    pre = json.loads(pre_path.read_text())
    assert sorted(pre["reference"]["plateaus"]) == ["0", "1", "2", "3"] and list(pre["claims"]) == ["l_above_s"]
    held = prereg.main(["score-plateau", f"--prereg={pre_path}", f"--runs={tmp_path / 'new'}", f"--out={tmp_path / 'p.md'}"])
    out = json.loads((tmp_path / "p.json").read_text())
    assert held == {"l_above_s": True} and out["df"] == 4
    assert out["sd"] == pytest.approx((6 * 1e-4 / 4) ** 0.5)
    write_workdir(tmp_path / "ref2" / "big" / "seed1", A=0.6, config={"recipe": "big", "seed": 1})
    with pytest.raises(ScalingDataError, match="the same run appears twice"):
        prereg.main(["freeze-plateau", f"--reference-runs={refs}", "--sizes=s:small", f"--samples={budget}",
                     f"--out={pre_path}"])
