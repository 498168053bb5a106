from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class KvTransferMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_METHOD_UNSPECIFIED: _ClassVar[KvTransferMethod]
    KV_TRANSFER_METHOD_GRPC: _ClassVar[KvTransferMethod]
    KV_TRANSFER_METHOD_CUDA_IPC: _ClassVar[KvTransferMethod]
    KV_TRANSFER_METHOD_NIXL: _ClassVar[KvTransferMethod]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
KV_TRANSFER_METHOD_UNSPECIFIED: KvTransferMethod
KV_TRANSFER_METHOD_GRPC: KvTransferMethod
KV_TRANSFER_METHOD_CUDA_IPC: KvTransferMethod
KV_TRANSFER_METHOD_NIXL: KvTransferMethod

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("finish_reason", "usage")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: Chunk
    complete: Complete
    error: Error
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "max_model_len", "num_layers", "num_parameters", "eos_token_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_parameters: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_parameters: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("name", "role", "healthy", "load", "problem")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    healthy: bool
    load: WorkerLoad
    problem: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., healthy: bool = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., problem: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("workers", "serving", "problem")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    serving: bool
    problem: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., serving: bool = ..., problem: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "queued_tokens", "queued_flops", "held", "mapped_caches", "expert_rebalances", "expert_bytes_moved", "draft_acceptance_rate", "accepted_length", "ranks", "configured_ranks")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FLOPS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    MAPPED_CACHES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_REBALANCES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_RANKS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    queued_tokens: int
    queued_flops: float
    held: int
    mapped_caches: int
    expert_rebalances: int
    expert_bytes_moved: int
    draft_acceptance_rate: float
    accepted_length: float
    ranks: int
    configured_ranks: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., queued_tokens: _Optional[int] = ..., queued_flops: _Optional[float] = ..., held: _Optional[int] = ..., mapped_caches: _Optional[int] = ..., expert_rebalances: _Optional[int] = ..., expert_bytes_moved: _Optional[int] = ..., draft_acceptance_rate: _Optional[float] = ..., accepted_length: _Optional[float] = ..., ranks: _Optional[int] = ..., configured_ranks: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("prefill_addresses",)
    PREFILL_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    prefill_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prefill_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("role", "model", "model_fingerprint", "num_layers", "page_size", "cache_width", "cache_dtype", "max_running", "rank", "ranks", "speculative")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    model_fingerprint: str
    num_layers: int
    page_size: int
    cache_width: int
    cache_dtype: str
    max_running: int
    rank: int
    ranks: int
    speculative: bool
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., cache_width: _Optional[int] = ..., cache_dtype: _Optional[str] = ..., max_running: _Optional[int] = ..., rank: _Optional[int] = ..., ranks: _Optional[int] = ..., speculative: bool = ...) -> None: ...

class PrefixMatchRequest(_message.Message):
    __slots__ = ("page_hashes",)
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, page_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefixMatchResponse(_message.Message):
    __slots__ = ("cached_pages",)
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    cached_pages: int
    def __init__(self, cached_pages: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "cached_tokens", "kv_handle", "num_pages", "finish_reason", "lease_seconds")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    cached_tokens: int
    kv_handle: str
    num_pages: int
    finish_reason: FinishReason
    lease_seconds: float
    def __init__(self, first_token: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., kv_handle: _Optional[str] = ..., num_pages: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("kv_handle", "nixl_pages")
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NIXL_PAGES_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    nixl_pages: bool
    def __init__(self, kv_handle: _Optional[str] = ..., nixl_pages: bool = ...) -> None: ...

class KvPage(_message.Message):
    __slots__ = ("index", "data", "dtype", "kv_handle", "crc32")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    dtype: str
    kv_handle: str
    crc32: int
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., kv_handle: _Optional[str] = ..., crc32: _Optional[int] = ...) -> None: ...

class ShareCacheRequest(_message.Message):
    __slots__ = ("nixl",)
    NIXL_FIELD_NUMBER: _ClassVar[int]
    nixl: bool
    def __init__(self, nixl: bool = ...) -> None: ...

class CudaIpcTensor(_message.Message):
    __slots__ = ("size", "stride", "offset", "dtype", "device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, size: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: bool = ...) -> None: ...

class SharedCache(_message.Message):
    __slots__ = ("cache_id", "host_id", "layers", "nixl_metadata", "nixl_unavailable")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    NIXL_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    host_id: str
    layers: _containers.RepeatedCompositeFieldContainer[CudaIpcTensor]
    nixl_metadata: bytes
    nixl_unavailable: str
    def __init__(self, cache_id: _Optional[str] = ..., host_id: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[CudaIpcTensor, _Mapping]]] = ..., nixl_metadata: _Optional[bytes] = ..., nixl_unavailable: _Optional[str] = ...) -> None: ...

class NixlPages(_message.Message):
    __slots__ = ("kind", "rows")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    rows: bytes
    def __init__(self, kind: _Optional[str] = ..., rows: _Optional[bytes] = ...) -> None: ...

class KvBlocks(_message.Message):
    __slots__ = ("cache_id", "blocks", "lease_seconds", "nixl_pages")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NIXL_PAGES_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    blocks: _containers.RepeatedScalarFieldContainer[int]
    lease_seconds: float
    nixl_pages: NixlPages
    def __init__(self, cache_id: _Optional[str] = ..., blocks: _Optional[_Iterable[int]] = ..., lease_seconds: _Optional[float] = ..., nixl_pages: _Optional[_Union[NixlPages, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("kv_handle",)
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    def __init__(self, kv_handle: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "first_token", "sampling", "prefill_address", "kv_handle", "num_pages", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: SamplingParams
    prefill_address: str
    kv_handle: str
    num_pages: int
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., kv_handle: _Optional[str] = ..., num_pages: _Optional[int] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "kv_transfer")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    kv_transfer: KvTransferMethod
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., kv_transfer: _Optional[_Union[KvTransferMethod, str]] = ...) -> None: ...
