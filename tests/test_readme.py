"""README.md as a newcomer reads it: every repository path it names exists, every flag it gives a
`launch/` script is one that script's parser accepts (and every --config.FIELD a field of the
config), the module list names every module, the paper notes it cites are in the repository, and
the commands the issue tracker found broken work as written."""

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
SKIP_DIRS = {".venv", ".git", "__pycache__", "results", "node_modules"}
SOURCE = (".py", ".cc", ".h", ".ipynb")  # a bare *.md is usually an output (comparison.md)
# Files the README names that live outside this repository (the peers' scripts, JetStream's client).
EXTERNAL = {"tunix_sampler.py", "tunix_grpo.py", "tools/requester.py", "JetStream/jetstream/tools/requester.py"}


def _repo_files():
    out = []
    for root, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        out += [os.path.relpath(os.path.join(root, f), ROOT) for f in files]
    return out


def _spans(text):
    """Backticked spans and markdown link targets."""
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)


def named_paths(text):
    """(kind, token): 'path' for a token whose first part is a top-level entry of the repository,
    'suffix' for a source file named with a folder (`policy/mlp.py`), 'name' for a bare source file."""
    top = set(os.listdir(ROOT)) - {".venv", ".git"}
    found = set()
    for span in _spans(text):
        for tok in span.split():
            tok = tok.strip("(),;'\"").split(":")[0].rstrip(".")
            if not tok or tok.startswith(("http", "#", "gs:", "-", "..", "~", "/")) or any(c in tok for c in "<>*=$[]{}|"):
                continue
            if tok in EXTERNAL:
                continue
            if "/" in tok and tok.split("/")[0] in top:
                found.add(("path", tok))
            elif tok.endswith(SOURCE) and re.fullmatch(r"[\w./-]+", tok):
                found.add(("suffix" if "/" in tok else "name", tok))
    return sorted(found)


def test_every_repository_path_named_exists():
    files = _repo_files()
    names = {os.path.basename(f) for f in files}
    missing = []
    for kind, tok in named_paths(README):
        if kind == "path":
            ok = os.path.exists(os.path.join(ROOT, tok))
        elif kind == "suffix":
            ok = any(f == tok or f.endswith("/" + tok) for f in files)
        else:
            ok = tok in names
        if not ok:
            missing.append(tok)
    assert not missing, f"README names paths that do not exist: {missing}"


def test_paper_notes_are_in_the_repository():
    assert os.path.isfile(os.path.join(ROOT, "docs", "paper.md"))
    assert not re.search(r"(?<![/\w])PAPER\.md", README), "README cites PAPER.md; the notes are docs/paper.md"
    assert "docs/paper.md" in README
    paper = open(os.path.join(ROOT, "docs", "paper.md"), encoding="utf-8").read()
    for section in ("## 1.", "## 2.", "## 3.", "## 4."):  # what the code cites ("section 3", "section 4")
        assert section in paper


def _commands(text):
    """(script, [--flag tokens]) of every `launch/NAME.py ...` command: in a backticked span, or on
    a code line with its backslash continuations."""
    out = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for m in re.finditer(r"launch/(\w+)\.py", span):
            out.append((m.group(1), span[m.end():].split()))
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("    ") or "launch/" not in line:
            continue
        full = line
        while full.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            full = full.rstrip()[:-1] + " " + lines[i]
        for m in re.finditer(r"launch/(\w+)\.py", full):
            out.append((m.group(1), full[m.end():].split()))
    return [(script, [t for t in toks if t.startswith("--")]) for script, toks in out]


