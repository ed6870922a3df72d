"""Run notebooks/small_scale_fit.ipynb top to bottom on the shipped results (slow); the fit
values it prints are those of the library's own fit of the same runs."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "small_scale_fit.ipynb")
NUM = r"(-?[\d.]+(?:e[+-]?\d+)?)"
# "<recipe>: A = 0.612 [0.590, 0.640], B = 1.83 [1.20, 2.50], C_mid = 3.1e+13, R0 = 0.148"
# or "<recipe>: A >= 0.580, B = ...": the notebook's line per fitted recipe.
FIT_LINE = re.compile(rf"^(\S+): A (=|>=) {NUM}(?: \[{NUM}, {NUM}\])?, B = {NUM} \[{NUM}, {NUM}\], "
                      rf"C_mid = {NUM}, R0 = {NUM}$", re.M)


def printed_digits_tol(text):
    """Half a unit in the last printed digit: the rounding the notebook's format applied."""
    mantissa = text.lower().split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(text.lower().split("e")[1]) if "e" in text.lower() else 0
    return 0.5 * 10.0 ** (exponent - decimals) * (1 + 1e-9)


@pytest.mark.slow
def test_small_scale_fit_notebook_prints_the_library_fit():
    results = os.environ.get("RL_SCALING_RESULTS", os.path.join(ROOT, "notebooks", "results"))
    paths = sorted(glob.glob(os.path.join(results, "*", "seed*", "metrics.jsonl")))
    if not paths:
        pytest.skip(f"no shipped results of real runs under {results}/<recipe>/seed<k>/metrics.jsonl yet")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"repository: {ROOT}" in text

    # The library's fit of the same runs, with the notebook's settings.
    from rl_scaling.scaling import api, io

    groups = io.group_runs(io.load_inputs(paths, axis="flops"))
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
        pairs = list(want.items()) + [(b, s["B"]), (b_lo, ci_b_lo), (b_hi, ci_b_hi), (c_mid, s["C_mid"]), (r0, s["R0"])]
        for shown, value in pairs:
            assert abs(float(shown) - value) <= printed_digits_tol(shown), (recipe, shown, value)
