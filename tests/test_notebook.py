"""Run notebooks/small_scale_fit.ipynb top to bottom on the shipped results (slow)."""

import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "small_scale_fit.ipynb")


@pytest.mark.slow
def test_small_scale_fit_notebook_runs():
    results = os.environ.get("RL_SCALING_RESULTS", os.path.join(ROOT, "notebooks", "results"))
    if not glob.glob(os.path.join(results, "*", "seed*", "metrics.jsonl")):
        pytest.skip(f"no shipped results of real runs under {results}/<recipe>/seed<k>/metrics.jsonl yet")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "repository:" in text and "A" in text
