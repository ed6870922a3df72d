"""The gRPC plumbing the rollout services share (server.py, jetstream_service.py).

Addresses: `is_loopback` decides from the resolved addresses whether a host is loopback only
(launch/serve.py refuses to serve anything else without a token), `bind_address` spells host:port
for grpc. Errors: a handler wrapped in `guarded` / `guarded_stream` answers wire.BadRequest with
INVALID_ARGUMENT, `Refused` with its own code, and anything else with INTERNAL and a one-line
message (the traceback stays in the server's log), never UNKNOWN. Auth: `TokenCheck` refuses every
RPC without the shared token (UNAUTHENTICATED) before any handler runs, comparing in constant time.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging

import grpc

from rl_scaling.serving.wire import TOKEN_ENV, TOKEN_METADATA, BadRequest

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether `host` resolves to loopback addresses only (decided on the resolved addresses, not
    the spelling: `127.evil.example` is whatever DNS says it is; a name that does not resolve is
    not loopback)."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    import socket

    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0].split("%", 1)[0] for info in infos}
    try:
        return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
    except ValueError:
        return False


def bind_address(host: str, port: int) -> str:
    """`host:port` as grpc takes it (an IPv6 literal in brackets)."""
    host = host.strip()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class Refused(Exception):
    """A well-formed request the server cannot serve now: answered with `code` and the message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _abort_with(method: str, context, e: Exception):
    if isinstance(e, BadRequest):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(e, Refused):
        code = e.code
    elif not context.is_active():  # the client hung up mid-request (a cancelled stream raises here)
        return
    else:  # a fault of the server's own: the traceback goes to its log, one line to the client
        log.error("%s failed", method, exc_info=e)
        code, e = grpc.StatusCode.INTERNAL, f"server error: {type(e).__name__}: {e}"
    context.abort(code, f"{method}: {e}")


def guarded(method: str, fn):
    """A unary-response handler that answers every exception with a status (see the module doc)."""

    @functools.wraps(fn)
    def handler(request, context):
        try:
            return fn(request, context)
        except Exception as e:  # noqa: BLE001 - each becomes a status, never UNKNOWN
            error = e
        _abort_with(method, context, error)

    return handler


def guarded_stream(method: str, fn):
    """`guarded` for a handler that yields its responses."""

    @functools.wraps(fn)
    def handler(request, context):
        try:
            yield from fn(request, context)
            return
        except Exception as e:  # noqa: BLE001
            error = e
        _abort_with(method, context, error)

    return handler


def _token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()  # equal lengths: compare_digest leaks nothing


class TokenCheck(grpc.ServerInterceptor):
    """Every RPC, of every service on the server, must carry the shared secret."""

    def __init__(self, token: str):
        self._digest = _token_digest(token)

    def intercept_service(self, continuation, details):
        given = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if hmac.compare_digest(_token_digest(given if isinstance(given, str) else ""), self._digest):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        message = f"{details.method}: missing or wrong {TOKEN_METADATA} (the rollout token: ${TOKEN_ENV} or --token_file)"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def deny_stream(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # never reached: makes this a response stream

        kind = (handler.request_streaming, handler.response_streaming)
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        return make[kind](deny_stream if kind[1] else deny)
