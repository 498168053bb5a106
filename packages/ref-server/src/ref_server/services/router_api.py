"""The public gRPC API (`ref_server.v1.Router`) over the router's request flow."""

from __future__ import annotations

import uuid

import grpc

from ref_server.services.messages import BadRequest, sampling_params
from ref_server.services.router import Finished, RequestError, Router, Tokens
from ref_server.services.security import ApiKeys, bearer
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc


def caller(keys: ApiKeys, metadata, connection: str) -> tuple[str, bytes]:
    """(owner, cache salt) of a call: the API key's tenant, else the connection. The gate
    has let only good keys through."""
    tenant = keys.check(bearer(metadata)) or ""
    return (tenant or connection), keys.cache_salt(tenant)


class RouterService(rpc.RouterServicer):
    def __init__(
        self, router: Router, keys: ApiKeys, max_request_bytes: int, serving: callable
    ) -> None:
        self.router, self.keys = router, keys
        self.max_request_bytes = max_request_bytes
        self.serving = serving

    def _submission(self, request, context):
        if request.ByteSize() > self.max_request_bytes:
            message = (
                f"request of {request.ByteSize()} bytes is over the limit of "
                f"{self.max_request_bytes}"
            )
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
        kind = request.WhichOneof("input")
        if kind is None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "the request has neither text nor token_ids"
            )
        tokenizer, model = self.router.tokenizer, self.router.model
        if kind == "text":  # not encoded when empty: that would be BOS alone
            prompt = tokenizer.encode(request.text) if request.text else []
        else:
            prompt = list(request.token_ids.ids)
        try:
            params = sampling_params(request.sampling, model.max_model_len)
        except BadRequest as error:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        owner, salt = caller(self.keys, context.invocation_metadata(), context.peer())
        return self.router.submission(
            prompt,
            params,
            list(request.sampling.stop),
            request.request_id or uuid.uuid4().hex,
            owner,
            salt,
            context.time_remaining(),
        )

    async def Generate(self, request, context):
        try:
            submission = self._submission(request, context)
        except RequestError as error:
            await context.abort(error.code, error.message)
        request_id = submission.request_id
        try:
            async for event in self.router.generate(submission):
                if isinstance(event, Tokens):
                    chunk = pb.Chunk(token_ids=event.token_ids, text=event.text)
                    yield pb.GenerateResponse(request_id=request_id, chunk=chunk)
                elif isinstance(event, Finished):
                    complete = pb.Complete(finish_reason=event.finish_reason, usage=event.usage)
                    yield pb.GenerateResponse(request_id=request_id, complete=complete)
        except RequestError as error:
            failure = pb.Error(code=error.code.value[0], message=error.message)
            yield pb.GenerateResponse(request_id=request_id, error=failure)
            if error.retry_after:
                context.set_trailing_metadata((("retry-after", f"{error.retry_after:g}"),))
            await context.abort(error.code, error.message)

    async def Abort(self, request, context):
        owner, _ = caller(self.keys, context.invocation_metadata(), context.peer())
        if not self.router.abort(owner, request.request_id):
            message = f"no request {request.request_id!r} of this client is in flight"
            await context.abort(grpc.StatusCode.NOT_FOUND, message)
        return pb.AbortResponse()

    async def GetModelInfo(self, request, context):
        m = self.router.model
        return pb.ModelInfo(
            name=m.name,
            vocab_size=m.vocab_size,
            max_model_len=m.max_model_len,
            num_layers=m.num_layers,
            num_parameters=m.num_parameters,
            eos_token_ids=m.eos_token_ids,
        )

    async def GetServerInfo(self, request, context):
        return self.router.pool.server_info(self.serving())
