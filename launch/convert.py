"""Hugging Face safetensors <-> Orbax params.

    python launch/convert.py import HF_DIR PARAMS_OUT [--param_dtype=float32]
        A Llama / Llama-4 checkpoint directory -> an Orbax params checkpoint for
        --config.init_checkpoint. (init_checkpoint also takes HF_DIR itself; each host then reads
        its slices of the safetensors, a byte range at a time on gs://.)
    python launch/convert.py export WORKDIR HF_OUT [--step=N] [--dtype=bfloat16]
        The policy of a training run (its latest checkpoint, or step N; step 0 is the warm
        start) -> HF safetensors + config.json that transformers loads, with the run's
        tokenizer (tokenizer.json: the char tokenizer, or a copy of config.task.tokenizer), its
        bos/eos/pad ids and a generation_config.json with the run's sampling settings, so
        AutoTokenizer and AutoModelForCausalLM.generate work from HF_OUT alone.

Every path may be local or gs://BUCKET/PATH (rl_scaling/paths.py).

Both directions stream one tensor block at a time (rl_scaling/policy/hf_io.py, hf_export.py); the params are
spread over all local devices, so no single device holds the whole model.
"""

from __future__ import annotations

import argparse
import json
import sys


import jax
import ml_collections
import tqdm
import orbax.checkpoint as ocp

from rl_scaling import checkpoint, config as config_lib, paths, sharding, tasks
from rl_scaling.policy import hf_export, hf_io


def _bar(desc):
    """progress(done, total) for hf_io / hf_export, drawn as a tqdm bar (8B and Scout take minutes)."""
    bar = tqdm.tqdm(desc=desc, unit="tensor", file=sys.stderr)

    def progress(done, total):
        bar.total = total
        bar.update(done - bar.n)
        if done == total:
            bar.close()
    return progress


def import_hf(hf_dir: str, out: str, param_dtype: str = "float32") -> None:
    if not hf_io.is_hf_checkpoint(hf_dir):
        raise SystemExit(f"{hf_dir}: not a Hugging Face checkpoint directory (config.json + *.safetensors)")
    cfg = hf_io.config_from_hf(hf_dir, param_dtype=param_dtype)
    params = hf_io.load_hf_checkpoint(hf_dir, cfg, sharding.make_mesh({"fsdp": -1}), progress=_bar(f"reading {hf_dir}"))
    checkpoint.save_params(out, params)
    print(f"wrote {out}: {sum(x.size for x in jax.tree.leaves(params)):,} parameters ({param_dtype})")


def run_config(workdir: str) -> ml_collections.ConfigDict:
    config_path = paths.join(workdir, "config.json")
    if not paths.exists(config_path):
        raise SystemExit(f"{config_path} not found: is {workdir} a training run's workdir?")
    return ml_collections.ConfigDict(json.loads(paths.read_text(config_path)))


def run_tokenizer(config):
    """The tokenizer the run encoded its prompts with (without loading the task's data)."""
    if config.task.get("tokenizer"):
        from rl_scaling.tasks.hf_tokenizer import HFTokenizer

        return HFTokenizer(config.task.tokenizer)
    return tasks.make_task(config.task, config.seed).tokenizer


def run_params(workdir: str, step: int | None = None):
    """(params, train ModelConfig, step) of a run's checkpoint; only the params are read."""
    config = run_config(workdir)
    cfg = config_lib.model_config(config)
    shapes, shardings = hf_io.abstract_params(cfg, sharding.make_mesh({"fsdp": -1}))
    abstract = checkpoint.abstract_like(shapes, shardings)
    if step == 0:
        return checkpoint.load_params(paths.join(workdir, "warmstart", "params"), abstract), cfg, 0
    manager = ocp.CheckpointManager(paths.path(paths.join(workdir, "checkpoints")), item_names=("state", "meta"),
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    steps = manager.all_steps()
    if not steps:
        raise SystemExit(f"{workdir}/checkpoints has no checkpoint")
    step = max(steps) if step is None else step
    if step not in steps:
        raise SystemExit(f"{workdir}/checkpoints has no step {step}; it has {sorted(steps)}")
    item = {"params": abstract}  # the optimizer state is not read
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    return restored["state"]["params"], cfg, step


def export_hf(workdir: str, out: str, step: int | None = None, dtype: str | None = None) -> None:
    params, cfg, step = run_params(workdir, step)
    config = run_config(workdir)
    # generate()'s defaults sample as the run's rollouts did: the full distribution (top_k 0) at
    # its temperature, at most its max_new_tokens; pass do_sample=False for greedy decoding.
    generation = dict(do_sample=True, temperature=float(config.rollout.temperature), top_k=0, top_p=1.0,
                      max_new_tokens=int(config.rollout.max_new_tokens))
    hf_export.save_hf_checkpoint(params, cfg, out, dtype=dtype, tokenizer=run_tokenizer(config), generation=generation,
                                 progress=_bar(f"writing {out}"))
    print(f"wrote {out}: the policy at step {step}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("import", help="HF safetensors -> Orbax params")
    imp.add_argument("hf_dir")
    imp.add_argument("out")
    imp.add_argument("--param_dtype", default="float32", choices=["float32", "bfloat16"])
    exp = sub.add_parser("export", help="a run's checkpoint -> HF safetensors")
    exp.add_argument("workdir")
    exp.add_argument("out")
    exp.add_argument("--step", type=int, default=None)
    exp.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    try:
        if args.direction == "import":
            import_hf(args.hf_dir, args.out, args.param_dtype)
        else:
            export_hf(args.workdir, args.out, args.step, args.dtype)
    except paths.StorageError as e:  # names the gs:// path, the operation and the endpoint
        raise SystemExit(f"launch/convert.py: {e}") from None


if __name__ == "__main__":
    main()
