"""Write this checkout's clone URL (`git remote get-url origin`) into the notebooks' first cell,
so that on Colab they clone the repository they came from.

    python notebooks/set_repo_url.py [--remote=origin] [NOTEBOOK ...]

An ssh remote (git@host:owner/repo.git) is written as its https URL: Colab has no ssh key.
Without the remote it exits non-zero and says what to set instead. A remote that is a path on this
machine (/srv/git/rl_scaling, ../rl_scaling, file://...) is written with a warning: Colab cannot
clone it; push the repository where Colab can reach it, or set RL_SCALING_REPO there.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The first cell's line: REPO_URL = os.environ.get("RL_SCALING_REPO") or "<url>"
URL_LINE = re.compile(r'^(REPO_URL = os\.environ\.get\("RL_SCALING_REPO"\) or )"[^"\n]*"', re.M)


def remote_url(remote="origin", cwd=HERE):
    res = subprocess.run(["git", "remote", "get-url", remote], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        return None
    url = res.stdout.strip()
    m = re.match(r"^[\w.-]+@([\w.-]+):(.+)$", url)  # scp-like ssh syntax
    return f"https://{m.group(1)}/{m.group(2)}" if m else url


def is_local(url: str) -> bool:
    """Whether a git URL names a path on this machine (which a Colab runtime cannot clone)."""
    if url.startswith("file:"):
        return True
    if re.match(r"^[A-Za-z][\w+.-]*://", url):  # https://, ssh://, git://
        return False
    return not re.match(r"^[\w.-]+@[\w.-]+:", url)  # not scp-like ssh; a plain (or Windows drive) path


def set_url(notebook, url):
    with open(notebook) as f:
        nb = json.load(f)
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    source = "".join(cell["source"])
    if not URL_LINE.search(source):
        raise SystemExit(f"{notebook}: its first code cell has no REPO_URL line to set")
    source = URL_LINE.sub(lambda m: m.group(1) + json.dumps(url), source, count=1)
    cell["source"] = source.splitlines(keepends=True)
    with open(notebook, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", default=sorted(glob.glob(os.path.join(HERE, "*.ipynb"))))
    parser.add_argument("--remote", default="origin")
    args = parser.parse_args(argv)
    url = remote_url(args.remote)
    if not url:
        sys.exit(f"this checkout has no git remote {args.remote!r}: add it (git remote add {args.remote} URL) "
                 "and rerun, or set RL_SCALING_REPO (or REPO_URL in the first cell) in Colab")
    if is_local(url):
        print(f"warning: git remote {args.remote!r} is a path on this machine ({url}): a Colab runtime cannot clone "
              "it. Push the repository to a host Colab can reach and point the remote there (git remote set-url "
              f"{args.remote} URL), or set RL_SCALING_REPO in Colab before the first cell", file=sys.stderr)
    for nb in args.notebooks:
        set_url(nb, url)
        print(f"{nb}: REPO_URL = {url}")


if __name__ == "__main__":
    main()
