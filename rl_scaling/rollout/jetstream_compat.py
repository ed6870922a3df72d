"""The one module that imports JetStream (google-jetstream==0.2.2, installed --no-deps).

JetStream 0.2.2 needs three fixes to import next to current jax without its heavy
dependencies (see shared/design/FINDINGS.md, JetStream section):
  1. `jetstream.engine.token_utils` imports `seqio.vocabularies` (which drags in
     TensorFlow) for two names only: a small stand-in module goes into `sys.modules`
     when the real seqio is absent.
  2. It calls `jax.tree_map`, removed from jax: aliased to `jax.tree_util.tree_map`.
  3. Importing `jetstream.core.orchestrator` sets the root logger to DEBUG and adds a
     stdout handler: both are undone right after the import.
`tiktoken` (pinned in requirements.txt) is imported by its llama3 tokenizer module.

Everything the project uses from JetStream is re-exported here, so no other module
imports `jetstream` directly. The import happens on first use of `load()`, never at
module import, so `import rl_scaling.rollout.pipeline` stays cheap.

JetStream's stock scripts (its `tools/requester.py`, which imports `token_utils` and so
seqio) run with the same fixes through this module:

    python -m rl_scaling.rollout.jetstream_compat JetStream/jetstream/tools/requester.py \
        --server=127.0.0.1 --port=PORT --text="12+3=" --tokenizer=unused
"""

from __future__ import annotations

import importlib.util
import logging
import runpy
import sys
import threading
import types

_LOCK = threading.Lock()
_MODULES: types.SimpleNamespace | None = None


def _install_seqio_stub() -> None:
    if "seqio" in sys.modules or importlib.util.find_spec("seqio") is not None:
        return

    class Vocabulary:  # only used by JetStream in type hints and isinstance checks
        pass

    class SentencePieceVocabulary(Vocabulary):
        def __init__(self, *args, **kwargs):
            raise ImportError("seqio is not installed: SentencePiece vocabularies are not available "
                              "(rl_scaling engines use their own tokenizer)")

    seqio = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")
    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    seqio.vocabularies = vocabularies
    seqio.__rl_scaling_stub__ = True
    sys.modules["seqio"] = seqio
    sys.modules["seqio.vocabularies"] = vocabularies


def load() -> types.SimpleNamespace:
    """Import JetStream once (thread-safe) and return its modules:
    engine_api, tokenizer_api, tokenizer_pb2, token_utils, orchestrator, server_lib,
    jetstream_pb2, jetstream_pb2_grpc."""
    global _MODULES
    with _LOCK:
        if _MODULES is not None:
            return _MODULES
        import jax

        if not hasattr(jax, "tree_map"):
            jax.tree_map = jax.tree_util.tree_map
        _install_seqio_stub()
        root = logging.getLogger()
        level, handlers = root.level, list(root.handlers)
        try:
            from jetstream.core import orchestrator, server_lib
            from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
            from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2
        except ImportError as e:
            raise ImportError(
                f"JetStream could not be imported ({e}). Install it with "
                "`pip install --no-deps -r requirements-jetstream.txt` after `pip install -r requirements.txt`."
            ) from e
        finally:  # undo the root-logger changes orchestrator.py makes at import
            root.setLevel(level)
            for h in list(root.handlers):
                if h not in handlers:
                    root.removeHandler(h)
        _MODULES = types.SimpleNamespace(
            engine_api=engine_api, tokenizer_api=tokenizer_api, tokenizer_pb2=tokenizer_pb2,
            token_utils=token_utils, orchestrator=orchestrator, server_lib=server_lib,
            jetstream_pb2=jetstream_pb2, jetstream_pb2_grpc=jetstream_pb2_grpc,
        )
        return _MODULES


def __getattr__(name):  # `from rl_scaling.rollout.jetstream_compat import engine_api` imports on demand
    modules = load()
    if hasattr(modules, name):
        return getattr(modules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_script(path: str, argv: list[str]) -> None:
    """Run a JetStream script (`python path *argv`) with JetStream importable as above."""
    load()
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m rl_scaling.rollout.jetstream_compat SCRIPT.py [ARGS...]")
    run_script(sys.argv[1], sys.argv[2:])
