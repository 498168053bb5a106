"""What a gRPC server refuses before its handlers see it: a request over its size limit, and
one that does not decode; both INVALID_ARGUMENT naming the problem (grpc alone would parse the
first whole, and answer the second UNKNOWN or INTERNAL)."""

from __future__ import annotations

import contextlib
import inspect

import grpc
from google.protobuf.message import DecodeError


class Refused:
    """Handed to the handler instead of a request it must not take."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


class RequestChecks(grpc.aio.ServerInterceptor):
    """max_bytes: the largest request taken (`max_request_bytes`); None: grpc's own limit."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:  # reflection: grpc's own checks
            return handler
        deserializer = self._checked(handler.request_deserializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _refusing(handler.unary_stream), deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _refusing(handler.unary_unary), deserializer, handler.response_serializer
        )

    def _checked(self, parse):
        def checked(data: bytes):
            if self.max_bytes is not None and len(data) > self.max_bytes:
                return Refused(
                    f"request of {len(data)} bytes is over the limit of {self.max_bytes} "
                    "(max_request_bytes)"
                )
            try:
                return parse(data)
            except DecodeError as error:
                return Refused(f"the request does not decode: {error}")

        return checked


def _refusing(behavior):
    """`behavior`, which aborts with INVALID_ARGUMENT when handed a Refused instead."""
    if inspect.isasyncgenfunction(behavior):

        async def streamed(request, context):
            if isinstance(request, Refused):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return streamed

    async def called(request, context):
        if isinstance(request, Refused):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
        return await behavior(request, context)

    return called
