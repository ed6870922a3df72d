"""Train a policy with RL: `python launch/run.py --config=configs/tiny.py --workdir=DIR`.

Re-running the same command on the same workdir resumes from its latest checkpoint.
On a slice with several hosts run the same command on every host: it joins them with
jax.distributed first (rl_scaling/distributed.py says how each environment is detected), and
only process 0 logs and writes metrics.

`--dry_run` compiles the config's train and generation steps for its TPU slices
(config.tpu) on this machine, TPU or not, prints per-chip HBM, FLOPs and time estimates, and
exits non-zero when a step does not fit (rl_scaling/dry_run.py).

`--print_config` prints every field of the config (after any --config.FIELD=VALUE) with its value,
and exits: the names a --config.FIELD flag takes and their defaults.

Exit status: 0 done; 75 (EX_TEMPFAIL) stopped by SIGTERM/SIGINT after saving the step it was on
(re-run to resume; rl_scaling/preemption.py); 128 + N killed by a second signal N, or when the
save took longer than config.preemption_grace_s; 1 an error. A user error (a bad or misspelt config
field, another trainer holding the workdir, an init_checkpoint of another architecture, a checkpoint
that could not be saved, ...) is one line on stderr naming the field, the value and the fix;
`--verbose` adds the traceback. Numeric config ranges are checked before the workdir is touched, and
a run that fails before it has saved anything leaves nothing behind in its workdir.
"""

import glob
import logging
import os
import re
import sys
import traceback


from absl import app, flags, logging as absl_logging
from ml_collections import config_flags

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rl_scaling/tiny", "Where checkpoints, logs and metrics.jsonl go: a "
                               "local path or gs://BUCKET/PATH (STORAGE_EMULATOR_HOST=http://HOST:PORT for an emulator).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the steps for config.tpu's slices ahead of time and "
                             "check they fit in HBM; train nothing.")
