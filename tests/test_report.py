"""README's "The law on the tiny task" block is exactly what launch/report.py makes of the shipped data."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_law_block_matches_the_shipped_results():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "report.py")], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    begin, end = "<!-- law-report -->", "<!-- /law-report -->"
    block = readme[readme.index(begin):readme.index(end) + len(end)]
    assert block.strip() == out.stdout.strip(), "README is stale: run `make report`"
