"""JetStream `engine_api.Engine` for the Flax policy.

Engine (the JetStream 0.2.2 API, one KV-cache row per slot):
  prefill(params=holder, padded_tokens[Pb], true_length) -> Prefix    one prompt
  insert(prefix, decode_state, slot) -> decode_state                    copy its row in
  generate(holder, decode_state) -> (decode_state, ResultTokens)        one token per slot

Prefill writes the KV cache of all prompt tokens but the last; that last token is
fed by the first `generate` of the slot. So every sampled token, the first included,
comes from one forward pass with one set of weights, and its log-prob (float32
logits, after temperature) and the version of those weights are exact.
`ResultTokens.data` has one row per slot and the columns
  token | valid | length | logprob (float32 bits) | policy version | done (1 length, 2 stop) | forced
  [| the fed token's experts, n_layers x k, with record_routing]
(the stock orchestrator reads only the first three; the rest ride along).

Routing (MoE routing replay, rl.routing_replay="r3"; `record_routing=True`): prefill returns the
experts of the prompt tokens it feeds (`prefix["routing"]`, [max_prefill_length, n_layers, k]) and
each generate step those of the token it feeds (the prompt's last token, then each sampled token
in turn), so the generator (generator.py) can give every token's experts per layer in the sync
sampler's layout (sampler.Samples.routing_BSLK).

Layout: `generator_mesh` and `generator_layout` are the one definition of where the generator's
weights and KV cache live: the mesh `config.tpu.gen_mesh` asks for over the engine's devices, and
the shardings of its split params, cache and per-slot rows on it. The engine (in process,
`launch/serve.py`, every replica) and `rl_scaling/dry_run.py` both call them.

Forced interruption (ScaleRL's length control, as rollout/sampler.py does it): with
`interrupt=Interrupt(phrase, lo, hi, answer_budget, think_end_id)`, `insert` draws each
slot's thinking budget uniformly from [lo, hi]; a slot still thinking at its budget gets
the phrase injected one token per step (marked `forced`, log-prob 0, never trained on),
then `answer_budget` sampled tokens to answer.

Weights: `params` passed to prefill/generate may be a `WeightHolder`; the engine reads
it on every call, so `holder.set(new_params, version)` swaps the weights between two
generate steps while sequences are in flight (they keep their KV cache). Same shapes
and shardings -> no recompilation.

The loop that drives the engine is `generator.Generator`.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from rl_scaling import sharding
from rl_scaling.policy import model as model_lib
from rl_scaling.policy import moe
from rl_scaling.rollout import sampler
from rl_scaling.rollout.jetstream_compat import engine_api, tokenizer_api, tokenizer_pb2

log = logging.getLogger(__name__)

COLUMNS = ("token", "valid", "length", "logprob", "version", "done", "forced")


class WeightHolder:
    """The engine's current weights and their policy version, swapped atomically.

    `set` copies (and reshards) the given params onto the engine's shardings, so the
    caller may donate or overwrite its own arrays right after."""

    def __init__(self, shardings=None, copy_fn=None):
        self.shardings = shardings
        # device_put may hand back the trainer's own buffer (a replicated leaf onto one of its
        # devices) even with may_alias=False; a jitted copy never aliases a non-donated input.
        self._copy = copy_fn or jax.jit(_copy_tree, out_shardings=shardings)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._params, self._version = None, -1

    def set(self, params, version: int) -> None:
        placed = self._copy(jax.device_put(params, self.shardings)) if self.shardings is not None else params
        jax.block_until_ready(placed)  # the trainer donates its copy on the next step
        with self._changed:
            if version < self._version:  # refused, not warned about: a new trainer calls restart() first
                raise ValueError(f"weight version {version} is older than the engine's {self._version}")
            self._params, self._version = placed, int(version)
            self._changed.notify_all()

    def restart(self) -> None:
        """A new trainer session: its versions start afresh. The old weights stay for sequences still
        in flight (their results are discarded), but no new group starts before the new push."""
        with self._changed:
            self._version = -1

    def get(self):
        with self._lock:
            if self._params is None:
                raise RuntimeError("no weights have been pushed to the rollout engine yet")
            return self._params, self._version

    @property
    def version(self) -> int:
        with self._lock:
            return self._version


_JITTED: dict = {}


def _copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


def param_shardings(cfg: model_lib.ModelConfig, mesh):
    boxed = jax.eval_shape(functools.partial(model_lib.init_params, cfg), jax.random.key(0))
    return sharding.tree_shardings(mesh, nn.get_partition_spec(boxed))


def cache_shardings(cfg: model_lib.ModelConfig, mesh):
    """Shardings of `model_lib.init_cache`: rows over the data axes, one K and one V buffer per layer."""
    ls = functools.partial(sharding.logical_sharding, mesh)
    kv = (ls(("batch", "kv_heads", "cache_length", "head_dim")),) * cfg.n_layers
    return {"k": kv, "v": kv, "valid": ls(("batch", "cache_length")), "pos": ls(("batch", "cache_length")),
            "index": ls(("batch",))}


def split_param_shardings(cfg: model_lib.ModelConfig, mesh):
    """Shardings of `model_lib.split_layers(params)`: each layer's tree without the layer axis."""
    stacked = param_shardings(cfg, mesh)
    layer = jax.tree.map(lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:])),
                         stacked["layers"])
    return {**stacked, "layers": (layer,) * cfg.n_layers}


