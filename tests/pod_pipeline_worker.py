"""One trainer process of tests/test_pod_pipeline.py: joins the job (RL_SCALING_* env) and runs
the tiny loop in pipeline mode against the engine replicas named on the command line."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from rl_scaling import distributed  # noqa: E402


def config(servers: str, steps: int, init_checkpoint: str = ""):
    from tests.test_pipeline import _tiny_run_config

    c = _tiny_run_config("pipeline", steps=steps)
    c.rollout.servers, c.rollout.ledger, c.rollout.reconnect_s = servers, True, 5.0
    c.rl.no_positive_resampling = False  # the stream stays the plain shuffled pool: a reference to check against
    c.checkpoint_every, c.eval_every = 10, steps
    c.init_checkpoint = init_checkpoint
    return c


def main(workdir: str, servers: str, steps: str, init_checkpoint: str = ""):
    assert distributed.initialize(), "RL_SCALING_COORDINATOR must be set"
    from rl_scaling import train

    result = train.train(config(servers, int(steps), init_checkpoint), workdir)
    print("result", jax.process_index(), json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
