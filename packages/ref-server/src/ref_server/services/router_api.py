"""The public gRPC API (`ref_server.v1.Router`) over the router's request flow."""

from __future__ import annotations

import re
import uuid
from urllib.parse import unquote

import grpc

from ref_server.services.messages import BadRequest, sampling_params
from ref_server.services.router import Finished, RequestError, Router, Tokens
from ref_server.services.security import ApiKeys, bearer
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]*")


def caller(keys: ApiKeys, metadata, peer: str) -> tuple[str, str, bytes]:
    """(owner, tenant, cache salt) of a call: the owner is the API key's tenant, else the
    connection; the tenant is the key's, else the client's address. The gate has let only
    good keys through."""
    tenant = keys.check(bearer(metadata)) or ""
    return (tenant or peer), (tenant or client_address(peer)), keys.cache_salt(tenant)


def client_address(peer: str) -> str:
    """A gRPC peer's host as the HTTP API names it: "ipv4:10.0.0.1:5000" is 10.0.0.1,
    "ipv6:%5B::1%5D:5000" ::1; any other peer as it is."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return unquote(rest).rpartition(":")[0].strip("[]")


class RouterService(rpc.RouterServicer):
    def __init__(self, router: Router, keys: ApiKeys, serving: callable) -> None:
        self.router, self.keys = router, keys
        self.serving = serving

    def _checked_id(self, request_id: str) -> str:
        """The client's request id (echoed in every message), or RequestError."""
        limit = self.router.limits.max_request_id_length
        if len(request_id) > limit:
            message = (
                f"request_id of {len(request_id)} characters is over the limit of {limit} "
                "(max_request_id_length)"
            )
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
        if not REQUEST_ID.fullmatch(request_id):
            message = "request_id may hold only A-Z, a-z, 0-9 and . _ : -"
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
        return request_id

    def _submission(self, request, context):
        request_id = self._checked_id(request.request_id) or uuid.uuid4().hex
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
        owner, tenant, salt = caller(self.keys, context.invocation_metadata(), context.peer())
        return self.router.submission(
            prompt,
            params,
            list(request.sampling.stop),
            request_id,
            owner,
            salt,
            context.time_remaining(),
            tenant,
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
        try:
            self._checked_id(request.request_id)
        except RequestError as error:
            await context.abort(error.code, error.message)
        owner, _, _ = caller(self.keys, context.invocation_metadata(), context.peer())
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
