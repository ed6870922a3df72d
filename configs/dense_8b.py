"""ScaleRL on Llama-3.1-8B (docs/paper.md section 4): the paper's 8B dense run on TPU v5p.

Command:   python launch/run.py --config=configs/dense_8b.py --workdir=gs://BUCKET/runs/dense_8b \
               --config.init_checkpoint=PARAMS --config.task.path=polaris.jsonl \
               --config.task.tokenizer=llama3/tokenizer.json
           (PARAMS: a local or gs:// Orbax params checkpoint of the HF Llama-3.1-8B weights, written with
           `launch/convert.py import`; Polaris-53K as JSONL of {problem, answer}.)
           Run the same command on every host of the trainer slice: launch/run.py initializes
           jax.distributed (rl_scaling/distributed.py) and each host feeds its share of the batch.
Dry run:   python launch/run.py --config=configs/dense_8b.py --dry_run
           compiles the train step and a decode/prefill step for the slices below on a CPU-only
           machine (libtpu; requirements-tpu.txt) and prints per-chip HBM, FLOPs and time estimates.
Variants:  --config=configs/dense_8b.py:recipe=grpo (any name in configs/common.py RECIPES)
Hardware:  trainer  TPU v5p-32 (16 chips, v5p:2x2x4), FSDP over all 16 chips;
           generators TPU v5p-128 (64 chips, v5p:4x4x4): 16 engine replicas of 4 chips (tensor
           parallel), 64 concurrent sequences each. 16 + 64 chips mirror the paper's 16 training +
           64 generating GPUs (each v5p chip has 95 GiB of HBM, half a GB200's).
Batch:     the paper's: 48 prompts x 16 samples = 768 sequences per step, 2,048 prompt + 14,336
           generated tokens (forced interruption at U[10,240, 12,224] thinking tokens, 2,048
           answer tokens; the upper bound leaves 64 tokens for the interrupt phrase inside 12,288);
           one update per step (num_minibatches 1) over 24 microbatches of 32 sequences (2 per chip).
Model:     bfloat16 body, float32 master weights and AdamW moments, float32 LM head (trainer and
           generators), per-layer rematerialisation, attention over blocks of 1,024 queries,
           log-probs over blocks of 2,048 positions.
Optimizer: AdamW, constant lr 5e-7 after 100 warm-up steps, eps 1e-15, weight decay 0.01, no KL.
Expected:  dry run fits (per-chip HBM well under 95 GiB for both steps). A real run: held-out
           mean@16 on Polaris rising along the paper's sigmoid (A ~0.61, B ~1.9, C_mid ~2.5k GPU-h
           in the paper's GB200 hours; Table 1).
Rollouts:  the paper's PipelineRL-8 (rollout.mode=pipeline, max_staleness 8) with forced
           interruption in the engine, on 16 engine replicas (launch/serve.py) on the generator
           slice. On a pod (a shared secret in a file both slices can read; 16 replicas of 4 chips,
           one per v5p-128 host, each `serve.py` over its host's chips):
             gcloud compute tpus tpu-vm ssh GEN --worker=all --command="cd rl_scaling && \
               RL_SCALING_ROLLOUT_TOKEN=$(cat token) python launch/serve.py --config=configs/dense_8b.py \
               --host=0.0.0.0 --port=50051"
             gcloud compute tpus tpu-vm ssh TRAIN --worker=all --command="cd rl_scaling && \
               RL_SCALING_ROLLOUT_TOKEN=$(cat token) python launch/run.py --config=configs/dense_8b.py \
               --workdir=gs://BUCKET/runs/dense_8b --config.rollout.servers=GEN_W0:50051,...,GEN_W15:50051 \
               --config.init_checkpoint=PARAMS ..."
           (GEN_Wi: the generator hosts' internal IPs, `gcloud compute tpus tpu-vm describe GEN`.)
           Add --config.rollout.weights_dir=gs://BUCKET/runs/dense_8b/weights to the trainer and
           --weights_dir=the same to serve.py to ship weights through the bucket instead of 16 pushes.
           --config.rollout.mode=sync runs generation on the trainer slice instead.
Reductions: none in shapes.
"""

import ml_collections

from configs import common


def get_config(arg=None):
    args = common.parse_arg(arg)
    config = common.base_config()
    config.rollout.prompts_per_step = 48  # per update; apply_recipe scales it for the PPO-off-policy recipes
    common.apply_recipe(config, args.pop("recipe", "scalerl"))
    config.steps = int(args.pop("steps", 5000))
    if args:
        raise ValueError(f"unknown config arg(s) {sorted(args)}; valid: recipe, steps")
    config.eval_every = 100  # the paper evaluates every 100 steps
    config.checkpoint_every = 50
    config.log_every = 1

    config.model = ml_collections.ConfigDict(dict(
        preset="dense_8b", dtype="bfloat16", param_dtype="float32", remat=True, attn_query_chunk=1024,
    ))
    config.task = ml_collections.ConfigDict(dict(name="jsonl_math", max_prompt_len=2048, path="", tokenizer="",
                                                 heldout_fraction=0.02))
    rc = config.rollout
    rc.samples_per_prompt = 16
    rc.max_new_tokens = 14336
    rc.think_budget_lo, rc.think_budget_hi, rc.answer_budget = 10240, 12224, 2048
    rc.interrupt_phrase = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    rc.engine_slots = 64
    rc.mode, rc.max_staleness = "pipeline", 8  # PipelineRL-8; set rollout.servers to the replicas
    rc.push_dtype = "bfloat16"  # weights to the engines in bfloat16 (16 GB, not 32), the LM head float32
    if rc.dynamic_sampling or config.rl.loss == "reinforce":  # recipes that need synchronous generation
        rc.mode = "sync"
    rl = config.rl
    rl.grad_accum = 24
    rl.logprob_chunk = 2048
    rl.overlong_max_len, rl.overlong_cache = 14336, 2048  # DAPO's L_max / L_cache (recipe=dapo variants)
    config.optim = ml_collections.ConfigDict(dict(
        lr=5e-7, warmup_steps=100, b1=0.9, b2=0.999, eps=1e-15, weight_decay=0.01, grad_clip=1.0,
    ))
    config.eval = ml_collections.ConfigDict(dict(num_prompts=1000, samples_per_prompt=16, batch_size=512))

    config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, expert=1))
    config.tpu = ml_collections.ConfigDict(dict(
        train_topology="v5p:2x2x4", gen_topology="v5p:4x4x4",
        gen_mesh=dict(data=16, fsdp=1, tensor=4, expert=1), hbm_gib=0.0,
    ))
    return config
