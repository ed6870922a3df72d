"""JetStream's `Orchestrator` gRPC API (google-jetstream 0.2.2's jetstream.proto) over the
rollout server's engine, weights and generator, for JetStream's stock clients (its generated
`OrchestratorStub`, `tools/requester.py`, `benchmarks/benchmark_serving.py`).

  HealthCheck({})  -> {is_live}: the generator runs, has not failed, and holds weights.
  Decode({text_content | token_content, max_tokens}) -> a stream of DecodeResponse.stream_content,
      one sample each, as the stock orchestrator streams them: one response per generated token
      as it comes out of the engine; text requests get `text` (through the project's tokenizer)
      and `token_ids`, token requests `token_ids` only. The prompt gets BOS first, as JetStream
      does, unless it already starts with it. The stream ends at a stop token (not sent),
      after `max_tokens` tokens, or when the engine's own budget (`max_new_tokens`, forced
      interruption) ends the sequence; max_tokens 0 (unset) or above that budget means that
      budget.

A Decode is one group of one sample in the same generator queue as the trainer's groups,
sampled like them (the engine's temperature, its forced interruption); the weights are the
latest pushed. Not supported: `session_cache` (multi-turn prefixes), `priority`. A token held
back because it ends in the middle of a character (byte-level tokenizers) comes with the
next response. A client that hangs up leaves its sequence to finish in its slot.

Messages are parsed here, not by grpc, so a malformed one gets INVALID_ARGUMENT with a message.
"""

from __future__ import annotations

import itertools
import queue

import grpc
import numpy as np
from google.protobuf import message as pb_message

from rl_scaling.rollout import generator as generator_lib
from rl_scaling.rollout import jetstream_compat
from rl_scaling.serving.rpc import Refused, guarded, guarded_stream
from rl_scaling.serving.wire import BadRequest, check_prompt

SERVICE = "jetstream_proto.Orchestrator"


def _parse(cls, blob: bytes):
    try:
        return cls.FromString(blob)
    except pb_message.DecodeError as e:
        raise BadRequest(f"not a {cls.DESCRIPTOR.full_name}: {e}") from None


class _Detokenizer:
    """Text of each new token: the decoded sequence's growth, held back while it ends in U+FFFD."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.held, self.text = tokenizer, [], [], ""

    def push(self, token: int):
        self.ids.append(token)
        self.held.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return None
        return self.flush(text)

    def flush(self, text=None):
        if not self.held:
            return None
        text = self.tokenizer.decode(self.ids) if text is None else text
        out = (text[len(self.text):], self.held)
        self.text, self.held = text, []
        return out


class Orchestrator:
    """Decode and HealthCheck handlers over a `server.RolloutServer`."""

    def __init__(self, server):
        self.server, self.engine = server, server.engine
        self.pb = jetstream_compat.load().jetstream_pb2
        self._ids = itertools.count(-1, -1)  # apart from the trainer's group ids (not that they meet)

    def service(self):
        handlers = {"Decode": grpc.unary_stream_rpc_method_handler(guarded_stream("Decode", self._decode)),
                    "HealthCheck": grpc.unary_unary_rpc_method_handler(guarded("HealthCheck", self._health_check))}
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _health_check(self, request: bytes, context) -> bytes:
        _parse(self.pb.HealthCheckRequest, request)
        srv = self.server
        live = srv.generator.alive and not srv.error() and srv.holder.version >= 0
        return self.pb.HealthCheckResponse(is_live=live).SerializeToString()

    def _prompt(self, request):
        which = request.WhichOneof("content")
        if which is None:
            raise BadRequest("a DecodeRequest carries text_content or token_content; this one has neither")
        if request.session_cache:
            raise BadRequest("session_cache (multi-turn prefix caching) is not supported by this server")
        tok = self.engine.tokenizer
        if which == "text_content":
            if tok is None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "this engine has no tokenizer: send token_content")
            try:
                ids = list(tok.encode(request.text_content.text))
            except ValueError as e:
                raise BadRequest(f"text_content: {e}") from None
        else:
            ids = list(request.token_content.token_ids)
        bos = getattr(tok, "bos_id", None)
        if bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        prompt = check_prompt(np.asarray(ids, np.int64), max_len=self.engine.max_prefill_length,
                              vocab_size=self.engine.cfg.vocab_size)
        return prompt, which == "text_content"

    def _next(self, stream, context):
        """The generator's next item for this request; None once the client has gone."""
        while True:
            try:
                return stream.get(timeout=0.1)
            except queue.Empty:
                pass
            if not context.is_active():
                return None
            error = self.server.error()
            if error:
                raise Refused(grpc.StatusCode.UNAVAILABLE, error.splitlines()[0])

    def _decode(self, request: bytes, context):
        request = _parse(self.pb.DecodeRequest, request)
        prompt, with_text = self._prompt(request)
        if request.max_tokens < 0:
            raise BadRequest(f"max_tokens={request.max_tokens}")
        budget = self.engine.max_new_tokens
        max_tokens = min(request.max_tokens or budget, budget)
        if self.server.holder.version < 0:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "no weights yet: start launch/serve.py with --params=PATH or push them from a trainer")
        stream = queue.SimpleQueue()
        self.server.generator.submit([generator_lib.GroupRequest(next(self._ids), prompt, 1, stream=stream)])
        detok = _Detokenizer(self.engine.tokenizer) if with_text else None
        stop = set(self.engine.stop_tokens)
        sent = 0
        while sent < max_tokens:
            item = self._next(stream, context)
            if item is None or isinstance(item, generator_lib.GroupResult):
                break
            token = item[1]
            if token in stop:
                break
            sent += 1
            out = detok.push(token) if detok else ("", [token])
            if out is not None:
                yield self._response(*out)
        out = detok.flush() if detok else None
        if out is not None:
            yield self._response(*out)

    def _response(self, text: str, token_ids) -> bytes:
        content = self.pb.DecodeResponse.StreamContent
        sample = content.Sample(text=text, token_ids=token_ids)
        return self.pb.DecodeResponse(stream_content=content(samples=[sample])).SerializeToString()