GEN_MESH_FIELD = "config.tpu.gen_mesh"


def generator_mesh(gen_mesh, devices) -> jax.sharding.Mesh:
    """One engine's mesh over `devices`, as config.tpu.gen_mesh lays out a generator replica: its
    fsdp, tensor and expert sizes as given, `data` the replicas these devices hold (gen_mesh's
    `data` counts the replicas over the whole generator slice, as the dry run compiles it; one
    `launch/serve.py` on one replica's chips gets data=1). A ValueError names the field when the
    devices do not fit the layout."""
    shape = {a: int(dict(gen_mesh).get(a, 1)) for a in sharding.MESH_AXES}
    others = [shape[a] for a in sharding.MESH_AXES if a != "data"]
    shape["data"] = 1 if -1 in others else -1
    devices = list(devices)
    try:
        return sharding.make_mesh(shape, devices)
    except ValueError as e:
        per_replica = {a: v for a, v in shape.items() if a != "data"}
        raise ValueError(f"{GEN_MESH_FIELD}={dict(gen_mesh)}: a generator replica is {per_replica}, which "
                         f"{len(devices)} engine device(s) cannot hold ({e}); give the engine a multiple of that many "
                         "devices (rollout.engine_devices, or launch/serve.py --num_devices) or change "
                         f"{GEN_MESH_FIELD}") from None


class GenLayout(NamedTuple):
    """Where a generator's arrays live on its mesh (`generator_layout`)."""

    mesh: jax.sharding.Mesh
    params: dict  # the stacked params as pushed (init_params' tree)
    split_params: dict  # model_lib.split_layers(params), the tree the decode step reads
    cache: dict  # model_lib.init_cache's tree
    rows: jax.sharding.NamedSharding  # one entry per slot (or prompt): over the data axes
    replicated: jax.sharding.NamedSharding

    def describe(self) -> str:
        """One line: the mesh, which axes split the weights and the cache, what a decode step gathers."""
        shape = dict(self.mesh.shape)

        def axes(tree):
            used = set()
            for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding)):
                for entry in s.spec:
                    used.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
            return [a for a in sharding.MESH_AXES if a in used and shape[a] > 1]

        w = axes(self.split_params)
        gathered = [a for a in w if a in ("fsdp", "expert")]  # the batch is split over them too
        moves = (f"every decode step gathers weights over {'/'.join(gathered)}" if gathered
                 else "no weight moves while decoding")
        return (f"mesh {shape} on {self.mesh.devices.size} devices; weights split over "
                f"{'/'.join(w) or 'nothing (replicated)'} ({moves}); KV cache split over "
                f"{'/'.join(axes(self.cache)) or 'nothing (replicated)'}")


def generator_layout(cfg: model_lib.ModelConfig, mesh) -> GenLayout:
    """The shardings the engine holds its weights, KV cache and slot rows in on `mesh`, and the
    ones the dry run compiles generation with (one definition for both)."""
    return GenLayout(mesh, param_shardings(cfg, mesh), split_param_shardings(cfg, mesh), cache_shardings(cfg, mesh),
                     sharding.batch_sharding(mesh, 1), sharding.replicated(mesh))