_DRY_RUN_STEPS = flags.DEFINE_list("dry_run_steps", ["train", "generation"], "What --dry_run compiles.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print every config field and its value (the config "
                                  "file's defaults, after any --config.FIELD=VALUE) and exit.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "On an error, print the traceback as well as the one-line message.")


class UserError(Exception):
    """An error in what the user gave (a flag, a config field, a path): one line, exit status 1."""


def _one_line(text, max_parts: int = 0) -> str:
    """A multi-line message as one line: a header ending in ':' then its items, '; '-separated
    (at most `max_parts` items when given; the rest are counted)."""
    parts = [part.strip() for part in str(text).strip().splitlines() if part.strip()]
    if not parts:
        return ""
    head, items = (parts[0], parts[1:]) if parts[0].endswith(":") else ("", parts)
    if max_parts and len(items) > max_parts:
        items = items[:max_parts] + [f"... ({len(items) - max_parts} more; --verbose lists them)"]
    return f"{head} {'; '.join(items)}".strip()


def _verbose() -> bool:
    try:
        return bool(flags.FLAGS["verbose"].value) if flags.FLAGS.is_parsed() else "--verbose" in sys.argv
    except KeyError:
        return False


def _fail(message, exc: BaseException | None = None):
    """Print `error: MESSAGE` (one line; the traceback too with --verbose) and exit with status 1."""
    if exc is not None and _verbose():
        traceback.print_exception(exc)
    hint = "" if _verbose() or exc is None else " (--verbose shows the traceback)"
    print(f"error: {_one_line(message)}{hint}", file=sys.stderr, flush=True)
    sys.exit(1)


def _innermost_message(e: BaseException) -> str:
    """The text of an exception, unwrapped from the KeyError/AttributeError layers ml_collections adds."""
    while e.args and isinstance(e.args[0], BaseException):
        e = e.args[0]
    return str(e.args[0]) if e.args else str(e)


def _config_error(e: BaseException, argv) -> str:
    """One line for an error in --config or a --config.FIELD flag."""
    text = _innermost_message(e)
    m = re.match(r"""'([^']+)'\s*\nDid you mean "([^"]+)" instead""", text)
    if m or isinstance(e, (KeyError, AttributeError)):
        key = m.group(1) if m else text.strip("'\"")
        flag = next((a for a in argv if a.startswith("--config.") and key in re.split(r"[.=]", a[2:])), None)
        hint = f'; did you mean "{m.group(2)}"?' if m else ""
        return (f"{flag or '--config'}: the config has no field {key!r}{hint} "
                "(--print_config lists the fields and their defaults)")
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    flag = next((a for a in argv if a.startswith("--config=") or a.startswith("--config.")), "--config")
    if len(lines) > 1:  # a config file that failed to load or raised in get_config: its last line says why
        return f"{flag}: {lines[-1]}"
    return _one_line(text) if text.startswith(flag) or "flag --" in text else f"{flag}: {_one_line(text)}"


def _parse_flags(argv):
    """absl's flag parsing, with every error as one line (`--verbose`: and its traceback)."""
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        _fail(_config_error(e, argv) if "--config" in str(e) else f"{e} (--helpfull lists the flags)", e)
    try:
        _CONFIG.value.keys()  # ml_collections loads the file lazily: now, so a failure is reported here
    except Exception as e:  # noqa: BLE001 - any error in the config file or an override is the user's
        _fail(_config_error(e, argv), e)
    return rest


try:  # ml_collections applies the --config.FIELD overrides of sys.argv here already
    _CONFIG = config_flags.DEFINE_config_file(
        "config", os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py"),
        "Experiment config file, optionally with an arg: configs/tiny.py:recipe=dapo", lock_config=True)
except Exception as e:  # noqa: BLE001 - a misspelt --config.FIELD
    _fail(_config_error(e, sys.argv), e)


def print_config(config) -> None:
    """Every field as `dotted.name = value`, sections in order; overridden fields are marked."""
    overrides = config_flags.get_override_values(flags.FLAGS["config"])

    def walk(node, prefix):
        for key in node.keys():
            value, name = node[key], f"{prefix}{key}"
            if hasattr(value, "keys"):
                walk(value, f"{name}.")
            else:
                mark = "  # set by --config." + name if name in overrides else ""
                print(f"{name} = {value!r}{mark}")

    print(f"# {os.path.normpath(config_flags.get_config_filename(flags.FLAGS['config']))}: set a field with "
          "--config.NAME=VALUE")
    walk(config, "")


def _surely_process_0() -> bool:
    """Whether this process is process 0 of its run, decided without jax (rl_scaling/distributed.py:
    a coordinator with RL_SCALING_PROCESS_ID=0, or one process and no TPU slice to join)."""
    if os.environ.get("RL_SCALING_COORDINATOR", "").strip():
        return os.environ.get("RL_SCALING_PROCESS_ID", "").strip() == "0"
    switch = os.environ.get("RL_SCALING_DISTRIBUTED", "").strip()
    return switch == "0" or (switch != "1" and not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"))


def _lock_or_exit(lock):
    from rl_scaling import paths

    try:
        lock.acquire(_WORKDIR.value)
    except lock.LockHeld as e:
        _fail(e, e)
    except paths.StorageError as e:  # names the object and the endpoint
        _fail(f"--workdir={_WORKDIR.value} is not writable: {e}", e)
    except Exception as e:  # noqa: BLE001 - OSError locally; client/network errors on gs://
        _fail(f"--workdir={_WORKDIR.value} is not writable: {type(e).__name__}: {e}", e)


class _Workdir:
    """What the workdir held before this run, so that a run failing before it saved anything can
    remove what it wrote (config.json, trainer.lock, empty folders) and leave the workdir as it was.
    A gs:// workdir is not listed up front (an unreachable endpoint would fail twice as slowly): there
    the two files go only when they are all the workdir holds."""

    LEFTOVERS = {"config.json", "trainer.lock"}

    def __init__(self, workdir):
        from rl_scaling import paths

        self.paths, self.files, self.dirs, self.existed = paths, set(), set(), False
        try:
            self.root = paths.resolve(workdir)
            if not paths.is_gcs(self.root):
                self.existed = os.path.exists(self.root)
                self.top = self.root  # the outermost folder this run would create
                while not os.path.exists(os.path.dirname(self.top)):
                    self.top = os.path.dirname(self.top)
                if self.existed:
                    self.files = set(paths.find(self.root))
                    self.dirs = {os.path.join(r, d) for r, ds, _ in os.walk(self.root) for d in ds} | {self.root}
        except Exception:  # noqa: BLE001 - a bad or unreadable workdir fails later, with its own message
            self.root = None

    def clean_up(self):
        """Remove what this run wrote when that is only config.json, trainer.lock and empty folders."""
        try:
            if self.root is None or not self.paths.exists(self.root):
                return
            new = set(self.paths.find(self.root)) - self.files
            if any(self.paths.basename(f) not in self.LEFTOVERS for f in new):
                return  # the run saved something (a warm start, a checkpoint, metrics): keep it all
            for f in new:
                self.paths.remove(f)
            if self.paths.is_gcs(self.root):
                return
            for root, _, _ in sorted(os.walk(self.root), key=lambda t: -len(t[0])):  # deepest first
                if root not in self.dirs and not os.listdir(root):
                    os.rmdir(root)
            parent = os.path.dirname(self.root)
            while not self.existed and self.root != self.top and not os.path.exists(self.root) and \
                    parent.startswith(self.top) and os.path.isdir(parent) and not os.listdir(parent):
                os.rmdir(parent)  # the empty parents this run created on the way to its workdir
                self.root, parent = parent, os.path.dirname(parent)
        except Exception as e:  # noqa: BLE001 - the run's own error is the one to report
            logging.warning("could not remove what the failed run wrote in %s: %s", self.root, e)


def _init_checkpoint_context(message: str, config) -> str:
    """An init_checkpoint that does not fit config.model: name the field and the fix."""
    path = config.get("init_checkpoint", "")
    if path and path.rstrip("/") in message:
        return (f"config.init_checkpoint={path}: {_one_line(message, max_parts=3)}; point --config.init_checkpoint at params of "
                "this architecture, or set --config.model (or the config file) to the checkpoint's")
    return message


def main(argv):
    del argv
    if _PRINT_CONFIG.value:
        try:
            print_config(_CONFIG.value)
        except BrokenPipeError:  # `--print_config | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    from rl_scaling import config as config_lib  # no jax: the ranges are checked before the workdir is touched

    try:
        config_lib.check_ranges(_CONFIG.value)
    except ValueError as e:
        _fail(e, e)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(absl_logging.WARNING)
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("rl_scaling").setLevel(logging.INFO)  # resume and fall-back lines (absl lowers the root)
    if _DRY_RUN.value:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for config.tpu's slices; needs no accelerator
        from rl_scaling import dry_run

        try:
            print(dry_run.summary(dry_run.run(_CONFIG.value, steps=tuple(_DRY_RUN_STEPS.value))))
        except (dry_run.DoesNotFit, dry_run.DryRunError) as e:
            print(f"dry run failed: {e}", file=sys.stderr)
            sys.exit(1)
        return
    from rl_scaling import lock, paths

    paths.configure_storage(_CONFIG.value.storage)  # deadlines on every gs:// call, the lock's first
    workdir = _Workdir(_WORKDIR.value)
    if _surely_process_0():  # lock before importing jax: a second trainer on this workdir stops within seconds
        _lock_or_exit(lock)
    from configs import common
    from rl_scaling import distributed  # after flags: jax reads its env at import

    if distributed.initialize() and not distributed.is_main():
        logging.getLogger().setLevel(logging.ERROR)  # process 0 logs for the run
        logging.getLogger("rl_scaling").setLevel(logging.ERROR)
    if distributed.is_main():
        _lock_or_exit(lock)  # held already unless this is a TPU slice's process 0
    from rl_scaling import checkpoint, metrics, preemption, train

    deviations = common.recipe_deviations(_CONFIG.value)
    if deviations:
        logging.warning("this run is labelled recipe=%r but differs from it in %s; select a recipe with "
                        "--config=configs/tiny.py:recipe=NAME, and label an ablation with --config.recipe=LABEL "
                        "(the fitter groups seeds by that label)", _CONFIG.value.recipe, ", ".join(deviations))
    try:
        result = train.train(_CONFIG.value, _WORKDIR.value)
    except preemption.Preempted as e:
        print(f"preempted: {e}", file=sys.stderr, flush=True)
        sys.exit(preemption.EXIT_PREEMPTED)
    except (checkpoint.CheckpointSaveError, lock.LockHeld, metrics.MetricsWriteError, paths.StorageError) as e:
        _fail(e, e)
    except (ValueError, FileNotFoundError) as e:  # a bad config, path or init_checkpoint (the message names it)
        if distributed.is_main():
            workdir.clean_up()
        _fail(_init_checkpoint_context(str(e), _CONFIG.value), e)
    if distributed.is_main():
        print("done:", {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
