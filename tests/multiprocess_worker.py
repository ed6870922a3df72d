"""One process of the two-process test (tests/test_distributed.py): joins the job through
rl_scaling.distributed.initialize (RL_SCALING_* env), runs one RL step on a mesh over both
processes' devices with the batch built from this process's half, writes loss and params."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_scaling import distributed, sharding  # noqa: E402


def main(out_path: str, rows_given: str):
    assert distributed.initialize(), "RL_SCALING_COORDINATOR must be set"
    assert jax.process_count() == 2 and jax.device_count() == 2 * jax.local_device_count()
    from configs import tiny
    from rl_scaling.rl import train_step as ts
    from tests.conftest import TINY
    from tests.test_train_step import random_batch

    config = tiny.get_config()
    config.rl.grad_accum = 2
    mesh = sharding.make_mesh({"data": 2, "fsdp": -1})  # data spans the two processes
    opt = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(TINY, opt, mesh)
    state = ts.init_state(TINY, opt, jax.random.key(0), mesh, state_sh)
    step = ts.jit_step(ts.rl_step, state_sh, mesh, model_cfg=TINY, rl_cfg=config.rl, optimizer=opt)
    # Sampling: every process holds all prompts, feeds its own rows, gets all samples back.
    from rl_scaling import tasks
    from rl_scaling.rollout import collect

    task = tasks.make_task(config.task, 0)
    problems = [task.train_problem(i) for i in range(4)]
    _, _, out, _, rewards = collect.generate(state["params"], TINY, task, problems, 2, jax.random.key(1),
                                             max_prompt_len=config.task.max_prompt_len, max_new_tokens=6,
                                             temperature=1.0)
    np.savez(f"{out_path}.gen{jax.process_index()}.npz", tokens=out.tokens_BT, logprobs=out.logprobs_BT,
             rewards=rewards)

    full = random_batch(0)
    if rows_given == "local":  # each process builds only its own prompts' rows
        start, stop = distributed.local_rows(sharding.batch_sharding(mesh, 2), full["tokens"].shape)
        G = full["rewards"].shape[1]
        batch = {k: (v[start // G:stop // G] if k == "rewards" else v[start:stop]) for k, v in full.items()}
        assert stop - start == full["tokens"].shape[0] // 2
    else:
        batch = full
    batch = distributed.global_batch(batch, mesh, rows_given=rows_given)
    assert not batch["tokens"].is_fully_addressable
    new_state, metrics = step(state, batch)
    params = distributed.to_host(new_state["params"])
    metrics = distributed.to_host(metrics)
    if distributed.is_main():
        flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}
        np.savez(out_path, loss=np.asarray(metrics["loss"]), **flat)
    jax.distributed.shutdown()


def train_run(workdir: str):
    """The whole loop (warm start, rollouts, RL steps, eval, checkpoint) across both processes."""
    assert distributed.initialize()
    from rl_scaling import train
    from tests.test_run import fast_config

    result = train.train(fast_config(steps=2, eval_every=2, checkpoint_every=2, log_every=1), workdir)
    print("result", jax.process_index(), result, flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[2] == "train":
        train_run(sys.argv[1])
    else:
        main(sys.argv[1], sys.argv[2])