class _CharTokenizer(tokenizer_api.Tokenizer):
    """JetStream's tokenizer interface over the project's tokenizers (for the stock Driver)."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, s, **kwargs):
        ids = np.asarray(self.tok.encode(s), np.int32)
        from rl_scaling.rollout.jetstream_compat import token_utils

        return token_utils.pad_tokens(ids, self.bos_id, self.pad_id, is_bos=False,
                                      prefill_lengths=kwargs.get("prefill_lengths"),
                                      max_prefill_length=kwargs.get("max_prefill_length"),
                                      jax_padding=kwargs.get("jax_padding", True))

    def decode(self, token_ids, **kwargs):
        return self.tok.decode(token_ids)

    pad_id = property(lambda self: self.tok.pad_id)
    eos_id = property(lambda self: self.tok.eos_id)
    bos_id = property(lambda self: self.tok.bos_id)


class Interrupt(NamedTuple):
    phrase: tuple  # token ids injected when the thinking budget runs out (ends with </think>)
    lo: int  # thinking budget ~ U{lo..hi} generated tokens
    hi: int
    answer_budget: int  # sampled tokens allowed after the phrase
    think_end_id: int


class PolicyEngine(engine_api.Engine):
    def __init__(self, cfg: model_lib.ModelConfig, mesh, *, slots: int, max_prefill_length: int,
                 max_new_tokens: int, temperature: float = 1.0, stop_tokens=(), pad_id: int = 0,
                 seed: int = 0, tokenizer=None, interrupt: Interrupt | None = None, record_routing: bool = False):
        self.cfg, self._mesh, self.slots = cfg, mesh, int(slots)
        # MoE routing replay: each fed token's experts per layer ride along (prefix["routing"], extra columns)
        self.record_routing = bool(record_routing and cfg.num_experts)
        self._max_prefill_length, self.max_new_tokens = int(max_prefill_length), int(max_new_tokens)
        self.cache_length = self._max_prefill_length + self.max_new_tokens
        self.temperature, self.pad_id, self.seed = float(temperature), int(pad_id), int(seed)
        self.stop_tokens = tuple(int(t) for t in stop_tokens)
        self.tokenizer = tokenizer
        self.interrupt = Interrupt(tuple(int(t) for t in interrupt.phrase), *map(int, interrupt[1:])) if interrupt else None
        self.layout = generator_layout(cfg, mesh)
        self.param_shardings = self.layout.params
        row = self.layout.rows
        self.state_shardings = {"cache": self.layout.cache, "step": self.layout.replicated,
                                **{k: row for k in ("token", "pos_next", "active", "length", "budget", "think_ended",
                                                    "forced_left", "answer_left")}}
        # Engines with the same static settings share compiled functions (bench and tests
        # build several; a weight push never compiles anything).
        key = (cfg, mesh, self.slots, self._max_prefill_length, self.max_new_tokens, self.temperature, self.stop_tokens,
               self.interrupt, self.record_routing)
        if key not in _JITTED:
            rep = self.layout.replicated
            _JITTED[key] = (jax.jit(self._prefill_impl, out_shardings=rep),
                            jax.jit(self._insert_impl, out_shardings=self.state_shardings, donate_argnums=1),
                            jax.jit(self._generate_impl, out_shardings=(self.state_shardings, rep), donate_argnums=1),
                            # the engine keeps its weights split per layer, so a decode step never
                            # copies a layer's weights out of the stacks (model_lib.split_layers)
                            jax.jit(model_lib.split_layers, out_shardings=self.layout.split_params))
        self._prefill_fn, self._insert_fn, self._generate_fn, self._copy_fn = _JITTED[key]

    # ---- jitted bodies -------------------------------------------------------------
    @property
    def routing_shape(self) -> tuple | None:
        """(n_layers, k) of each token's recorded experts, or None when the engine records none."""
        return (self.cfg.n_layers, self.cfg.num_experts_per_tok) if self.record_routing else None

    def _apply(self, params, tokens_BT, *args):
        """(logits, cache, routing [B, T, n_layers, k] int32 or None)."""
        # the mesh: activation constraints and the MoE shard_map read it; decode_backend: the CPU decode
        # kernels where present (no params: one generate call is one step, a panel layout per step would cost more)
        with sharding.tracing_mesh(self._mesh), sampler.decode_backend(self.cfg):
            decoder = model_lib.Decoder(self.cfg)
            if not self.record_routing:
                return (*decoder.apply({"params": params}, tokens_BT, *args), None)
            (logits, cache), inter = decoder.apply({"params": params}, tokens_BT, *args, mutable="intermediates")
            return logits, cache, moe.routing_of(inter, *tokens_BT.shape).astype(jnp.int32)

    def _prefill_impl(self, params, tokens_1P, true_length):
        P = tokens_1P.shape[1]
        n = true_length - 1  # the last prompt token is fed by the first generate step
        mask_1P = (jnp.arange(P) < n)[None]
        cache = model_lib.init_cache(self.cfg, 1, self.cache_length)
        _, cache, routing_1PLK = self._apply(params, tokens_1P, jnp.arange(P)[None], mask_1P, cache)
        cache["index"] = jnp.full((1,), n, jnp.int32)
        prefix = {"cache": cache, "token": tokens_1P[0, n], "pos_next": n.astype(jnp.int32)}
        if routing_1PLK is not None:  # the experts of prompt tokens 0..n-1 (the rest: padding)
            prefix["routing"] = routing_1PLK[0]
        return prefix

    def _insert_impl(self, prefix, state, slot, seed):
        def put(dst, src, axis):
            return jax.lax.dynamic_update_slice_in_dim(dst, src.astype(dst.dtype), slot, axis)

        c, p = state["cache"], prefix["cache"]  # (prefix["routing"] stays with the prefix: the generator reads it)
        cache = {"k": tuple(put(a, b, 0) for a, b in zip(c["k"], p["k"])),
                 "v": tuple(put(a, b, 0) for a, b in zip(c["v"], p["v"])), "valid": put(c["valid"], p["valid"], 0),
                 "pos": put(c["pos"], p["pos"], 0), "index": put(c["index"], p["index"], 0)}
        if self.interrupt:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), state["step"]), slot + (1 << 20))
            budget = jax.random.randint(key, (), self.interrupt.lo, self.interrupt.hi + 1)
        else:
            budget = self.max_new_tokens + 1
        new = dict(state, cache=cache)
        for name, value in (("token", prefix["token"]), ("pos_next", prefix["pos_next"]), ("active", True),
                            ("length", 0), ("budget", budget), ("think_ended", False), ("forced_left", 0),
                            ("answer_left", -1)):
            new[name] = state[name].at[slot].set(value)
        return new

    def _generate_impl(self, params, state, version, seed):
        active_S = state["active"]
        logits_S1V, cache, routing_S1LK = self._apply(params, state["token"][:, None], state["pos_next"][:, None],
                                                      active_S[:, None], state["cache"])
        scaled_SV = logits_S1V[:, 0].astype(jnp.float32) / self.temperature
        key = jax.random.fold_in(jax.random.key(seed), state["step"])
        token_S = sampler.categorical(key, scaled_SV)
        forced_left, answer_left, think_ended = state["forced_left"], state["answer_left"], state["think_ended"]
        forcing_S = jnp.zeros_like(active_S)
        if self.interrupt:  # the same rules as sampler.sample, per slot (t = tokens this slot generated so far)
            it = self.interrupt
            phrase = jnp.asarray(it.phrase, jnp.int32)
            start = active_S & ~think_ended & (forced_left == 0) & (answer_left < 0) & (state["length"] >= state["budget"])
            forced_left = jnp.where(start, len(it.phrase), forced_left)
            forcing_S = active_S & (forced_left > 0)
            token_S = jnp.where(forcing_S, phrase[jnp.clip(len(it.phrase) - forced_left, 0, len(it.phrase) - 1)], token_S)
            forced_left = jnp.where(forcing_S, forced_left - 1, forced_left)
            interrupted_now = forcing_S & (forced_left == 0)
            answer_left = jnp.where(interrupted_now, it.answer_budget, answer_left)
            think_ended = think_ended | (active_S & (token_S == it.think_end_id))
        logp_S = jnp.take_along_axis(jax.nn.log_softmax(scaled_SV), token_S[:, None], axis=1)[:, 0]
        logp_S = jnp.where(forcing_S, 0.0, logp_S)
        length_S = state["length"] + active_S.astype(jnp.int32)
        stop_ids = jnp.asarray(self.stop_tokens or (-1,), jnp.int32)
        stopped_S = jnp.any(token_S[:, None] == stop_ids[None], axis=1) & ~forcing_S
        if self.interrupt:  # after an interruption the answer has its own budget of sampled tokens
            answering = (answer_left >= 0) & ~interrupted_now & active_S
            answer_left = jnp.where(answering, answer_left - 1, answer_left)
            stopped_S |= answering & (answer_left == 0)
            stopped_S |= interrupted_now & (self.interrupt.answer_budget == 0)
        done_S = active_S & (stopped_S | (length_S >= self.max_new_tokens))
        data = jnp.stack([token_S, active_S.astype(jnp.int32), length_S,
                          jax.lax.bitcast_convert_type(logp_S, jnp.int32),
                          jnp.broadcast_to(version, token_S.shape).astype(jnp.int32),
                          done_S.astype(jnp.int32) * (1 + (stopped_S & active_S).astype(jnp.int32)),
                          (forcing_S & active_S).astype(jnp.int32)], axis=1)
        if routing_S1LK is not None:  # the fed token's experts, n_layers x k more columns
            data = jnp.concatenate([data, routing_S1LK.reshape(routing_S1LK.shape[0], -1)], axis=1)
        new_state = {"cache": cache, "token": jnp.where(active_S, token_S, state["token"]),
                     "pos_next": state["pos_next"] + active_S.astype(jnp.int32), "active": active_S & ~done_S,
                     "length": length_S, "step": state["step"] + 1, "budget": state["budget"],
                     "think_ended": think_ended, "forced_left": forced_left, "answer_left": answer_left}
        return new_state, data

    # ---- engine_api.Engine -----------------------------------------------------------
    @staticmethod
    def _resolve(params):
        if isinstance(params, WeightHolder):
            return params.get()
        return params, 0

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
        if existing_prefix is not None:
            raise NotImplementedError("prefill on an existing prefix (multi-turn) is not supported")
        padded = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not 1 <= true_length <= padded.shape[0] or padded.shape[0] != self._max_prefill_length:
            raise ValueError(f"prefill: true_length={true_length} with {padded.shape[0]} padded tokens; the engine "
                             f"pads prompts to max_prefill_length={self._max_prefill_length}")
        p, _ = self._resolve(params)
        return self._prefill_fn(p, padded[None], np.int32(true_length))

    def insert(self, prefix, decode_state, slot):
        return self._insert_fn(prefix, decode_state, np.int32(slot), np.int32(self.seed))

    def generate(self, params, decode_state):
        p, version = self._resolve(params)
        decode_state, data = self._generate_fn(p, decode_state, np.int32(version), np.int32(self.seed))
        return decode_state, engine_api.ResultTokens(data, (0, 1), (1, 2), (2, 3), 1)

    def init_decode_state(self, *args, **kwargs):
        S = self.slots
        state = {"cache": model_lib.init_cache(self.cfg, S, self.cache_length),
                 "token": jnp.zeros((S,), jnp.int32), "pos_next": jnp.zeros((S,), jnp.int32),
                 "active": jnp.zeros((S,), bool), "length": jnp.zeros((S,), jnp.int32),
                 "step": jnp.zeros((), jnp.int32), "budget": jnp.zeros((S,), jnp.int32),
                 "think_ended": jnp.zeros((S,), bool), "forced_left": jnp.zeros((S,), jnp.int32),
                 "answer_left": jnp.full((S,), -1, jnp.int32)}
        return jax.device_put(state, self.state_shardings)

    def load_params(self, *args, **kwargs):
        return WeightHolder(self.param_shardings, self._copy_fn)

    def get_prefix_destination_sharding(self):
        return sharding.replicated(self._mesh)

    def get_tokenizer(self):
        return tokenizer_pb2.TokenizerParameters(path="rl_scaling:task_tokenizer")

    def build_tokenizer(self, metadata):
        if self.tokenizer is None:
            raise ValueError("this engine was built without a tokenizer")
        return _CharTokenizer(self.tokenizer)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self):
        return self._mesh

    @property
    def colocated_cpus(self):
        return None

    def compile_counts(self) -> dict:
        """Compiled variants of each jitted entry point (a weight push must not add any)."""
        return {"prefill": self._prefill_fn._cache_size(), "insert": self._insert_fn._cache_size(),
                "generate": self._generate_fn._cache_size(), "weight_copy": self._copy_fn._cache_size()}


def unpack(data, routing_shape: tuple | None = None):
    """Host view of ResultTokens.data: dict of per-slot columns (logprob as float32); with
    routing_shape=(n_layers, k) also "routing", the fed token's experts [slots, n_layers, k]."""
    data = np.asarray(data)
    out = {name: data[:, i] for i, name in enumerate(COLUMNS)}
    if routing_shape is not None:
        out["routing"] = data[:, len(COLUMNS):].reshape((data.shape[0],) + tuple(routing_shape))
    out["logprob"] = np.ascontiguousarray(out["logprob"]).view(np.float32)
    out["stopped"] = out["done"] == 2  # done: 0 running, 1 out of budget ("length"), 2 stopped ("stop")
    for name in ("valid", "done", "forced"):
        out[name] = out[name].astype(bool)
    return out
