"""Which rollout pipeline a run's config asks for, and on which devices.

`from_config` builds it: an engine embedded in the trainer's process (pipeline.EmbeddedBackend, on
the trainer's first device or on rollout.engine_devices of its own) or a client of the
`launch/serve.py` replicas at rollout.servers (serving.client.RemoteBackend); with several trainer
processes, process 0 drives it and broadcasts each batch (serving.multihost.BroadcastPipeline).
`make_engine` builds a replica's or the embedded engine on the generator mesh config.tpu.gen_mesh
describes. `trainer_devices` / `engine_devices` split jax.devices() between them.
"""

from __future__ import annotations

import logging

import jax

from rl_scaling.rollout.pipeline import STALE_POLICIES, EmbeddedBackend, Pipeline

log = logging.getLogger(__name__)

MODES = ("sync", "pipeline")


def check_config(config) -> None:
    rc = config.rollout
    if rc.mode not in MODES:
        raise ValueError(f"config.rollout.mode={rc.mode!r} is not valid; choose one of {MODES}")
    if rc.stale_policy not in STALE_POLICIES:
        raise ValueError(f"config.rollout.stale_policy={rc.stale_policy!r} is not valid; choose one of {STALE_POLICIES}")
    for name in ("max_staleness", "queue_size", "engine_slots", "engine_devices"):
        if rc[name] < 0:
            raise ValueError(f"config.rollout.{name} must be >= 0, got {rc[name]}")
    from rl_scaling.serving import wire

    wire.check_push_dtype(rc.get("push_dtype", ""))


def _embedded_split(config) -> int:
    rc = config.rollout
    return rc.engine_devices if rc.mode == "pipeline" and not (rc.server or rc.get("servers", "")) else 0


def trainer_devices(config):
    """The devices the trainer's mesh spans: all, less those an embedded engine has to itself."""
    devices, n = jax.devices(), _embedded_split(config)
    if n and n >= len(devices):
        raise ValueError(f"config.rollout.engine_devices={n} leaves no device for the trainer "
                         f"({len(devices)} devices; on CPU raise --xla_force_host_platform_device_count)")
    return devices[: len(devices) - n]


def engine_devices(config):
    """The embedded engine's devices: its own (the last engine_devices), or the trainer's first."""
    n = _embedded_split(config)
    return jax.devices()[len(jax.devices()) - n:] if n else jax.devices()[:1]


def routing_shape(config, gen_cfg) -> tuple | None:
    """(n_layers, k) of the experts each token carries from the generators: under
    rl.routing_replay="r3" with an MoE policy, else None."""
    if config.rl.get("routing_replay", "off") != "r3" or not gen_cfg.num_experts:
        return None
    return (gen_cfg.n_layers, gen_cfg.num_experts_per_tok)


def servers_of(config) -> list[str]:
    """The replica addresses: rollout.servers ('HOST:PORT,HOST:PORT,...'), or the one rollout.server."""
    from rl_scaling.serving import client

    rc = config.rollout
    return client.parse_servers(rc.get("servers", "") or rc.server)


def from_config(config, task, stream, gen_cfg, params, version: int, *, resume: dict | None = None,
                ledger: str = ""):
    """The pipeline a run's config asks for, with `params` pushed as `version`: an embedded
    engine, or a client of the `launch/serve.py` replicas at config.rollout.servers. With several
    trainer processes, process 0 drives it and broadcasts each batch (multihost.BroadcastPipeline).
    `resume`: a checkpoint's resume_state(); the stream must already be at resume["stream"]."""
    check_config(config)
    rc = config.rollout
    P, G = rc.prompts_per_step, rc.samples_per_prompt
    servers = servers_of(config)
    routing = routing_shape(config, gen_cfg)
    if jax.process_count() > 1 and not servers:
        raise ValueError("config.rollout.mode='pipeline' with several trainer processes needs engine replicas of their "
                         "own (config.rollout.servers=HOST:PORT,...): an embedded engine would run once per host")
    pipe = None
    if jax.process_index() == 0:
        if servers:
            from rl_scaling.serving import client, wire

            backend = client.RemoteBackend(servers, expected=wire.fingerprint(config), reconnect_s=rc.reconnect_s,
                                           token=wire.load_token(rc.get("token_file", "")),
                                           weights_dir=rc.get("weights_dir", ""), push_dtype=rc.get("push_dtype", ""),
                                           fp32_lm_head=rc.fp32_lm_head, tie_embeddings=gen_cfg.tie_embeddings,
                                           routing=routing and routing + (gen_cfg.num_experts,))
        else:
            engine, holder = make_engine(config, gen_cfg, task.tokenizer, engine_devices(config))
            backend = EmbeddedBackend(engine, holder)
        pipe = Pipeline(backend, task, stream, prompts_per_step=P, samples_per_prompt=G,
                        max_prompt_len=config.task.max_prompt_len, max_new_tokens=rc.max_new_tokens,
                        max_staleness=rc.max_staleness, stale_policy=rc.stale_policy, queue_size=rc.queue_size,
                        skip_prompts=(resume or {}).get("skip"), routing_shape=routing)
    if jax.process_count() > 1 or ledger:
        from rl_scaling.serving import multihost

        pipe = multihost.BroadcastPipeline(pipe, task.tokenizer, G, ledger=ledger, weights_dir=rc.get("weights_dir", ""),
                                           push_dtype=rc.get("push_dtype", ""), fp32_lm_head=rc.fp32_lm_head,
                                           tie_embeddings=gen_cfg.tie_embeddings)
    try:
        pipe.push_weights(params, version)
    except BaseException:
        pipe.close()
        raise
    return pipe


def make_engine(config, gen_cfg, tokenizer, devices):
    """A PolicyEngine over `devices` on the generator mesh config.tpu.gen_mesh describes
    (engine.generator_mesh: what the dry run compiles generation on), and its weight holder. It
    records each token's experts under rl.routing_replay="r3" (MoE)."""
    from rl_scaling.rollout import engine as engine_lib
    from rl_scaling.rollout import length_control

    rc = config.rollout
    mesh = engine_lib.generator_mesh(config.tpu.gen_mesh, devices)
    slots = rc.engine_slots or rc.prompts_per_step * rc.samples_per_prompt
    length = length_control.LengthControl(config, tokenizer)
    interrupt = None
    if length.mode == "interrupt":  # ScaleRL's forced interruption, in the engine
        interrupt = engine_lib.Interrupt(length.phrase, length.lo, length.hi, length.answer_budget, tokenizer.think_end_id)
    engine = engine_lib.PolicyEngine(gen_cfg, mesh, slots=slots, max_prefill_length=config.task.max_prompt_len,
                                     max_new_tokens=rc.max_new_tokens, temperature=rc.temperature,
                                     stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id,
                                     seed=config.seed + 7919, tokenizer=tokenizer, interrupt=interrupt,
                                     record_routing=routing_shape(config, gen_cfg) is not None)
    log.info("rollout engine: %s", engine.layout.describe())
    return engine, engine.load_params()