def _strings(node):
    return [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def script_flags(script):
    """Flags a launch script's parser accepts, read from its source: argparse add_argument('--x') and
    absl / ml_collections DEFINE_*('x') (with --nox for booleans); 'config' if it takes --config.FIELD."""
    tree = ast.parse(open(os.path.join(ROOT, "launch", f"{script}.py"), encoding="utf-8").read())
    flags, config = {"--help", "--helpfull"}, False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name == "add_argument":
            flags |= {s for s in _strings(node) if s.startswith("--")}
        elif name.startswith("DEFINE_") and _strings(node):
            flag = _strings(node)[0]
            flags.add(f"--{flag}")
            if name in ("DEFINE_bool", "DEFINE_boolean"):
                flags.add(f"--no{flag}")
            if name.startswith("DEFINE_config"):
                config = True
    return flags, config


def _config_fields():
    sys.path.insert(0, ROOT)
    from configs import common

    def walk(node, prefix):
        for key in node.keys():
            if hasattr(node[key], "keys"):
                yield from walk(node[key], f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    return set(walk(common.base_config(), ""))


def test_every_launch_flag_named_is_accepted():
    fields = _config_fields()
    bad = []
    commands = _commands(README)
    assert len(commands) > 20
    for script, toks in commands:
        if not os.path.isfile(os.path.join(ROOT, "launch", f"{script}.py")):
            bad.append(f"launch/{script}.py does not exist")
            continue
        accepted, takes_config = script_flags(script)
        for tok in toks:
            flag = tok.split("=")[0].rstrip(".,;)]`")
            if flag.startswith("--config.") and takes_config:
                if flag[len("--config."):] not in fields:
                    bad.append(f"launch/{script}.py {flag}: no such config field")
            elif flag not in accepted:
                bad.append(f"launch/{script}.py {flag}")
    assert not bad, f"README gives launch scripts flags their parsers reject: {bad}"


def test_layout_names_every_module():
    """The README's Layout names every module of rl_scaling/, launch/ and configs/."""
    layout = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    missing = []
    for folder in ("rl_scaling", "launch", "configs"):
        for root, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            for f in files:
                if f.endswith(".py") and f != "__init__.py" and not re.search(rf"\b{re.escape(f)}\b", layout):
                    missing.append(os.path.relpath(os.path.join(root, f), ROOT))
    assert not missing, f"the Layout omits {missing}"


def test_the_checker_catches_what_the_old_readme_got_wrong():
    """The path and flag checks find the errors the issue lists (so they are not vacuous)."""
    old = ("`cpu_attention.py` ... (PAPER.md section 3) `rl_scaling/policy/nothing.py`\n"
           "`python launch/bench_modes.py --dims= --modes=sync`\n")
    toks = [t for _, t in named_paths(old)]
    assert "cpu_attention.py" in toks and "rl_scaling/policy/nothing.py" in toks
    assert ("bench_modes", ["--dims=", "--modes=sync"]) in _commands(old)
    assert "--dims" not in script_flags("bench_modes")[0] and "--modes" in script_flags("bench_modes")[0]


def test_fit_out_defaults_to_the_first_input_fit_folder(tmp_path):
    """`launch/fit.py gs://B/run` works without --out: RUN/fit (no storage call to decide it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_cli_readme", os.path.join(ROOT, "launch", "fit.py"))
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    assert fit.parse_args(["gs://B/run"]).out == "gs://B/run/fit"
    assert fit.parse_args(["gs://B/run", "--out=gs://B/elsewhere"]).out == "gs://B/elsewhere"
    assert fit.parse_args([str(tmp_path)]).out == str(tmp_path / "fit")
    csv = tmp_path / "curve.csv"
    csv.write_text("compute,pass_rate\n")
    assert fit.parse_args([str(csv)]).out == str(tmp_path / "fit")


def test_jetstream_requester_example_is_in_the_task_format():
    """The requester.py example names JetStream's tag and sends a prompt the tiny policy was trained on,
    with a max_tokens that fits the whole answer."""
    sys.path.insert(0, ROOT)
    from rl_scaling.tasks import arithmetic
    from rl_scaling.tasks.tokenizer import CharTokenizer

    block = README[README.index("tools/requester.py"):]
    block = block[: block.index("PPO-off-policy-k is the synchronous mode")]
    assert "v0.2.2" in block and "git clone --branch v0.2.2" in block
    text = re.search(r'--text="([^"]+)"', block).group(1)
    max_tokens = int(re.search(r"--max_tokens=(\d+)", block).group(1))
    problem = next(arithmetic.make_problem(level, 12, 3) for level, spec in enumerate(arithmetic.LEVELS)
                   if spec[0] == "+")
    assert "<bos>" + text == problem.prompt  # the server prepends <bos>
    tok = CharTokenizer()
    assert max_tokens >= len(tok.encode(arithmetic.reference_completion(problem)))


@pytest.mark.parametrize("script", ["bench_modes", "bench_tunix", "fit"])
def test_readme_commands_parse(script):
    """The README's bench_modes.py, bench_tunix.py and fit.py commands get past argument parsing (--help after
    the README's flags: argparse exits 0 only if every flag before it parses)."""
    cmd = {"bench_modes": ["--modes=sync,ppo8,pipeline8,remote8"], "bench_tunix": ["--rounds=5"],
           "fit": ["gs://BUCKET/runs/scout"]}[script]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", (
        "import runpy, sys; sys.argv = sys.argv[1:]; "
        "import argparse; orig = argparse.ArgumentParser.parse_args\n"
        "def parse(self, args=None, namespace=None):\n"
        "    ns = orig(self, args, namespace); print('PARSED', ns); raise SystemExit(0)\n"
        "argparse.ArgumentParser.parse_args = parse\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')"),
        os.path.join(ROOT, "launch", f"{script}.py"), *cmd], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and "PARSED" in res.stdout, res.stderr[-2000:]
