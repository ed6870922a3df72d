"""ScaleRL on Llama-4-Scout-17B-16E (docs/paper.md section 4): the paper's MoE run on TPU v5p.

Command:   python launch/run.py --config=configs/scout_moe.py --workdir=gs://BUCKET/runs/scout \
               --config.init_checkpoint=PARAMS --config.task.path=polaris.jsonl \
               --config.task.tokenizer=llama4/tokenizer.json
           (PARAMS: a local or gs:// Orbax params checkpoint of the HF Llama-4-Scout-17B-16E text weights, written
           with `launch/convert.py import`.) Run it on every host of the trainer slice; launch/run.py
           joins them with jax.distributed and each host feeds its share of the batch.
Dry run:   python launch/run.py --config=configs/scout_moe.py --dry_run
Variants:  --config=configs/scout_moe.py:recipe=grpo (any name in configs/common.py RECIPES)
Hardware:  trainer  TPU v5p-128 (64 chips, v5p:4x4x4), mesh expert=16 x fsdp=4: expert parallelism
           (one routed expert per chip of each 16-chip group, gathered over fsdp=4 only; tokens
           travel to their expert by ragged all-to-all, policy/moe.py), dense weights FSDP over
           all 64 chips. The dry run prints its traffic next to the weight-gather variant's
           (--config.model.moe_impl=ragged, which all-gathers every expert per layer);
           generators TPU v5p-128 (64 chips, v5p:4x4x4): 8 engine replicas of 8 chips, tensor
           parallel (heads, MLP and expert hidden over 8 chips, so no weight moves while decoding),
           128 concurrent sequences each (decoding is memory-bound: more slots amortise the
           25 GiB of weights each chip reads per step).
           The paper trained Scout on 16 + 64 GB200s. 107.8B parameters with float32 master weights,
           AdamW moments and gradient accumulators are 2.2 TB: that is 16 GB200s (186 GiB each) but
           not 16 or 32 v5p chips (95 GiB), hence 64 trainer chips.
Batch:     the paper's: 48 prompts x 16 samples = 768 sequences of 2,048 prompt + 14,336 generated
           tokens per step (forced interruption at U[10,240, 12,224] thinking tokens, 2,048 answer
           tokens), one update per step over 12 microbatches of 64 sequences (one per chip).
Model:     bfloat16 body, float32 master weights and moments, float32 LM head, per-layer remat,
           attention over blocks of 1,024 queries, log-probs over blocks of 2,048 positions,
           dropless MoE (sort + ragged_dot grouped matmuls; each chip exchanges its tokens in 4 chunks
           of 4,096, which bounds the worst-case receive buffers: 73.5 GiB per chip, 97.5 in one
           exchange), router load-balancing loss 0.001.
Optimizer: AdamW, constant lr 5e-7 after 100 warm-up steps, eps 1e-15, weight decay 0.01, no KL.
Expected:  dry run fits (per-chip HBM under 95 GiB for the train, decode and prefill steps). A real
           run: held-out mean@16 rising along the paper's Scout curve (A ~0.71, B ~1.65, C_mid ~4.2k
           GB200-hours; Table 1).
Reductions: none in shapes. Llama-4's chunked attention is a mask here: RoPE layers still compute
           scores over the whole sequence.
Rollouts:  PipelineRL-8 on 8 engine replicas of 8 chips: the commands of configs/dense_8b.py
           with --config=configs/scout_moe.py, one serve.py per 2 generator hosts (--num_devices=8 on
           a replica's first host; tensor parallel within the replica), 8 addresses in rollout.servers.
"""

import ml_collections

from configs import dense_8b


def get_config(arg=None):
    config = dense_8b.get_config(arg)
    config.model = ml_collections.ConfigDict(dict(
        preset="scout", dtype="bfloat16", param_dtype="float32", remat=True, attn_query_chunk=1024,
        moe_impl="expert_parallel",  # tokens travel to their experts over mesh.expert (policy/moe.py)
        moe_token_chunk=4096,  # 4 exchanges per layer and microbatch: bounds the dropless receive buffers
        router_aux_loss_coef=0.001,  # Switch load balancing, coef * E * sum_e f_e * P_e, mean over layers
        # the dry run's train (r3), decode and prefill steps on v5p:4x4x4 log no indivisible shape
        # (2026-12-05); "error" stops a changed config whose shapes would gather the experts
        moe_indivisible="warn",
    ))
    # r3: the trainer replays the experts the generator chose for each token (the JetStream engines
    # record them; ~12.6 MB per group of 16 x 16,384 tokens on the wire, one byte per expert id), so
    # the generator/trainer mismatch is not amplified by routing flips. The train step's dry run with
    # it: 73.6 GiB per chip of 95 (--dry_run --dry_run_steps=train, 2026-12-05).
    config.rl.routing_replay = "r3"
    config.rl.grad_accum = 12
    config.rollout.engine_slots = 128
    config.rollout.push_dtype = "bfloat16"  # 216 GB a version instead of 431 GB, the LM head float32
    config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, expert=16))
    config.tpu = ml_collections.ConfigDict(dict(
        train_topology="v5p:4x4x4", gen_topology="v5p:4x4x4",
        gen_mesh=dict(data=8, fsdp=1, tensor=8, expert=1), hbm_gib=0.0,
    ))
    return config
