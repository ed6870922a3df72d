"""The RL loop, top to bottom.

  prompts (grain) -> sample G completions per prompt (KV-cache sampler, float32 log-probs)
  -> rewards (task verifier) -> rl_step (advantages, zero-variance filter, CISPO,
  prompt-level aggregation, AdamW) -> metrics (TensorBoard + metrics.jsonl, against
  compute) -> held-out eval every `eval_every` -> Orbax checkpoint (state, data
  iterator, counters) -> `launch/fit.py` fits the sigmoid law to metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_scaling import checkpoint, compute, config as config_lib, data, distributed, evaluate, lock as lock_lib, metrics as metrics_lib, paths, preemption, sharding, tasks
from rl_scaling.policy import hf_io
from rl_scaling.rl import filters, train_step as ts
from rl_scaling.rollout import collect, length_control, pipeline, topology

log = logging.getLogger(__name__)


def prepare_workdir(workdir: str) -> str:
    """The resolved workdir (absolute, or a gs:// URL), checked writable with one probe file
    (named per host and process: a job's processes all probe the same workdir at once)."""
    workdir = paths.resolve(workdir)  # an unsupported URL scheme is an error here, not a local folder
    try:
        paths.makedirs(workdir)
        probe = paths.join(workdir, f".write_test-{socket.gethostname()}-{os.getpid()}")
        paths.write_text(probe, "ok")
        paths.remove(probe)
    except Exception as e:  # noqa: BLE001 - OSError locally; client/network errors on gs://
        raise ValueError(f"--workdir={workdir} is not writable: {type(e).__name__}: {e}") from e
    return workdir


def train(config, workdir: str) -> dict:
    """Train into `workdir`, resuming from its newest usable checkpoint. Process 0 holds the
    workdir's lock (lock.py) for the whole run; SIGTERM/SIGINT save the current step and raise
    preemption.Preempted (preemption.py)."""
    config_lib.validate(config)
    topology.check_config(config)
    paths.configure_storage(config.storage)  # deadlines on every gs:// call from here on
    workdir = prepare_workdir(workdir)
    held = lock_lib.acquire(workdir) if jax.process_index() == 0 else None  # before anything is written
    preempt = preemption.Preemption(config.preemption_grace_s)
    try:
        return _train(config, workdir, held, preempt)
    finally:
        preempt.uninstall()
        if held is not None:
            held.release()


def _train(config, workdir, held, preempt):
    if jax.process_index() == 0:
        paths.write_text(paths.join(workdir, "config.json"), json.dumps(config.to_dict(), indent=1))
    mesh = sharding.make_mesh(dict(config.mesh), topology.trainer_devices(config))  # all but an embedded engine's own
    task = tasks.make_task(config.task, config.seed)
    train_cfg, gen_cfg = _model_configs(config, task)
    optimizer = ts.make_optimizer(config.optim)
    state_sh = ts.state_shardings(train_cfg, optimizer, mesh)
    ckpts = checkpoint.Checkpoints(paths.join(workdir, "checkpoints"), keep=config.keep_checkpoints)
    base_rng = jax.random.key(config.seed)
    P, G = config.rollout.prompts_per_step, config.rollout.samples_per_prompt
    gen_kw = _generation_kwargs(config)
    run_eval = _evaluator(config, gen_cfg, task, gen_kw)

    step, state, meta, restored = _start_state(config, task, train_cfg, gen_cfg, optimizer, state_sh, mesh, ckpts,
                                                workdir, base_rng, gen_kw)
    length = length_control.LengthControl(config, task.tokenizer)  # forced interruption / overlong penalty
    npr, stream = _prompt_stream(config, task, meta)
    writer = metrics_lib.MetricsWriter(workdir, resume_step=step if restored else None,
                                       resume_flops=meta["compute_flops"])
    progress = metrics_lib.Progress(config.steps, step)
    # MoE routing replay: r3 needs the generator's record (the sync sampler's, or the JetStream
    # engines' in pipeline mode: topology.routing_shape)
    replay = ts.replay_mode(config.rl, train_cfg)
    rl_step = ts.jit_step(ts.rl_step, state_sh, mesh, batch_keys=ts.rl_batch_keys(config.rl, train_cfg),
                          model_cfg=train_cfg, rl_cfg=config.rl, optimizer=optimizer,
                          prompt_len=config.task.max_prompt_len)  # collect.rl_batch's prompt columns
    n_devices = jax.device_count()
    counters = {k: meta[k] for k in ("compute_flops", "accel_seconds", "samples")}

    if step == 0:
        ev = run_eval(state["params"], 0)
        writer.write(0, {**counters, **_eval_metrics(ev)})
        progress.print(0, {"eval/pass_rate": ev["pass_rate"]})

    rollouts = None  # PipelineRL-k: rollouts generated in the background by a JetStream engine
    if config.rollout.mode == "pipeline":
        rollouts = _start_pipeline(config, task, stream, gen_cfg, state["params"], step, meta if restored else None,
                                   workdir, preempt)
        n_devices += rollouts.devices  # a remote rollout server's accelerators count as compute
    pending = None  # metrics are read one step late so the host never waits on the device
    compile_clock = compute.CompileClock()
    last_eval = {}
    def save_checkpoint():  # this step's state, data position, counters and pipeline, with its logs flushed
        nonlocal pending
        if pending is not None:
            writer.write(*_drain(pending))
            pending = None
        writer.flush()  # TensorBoard then holds every step the checkpoint holds
        meta = {"data": stream.get_state(), **counters, **({"npr": npr.state()} if npr else {}),
                **({"pipeline": rollouts.resume_state()} if rollouts is not None else {})}
        ckpts.save(step, state, meta)

    preempt.install()  # from here a signal saves the step it interrupts
    while step < config.steps:
        step += 1
        t0 = time.time()
        if rollouts is None:
            ro = _sync_rollouts(state["params"], jax.random.fold_in(base_rng, step), config, gen_cfg, task, stream,
                                length, record_routing=replay == "r3", **gen_kw)
        else:  # P whole prompt groups, at most rollout.max_staleness policy versions old
            try:
                ro = _pipeline_rollouts(rollouts.next_batch(), length)
            except pipeline.WaitInterrupted as e:  # preempted while waiting: save the last finished step
                step -= 1
                log.warning("%s: saving step %d", e, step)
                save_checkpoint()
                break
        state, step_metrics = _rl_update(rl_step, state, ro, mesh, config)
        if rollouts is not None:  # new weights reach the generator now; sequences in flight continue
            rollouts.push_weights(state["params"], step)
        if npr is not None:  # No-Positive-Resampling: prompts that reached the threshold leave the stream
            ro.metrics.update(npr.update(ro.prompt_tokens[::G], ro.prompt_mask[::G], ro.correct.reshape(P, G)))
        counters["compute_flops"] += _step_flops(train_cfg, ro, G)
        counters["samples"] += len(ro.generated[1])
        # The step ends when its update has run: without this wait the update's device time fell into
        # whichever window next blocked on it, so accel_seconds depended on log_every.
        jax.block_until_ready(state["params"])
        counters["accel_seconds"] += max(time.time() - t0 - compile_clock.take(), 0.0) * n_devices
        if pending is not None:
            writer.write(*_drain(pending))
        pending = (step, step_metrics, {**_rollout_summary(ro), **counters})

        is_eval = step % config.eval_every == 0 or step == config.steps
        is_checkpoint = step % config.checkpoint_every == 0 or step == config.steps
        if is_eval or is_checkpoint or step % config.log_every == 0:
            writer.write(*_drain(pending))  # raises on a NaN loss before anything is saved
            pending = None
        if is_eval:
            last_eval = run_eval(state["params"], step)
            writer.write(step, {**counters, **_eval_metrics(last_eval)})
            writer.flush()
        if is_eval or step % config.log_every == 0:
            progress.print(step, {**({"eval/pass_rate": last_eval["pass_rate"]} if is_eval else {}),
                                  "reward_mean": float(ro.rewards.mean())})
        stop = preempt.agreed()  # a signal: every process saves this step and stops
        if is_checkpoint or stop:
            save_checkpoint()
        if held is not None:
            held.refresh()
        if stop:
            break
    if pending is not None:
        writer.write(*_drain(pending))
    if rollouts is not None:
        rollouts.close()
    ckpts.close()
    writer.close()
    if preempt.signum is not None:
        raise preemption.Preempted(step, preempt.signum)
    return {"step": step, **counters, **_eval_metrics(last_eval)}


def _model_configs(config, task):
    """The trainer's and the generator's ModelConfig: one policy, each side with its own LM-head dtype."""
    train_cfg = config_lib.model_config(config, config.rl.fp32_lm_head)
    if train_cfg.vocab_size < task.tokenizer.vocab_size:  # a preset's vocab_size is not in config.model
        raise ValueError(f"config.model.vocab_size={train_cfg.vocab_size} is smaller than the tokenizer's "
                         f"{task.tokenizer.vocab_size}")
    return train_cfg, config_lib.model_config(config, config.rollout.fp32_lm_head)


def _generation_kwargs(config):
    """The sampler's settings shared by rollouts, the warm start's probe and the held-out eval."""
    return dict(max_prompt_len=config.task.max_prompt_len, max_new_tokens=config.rollout.max_new_tokens,
                temperature=config.rollout.temperature, cache_segments=config.rollout.cache_segments)


def _evaluator(config, gen_cfg, task, gen_kw):
    """run_eval(params, step) -> the held-out pass rates; its sampling key depends on the step only,
    so a resumed run evaluates a step exactly as an uninterrupted one."""
    problems = task.eval_problems(config.eval.num_prompts)
    eval_rng = jax.random.key(config.seed + 1)

    def run_eval(params, step):
        return evaluate.pass_rate(params, gen_cfg, task, problems, samples_per_prompt=config.eval.samples_per_prompt,
                                  batch_size=config.eval.batch_size, rng=jax.random.fold_in(eval_rng, step), **gen_kw)
    return run_eval


def _eval_metrics(ev):
    return {f"eval/{k}": v for k, v in ev.items()}


def _rl_update(rl_step, state, ro, mesh, config):
    """One optimizer step on a step's rollouts: (new state, device-side metrics)."""
    G = config.rollout.samples_per_prompt
    batch = collect.rl_batch(ro.prompt_tokens, ro.prompt_mask, ro.out, ro.rewards, config.rollout.prompts_per_step, G)
    ts.check_group_prompts(batch, G, config.task.max_prompt_len)  # rl_step runs each group's prompt once
    batch = distributed.global_batch(batch, mesh)  # several hosts: each feeds its own rows
    return rl_step(state, batch)


def _drain(pending):
    step, device_metrics, host = pending
    return step, {**jax.device_get(device_metrics), **host}


def _start_state(config, task, train_cfg, gen_cfg, optimizer, state_sh, mesh, ckpts, workdir, base_rng, gen_kw):
    """(step, state, checkpoint meta, restored): the newest usable checkpoint, else step 0 from
    config.init_checkpoint or a supervised warm start (initial_params)."""
    abstract = jax.eval_shape(lambda: ts.init_state(train_cfg, optimizer, base_rng, mesh, state_sh))
    abstract = checkpoint.abstract_like(abstract, state_sh)
    restored = ckpts.restore_latest(abstract)
    if restored is not None:
        step, state, meta = restored
        log.info("resumed from %s at step %d", ckpts.directory, step)
        return step, state, meta, True
    params = initial_params(config, task, train_cfg, gen_cfg, mesh, workdir, abstract["params"], gen_kw)
    state = {"params": params, "opt_state": jax.jit(optimizer.init, out_shardings=state_sh["opt_state"])(params),
             "step": jnp.zeros((), jnp.int32)}
    return 0, state, {"data": None, "compute_flops": 0.0, "accel_seconds": 0.0, "samples": 0}, False


def _prompt_stream(config, task, meta):
    """(No-Positive-Resampling filter or None, the training prompt stream), both at the checkpoint's
    position when `meta` comes from one."""
    npr = filters.NoPositiveResampling(task.tokenizer, config.rl.npr_threshold) if config.rl.no_positive_resampling else None
    if npr is not None and meta.get("npr"):
        npr.load(meta["npr"])  # before the iterator state: the stream's filter reads it
    stream = data.prompt_stream(task, config.seed, config.rollout.prompts_per_step, keep=npr.keep if npr else None)
    if meta["data"] is not None:
        # pipeline mode: replay from before the groups in flight at the checkpoint (regenerated)
        stream.set_state(meta["pipeline"]["stream"] if config.rollout.mode == "pipeline" and meta.get("pipeline")
                         else meta["data"])
    return npr, stream


def _sync_rollouts(params, rng, config, gen_cfg, task, stream, length, *, record_routing, **gen_kw):
    """This step's P prompt groups, generated now by the policy being trained (timed alone)."""
    jax.block_until_ready(params)  # the sampler waits for them anyway; time generation alone
    t_gen = time.time()
    ro = collect.sync_rollouts(params, gen_cfg, task, stream, config.rollout.prompts_per_step,
                               config.rollout.samples_per_prompt, rng, length=length,
                               dynamic_rounds=config.rollout.dynamic_sampling and config.rollout.dynamic_sampling_rounds,
                               record_routing=record_routing, **gen_kw)
    return ro._replace(metrics={"time/rollout_s": time.time() - t_gen, **ro.metrics})


def _pipeline_rollouts(rb, length):
    """A pipeline batch (pipeline.StepData) as a step's rollouts: rewards shaped by length control."""
    correct = (rb.rewards > 0).astype(np.float32)
    return collect.StepRollouts(rb.prompt_tokens, rb.prompt_mask, rb.out, length.shape_rewards(rb.rewards, rb.out.lengths_B),
                                correct, None, dict(rb.metrics), (rb.prompt_mask.sum(1), rb.out.lengths_B), rb.dropped)


def _start_pipeline(config, task, stream, gen_cfg, params, step, meta, workdir, preempt):
    """The background generator (topology.from_config), resumed from a checkpoint's `meta` if given."""
    ledger = paths.join(workdir, "rollout_ledger", f"from_step{step}") if config.rollout.get("ledger") else ""
    rollouts = topology.from_config(config, task, stream, gen_cfg, params, step,
                                    resume=meta.get("pipeline") if meta else None, ledger=ledger)
    if isinstance(rollouts, pipeline.Pipeline) and jax.process_count() == 1:  # a signal ends any wait
        rollouts.interrupted = lambda: preempt.signum is not None
    return rollouts


def _rollout_summary(ro):
    """A step's rollout scalars for the metrics writer."""
    return {"truncation_rate": float(ro.out.truncated_B.mean()), "interruption_rate": float(ro.out.interrupted_B.mean()),
            "response_len": float(ro.out.lengths_B.mean()), "pass_rate_train": float(ro.correct.mean()), **ro.metrics}


def _step_flops(train_cfg, ro, G):
    """A step's compute: generating every sequence sampled (a group's prompt prefilled once;
    dynamic sampling's set-aside groups and the pipeline's dropped stale groups were generated
    too) plus one training pass over the batch (k minibatches split it)."""
    gen_flops = sum(compute.sequence_flops(train_cfg, *lens, group_size=G)[0] for lens in (ro.generated, ro.dropped)
                    if len(lens[0]))
    _, train_flops = compute.sequence_flops(train_cfg, ro.prompt_mask.sum(1), ro.out.lengths_B)
    return gen_flops + train_flops


def initial_params(config, task, train_cfg, gen_cfg, mesh, workdir, abstract, gen_kw):
    """Params to start RL from: config.init_checkpoint (an Orbax params checkpoint or a Hugging
    Face safetensors directory), a saved warm start, or a new one."""
    if config.init_checkpoint:
        return load_start_params(config.init_checkpoint, train_cfg, mesh, abstract)
    path = paths.join(workdir, "warmstart", "params")
    if paths.isdir(path):
        log.info("reusing the warm start in %s", path)
        return checkpoint.load_params(path, abstract)
    params = warm_start(config, task, train_cfg, gen_cfg, mesh, gen_kw)
    checkpoint.save_params(path, params)
    return params


def load_start_params(path, model_cfg, mesh, abstract):
    """An Orbax params checkpoint, or a Hugging Face safetensors directory whose config.json
    must match `model_cfg`, loaded straight into the shardings of `abstract`."""
    if paths.isdir(path) and hf_io.is_hf_checkpoint(path):
        hf_io.check_architecture(path, model_cfg)
        log.info("loading Hugging Face weights from %s", path)
        return hf_io.load_hf_checkpoint(path, model_cfg, mesh)
    return checkpoint.load_params(path, abstract)


def warm_start(config, task, train_cfg, gen_cfg, mesh, gen_kw):
    """Supervised fine-tuning on reference solutions until the sampled pass rate on a
    probe set of training problems reaches `warmstart.target_pass_rate` (RL from a
    random init gets no reward)."""
    ws = config.warmstart
    opt_cfg = config.optim.copy_and_resolve_references()
    opt_cfg.lr, opt_cfg.warmup_steps = ws.lr, 10
    optimizer = ts.make_optimizer(opt_cfg)
    state_sh = ts.state_shardings(train_cfg, optimizer, mesh)
    state = ts.init_state(train_cfg, optimizer, jax.random.key(config.seed), mesh, state_sh)
    step_fn = ts.jit_step(ts.sft_step, state_sh, mesh, ts.SFT_BATCH_KEYS, model_cfg=train_cfg, optimizer=optimizer)
    tok = task.tokenizer
    offset = 2 * data.TRAIN_POOL  # indices the RL stream never uses
    probe = [task.train_problem(offset + i) for i in range(ws.probe_prompts)]
    rate, t0 = 0.0, time.time()
    log.info("warm start: until the probe pass rate reaches %.2f (at most %d steps)", ws.target_pass_rate, ws.max_steps)
    for s in range(ws.max_steps):
        problems = [task.train_problem(offset + ws.probe_prompts + s * ws.batch_size + i) for i in range(ws.batch_size)]
        prompt, prompt_mask = data.encode_prompts(tok, [p.prompt for p in problems], config.task.max_prompt_len)
        comp, comp_mask = data.encode_completions(tok, [task.reference_completion(p) for p in problems],
                                                  config.rollout.max_new_tokens)
        tokens, token_mask = data.pack_sequences(prompt, prompt_mask, comp, comp_mask)
        loss_mask = np.concatenate([np.zeros_like(prompt_mask), comp_mask], axis=1).astype(np.float32)
        sft_batch = distributed.global_batch({"tokens": tokens, "token_mask": token_mask, "loss_mask": loss_mask}, mesh)
        state, m = step_fn(state, sft_batch)
        if (s + 1) % ws.eval_every == 0:
            rate = evaluate.pass_rate(state["params"], gen_cfg, task, probe, samples_per_prompt=2,
                                      batch_size=config.eval.batch_size, rng=jax.random.key(s), **gen_kw)["pass_rate"]
            left = (time.time() - t0) / (s + 1) * (ws.max_steps - s - 1)
            log.info("warm start step %d/%d: loss %.3f, probe pass rate %.3f (target %.2f), at most ~%.1f min left",
                     s + 1, ws.max_steps, float(m["loss"]), rate, ws.target_pass_rate, left / 60)
            if rate >= ws.target_pass_rate:
                break
    return state["params"]
