"""`ServeConfig`: every setting of `ref-server serve`, from its defaults, a TOML file, then
flags. Torch-free, so `ref-server serve --help` starts at once."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from ref_server import kernel_choice
from ref_server.config_file import read_toml

ROLES = ("router", "prefill", "decode", "all")
TWO_BATCH = ("auto", "on", "off")  # ref_server.engine.model_runner.TWO_BATCH_MODES
OVERLAP_STEPS = ("auto", "on", "off")  # ref_server.engine.engine.OVERLAP_STEPS_MODES
SPECULATIVE = ("off", "mtp")
MAX_DRAFT_TOKENS = 3  # ref_server.model.speculative.MAX_DRAFT_TOKENS
WEIGHT_DTYPES = ("dense", "fp8")
KV_TRANSFERS = ("auto", "nixl", "cuda_ipc", "grpc")  # ref_server.services.kv_transfer.METHODS
PRESET_NAMES = (
    "tiny",
    "v2-lite",
    "v3",
    "v3.2-tiny",
    "v3.2-lite",
    "v3.2",
)  # ref_server.model.PRESETS (a test keeps them equal)
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
LOG_LEVELS = ("debug", "info", "warning", "error")
GROUP_STORES = ("rank0", "external")


def _setting(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServeConfig:
    role: str = _setting(
        "all",
        "what this process runs: the router, a prefill or a decode instance, or all of them "
        "(child processes, restarted when they die)",
    )
    host: str = _setting(
        "127.0.0.1", "address to listen on (--role all: the router's; its instances use 127.0.0.1)"
    )
    port: int = _setting(50051, "gRPC port: the router's public API, or an instance's own")
    http_port: int = _setting(
        8000, "the router's HTTP port: OpenAI-compatible API, /health, /metrics (0: none)"
    )
    preset: str = _setting("tiny", "random weights of this preset, unless --model is given")
    model: str | None = _setting(
        None, "a Hugging Face DeepSeek-V3 or V3.2 checkpoint directory to load instead of a preset"
    )
    seed: int = _setting(0, "seed of a preset's random weights")
    served_model_name: str | None = _setting(
        None,
        "the model's id in both APIs; none: the preset's name, or the checkpoint directory's "
        "own name (never its path)",
    )
    weight_dtype: str = _setting(
        "dense",
        "dense: weights in the compute dtype (bf16 on CUDA, float32 on CPU; FP8 checkpoints "
        "dequantized at load); fp8: projections kept in FP8 with 128x128 block scales, as "
        "DeepSeek serves V3 (half the memory; its GEMMs are still a slow reference)",
    )
    device: str = _setting("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    kernels: str = _setting(
        "ours",
        "whose kernels the instances run: ours, deepseek (FlashMLA for decode attention, DeepGEMM "
        "for FP8 GEMMs, DeepEP for the expert exchange, where the model has each; CUDA, pages of "
        "64) or deepseek:PART[,PART...] (parts attention, gemm, exchange; ours for the rest)",
    )
    num_blocks: int = _setting(512, "KV cache pages per instance")
    block_size: int = _setting(64, "tokens per KV page")
    max_num_seqs: int = _setting(128, "sequences an instance runs at once")
    max_num_batched_tokens: int = _setting(4096, "tokens per engine step")
    max_model_len: int = _setting(2048, "the longest prompt + max_tokens a request may ask for")
    max_waiting: int = _setting(1024, "queued requests per instance before RESOURCE_EXHAUSTED")
    kv_transfer: str = _setting(
        "auto",
        "how a decode instance gets a prompt's KV pages: auto (CUDA IPC on one host, NIXL across "
        "hosts, else a gRPC stream), nixl (a one-sided NIXL read, on one host too), cuda_ipc or "
        "grpc; an unavailable method falls back to the gRPC stream, said in the log",
    )
    hold_seconds: float = _setting(
        60.0, "lease on a prefill instance's KV: freed after this long unless pulled or released"
    )
    two_batch: str = _setting(
        "auto",
        "two-batch overlap: run a step as two microbatches whose expert-parallel exchanges "
        "overlap each other's compute (auto: with --ranks > 1)",
    )
    two_batch_decode_tokens: int = _setting(64, "decode tokens per rank below which one batch runs")
    two_batch_prefill_tokens: int = _setting(
        512, "prefill tokens per rank below which one batch runs"
    )
    prefill_graph_tokens: int = _setting(
        4096,
        "the most new tokens of a prefill step replayed piecewise from CUDA graphs (CUDA, one "
        "rank; capped by --max-num-batched-tokens); 0: prefill runs eagerly",
    )
    overlap_steps: str = _setting(
        "auto",
        "queue each engine step on the device before the previous step's tokens are read, so "
        "the host's part of a step runs beside the device's (on: one rank, no EPLB; auto: off)",
    )
    speculative: str = _setting(
        "off",
        "speculative decoding: mtp drafts tokens with the model's MTP module (a checkpoint's, or "
        "a preset's random one) and verifies them in one step (no EPLB, steps not overlapped)",
    )
    draft_tokens: int = _setting(
        1, f"tokens the MTP module drafts a step with --speculative mtp (1-{MAX_DRAFT_TOKENS})"
    )
    redundant_experts: int = _setting(
        0,
        "expert slots per MoE layer beyond the routed experts, for replicas of hot ones "
        "(EPLB); with the routed experts, a multiple of --ranks",
    )
    eplb_interval: int = _setting(
        0,
        "steps per expert-load window: after each, the experts are placed anew for the load "
        "it counted and moved while serving (0: never)",
    )
    eplb_layers_per_step: int = _setting(1, "MoE layers whose experts move after each step")
    expert_placement: str | None = _setting(
        None, "an expert placement file (JSON, as --eplb-save writes) to start from"
    )
    eplb_save: str | None = _setting(
        None, "a file the instance writes each expert placement to once every layer holds it"
    )
    max_request_bytes: int = _setting(
        1 << 20,
        "the largest gRPC request or HTTP body the router takes: INVALID_ARGUMENT beyond (up to "
        "64 KiB more; further, gRPC's own RESOURCE_EXHAUSTED), HTTP 413",
    )
    max_inflight: int = _setting(
        1024, "requests the router admits at once; more get RESOURCE_EXHAUSTED (HTTP 429)"
    )
    tenant_share: float = _setting(
        0.5,
        "the share of max_inflight one tenant may hold (an API key; without keys, a client "
        "address); more get RESOURCE_EXHAUSTED (HTTP 429)",
    )
    max_concurrent_rpcs: int = _setting(
        4096,
        "calls a gRPC server (the router's, an instance's) serves at once, health checks "
        "included; more get RESOURCE_EXHAUSTED; above max_inflight",
    )
    max_prompts: int = _setting(64, "prompts in one HTTP completions request")
    max_choices: int = _setting(
        64, "choices in one HTTP request (prompts x n), admitted all or none"
    )
    max_stops: int = _setting(16, "stop strings in one request")
    max_stop_length: int = _setting(256, "characters in one stop string")
    max_stop_token_ids: int = _setting(64, "distinct stop token ids in one request")
    max_request_id_length: int = _setting(
        128, "characters in a gRPC request id (letters, digits and . _ : -)"
    )
    request_timeout_s: float = _setting(3600.0, "the ceiling of a request without a deadline")
    queue_timeout_s: float = _setting(30.0, "how long a request may wait for decode room")
    cache_threshold: float = _setting(
        0.3,
        "share of a prompt's pages a prefill instance must cache to get the request while the "
        "prefill queues are even",
    )
    balance_abs_threshold: int = _setting(
        64,
        "prefill queues are uneven (requests go to the shortest) when they differ by more "
        "than this many prompt tokens and by more than --balance-rel-threshold times",
    )
    balance_rel_threshold: float = _setting(
        1.5, "see --balance-abs-threshold: how many times the shortest queue the longest exceeds"
    )
    prefix_index_pages: int = _setting(
        1 << 17,
        "page hashes the router keeps per prefill instance to guess its cached prefixes "
        "(least recently used dropped beyond)",
    )
    health_interval_s: float = _setting(
        1.0, "time between the router's health checks of an instance"
    )
    health_failures: int = _setting(3, "failed checks in a row before an instance is dropped")
    prefill_instances: int = _setting(1, "how many prefill instances --role all starts")
    decode_instances: int = _setting(1, "how many decode instances --role all starts")
    prefill: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "--role router: the prefill instances, comma-separated"},
    )
    decode: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "--role router: the decode instances, comma-separated"},
    )
    ranks: int = _setting(1, "processes per instance: data-parallel attention, expert-parallel MoE")
    rank: int = _setting(0, "this process's rank in its instance (--role all and torchrun set it)")
    group_address: str | None = _setting(
        None, "where an instance's ranks meet: host:port, or env (torchrun's environment)"
    )
    group_timeout_s: float = _setting(
        300.0, "how long a rank waits for its peers (while the instance starts, with --elastic)"
    )
    group_store: str = _setting(
        "rank0",
        "who hosts the store where an instance's ranks meet at --group-address: rank0, or "
        "external (it listens there already, as --role all's supervisor hosts it for --elastic "
        "instances)",
    )
    elastic: bool = _setting(
        False,
        "an instance of several ranks that loses some goes on over the others: they agree on "
        "who is left, place the lost ranks' experts anew and keep their requests (CPU, "
        "ep_comm's torch backend; every rank may be lost with an external --group-store, all "
        "but rank 0 without)",
    )
    join: bool = _setting(
        False,
        "--elastic: join the running instance at --group-address as member --rank, one it lost: "
        "load the model, wait (at most --group-timeout-s) until its ranks admit this one, take "
        "its share of the experts from them and serve",
    )
    failure_timeout_s: float = _setting(
        30.0,
        "--elastic: how long a rank of a started instance waits for a peer before the instance "
        "counts it lost (one whose process ends is counted lost at once)",
    )
    api_key_file: str | None = _setting(
        None, "API keys, one per line (also REF_SERVER_API_KEYS); none: the API is open"
    )
    isolate_cache: bool = _setting(
        True, "prefix-cache hits only within one API key (no effect without API keys)"
    )
    tls_cert: str | None = _setting(
        None, "PEM certificate of the public gRPC and HTTP APIs (with --tls-key)"
    )
    tls_key: str | None = _setting(None, "PEM private key of --tls-cert")
    internal_secret_file: str | None = _setting(
        None,
        "the internal services' secret (else REF_SERVER_INTERNAL_SECRET; --role all makes one)",
    )
    log_level: str = _setting(
        "info",
        "the least severe log records each process writes to stderr: debug, info (the router "
        "also logs a line per finished request), warning or error (demo: warning)",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        problems = []
        if self.role not in ROLES:
            problems.append(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.model and self.preset not in PRESET_NAMES:
            problems.append(f"unknown preset {self.preset!r}; presets: {', '.join(PRESET_NAMES)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            problems.append(
                f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}"
            )
        problems += self._kernels_problems()
        if self.kv_transfer not in KV_TRANSFERS:
            problems.append(
                f"kv_transfer must be one of {', '.join(KV_TRANSFERS)}, got {self.kv_transfer!r}"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            problems.append("served_model_name must not be empty")
        if self.log_level not in LOG_LEVELS:
            problems.append(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.two_batch not in TWO_BATCH:
            problems.append(
                f"two_batch must be one of {', '.join(TWO_BATCH)}, got {self.two_batch!r}"
            )
        for name in ("two_batch_decode_tokens", "two_batch_prefill_tokens"):
            if getattr(self, name) < 2:
                problems.append(
                    f"{name} must be >= 2 (two microbatches), got {getattr(self, name)}"
                )
        if self.prefill_graph_tokens < 0:
            problems.append(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if self.overlap_steps not in OVERLAP_STEPS:
            problems.append(
                f"overlap_steps must be one of {', '.join(OVERLAP_STEPS)}, "
                f"got {self.overlap_steps!r}"
            )
        if self.overlap_steps == "on" and (self.ranks > 1 or self.eplb_interval):
            problems.append("overlap_steps on needs instances of one rank without EPLB")
        problems += self._speculative_problems()
        if not DEVICE.fullmatch(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                problems.append(f"{name} must be in 0..65535, got {getattr(self, name)}")
        positive = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")
        positive += ("max_model_len", "max_inflight", "health_failures", "ranks")
        positive += ("prefix_index_pages", "eplb_layers_per_step", "max_request_bytes")
        positive += ("max_prompts", "max_choices", "max_stops", "max_stop_length")
        positive += ("max_stop_token_ids", "max_request_id_length")
        positive += ("hold_seconds", "request_timeout_s", "queue_timeout_s", "health_interval_s")
        problems += [
            f"{n} must be > 0, got {getattr(self, n)}" for n in positive if getattr(self, n) <= 0
        ]
        for name in ("redundant_experts", "eplb_interval"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eplb_save and not self.eplb_interval:
            problems.append("eplb_save needs eplb_interval > 0 (no placement is computed)")
        if not 0 < self.tenant_share <= 1:
            problems.append(f"tenant_share must be in (0, 1], got {self.tenant_share}")
        if self.max_concurrent_rpcs <= self.max_inflight:
            problems.append(
                f"max_concurrent_rpcs must be above max_inflight ({self.max_inflight}), got "
                f"{self.max_concurrent_rpcs}"
            )
        if not 0 <= self.cache_threshold <= 1:
            problems.append(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            problems.append(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if not self.balance_rel_threshold >= 1:
            problems.append(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.ranks > 0 and not 0 <= self.rank < self.ranks:
            problems.append(f"need 0 <= rank < ranks, got rank {self.rank} of {self.ranks}")
        if self.ranks > 1 and self.role in ("prefill", "decode") and not self.group_address:
            problems.append("an instance of several ranks needs group_address (host:port)")
        problems += self._elastic_problems()
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("TLS needs both tls_cert and tls_key")
        if problems:
            raise ValueError("; ".join(problems))

    def _elastic_problems(self) -> list[str]:
        problems = []
        if self.group_store not in GROUP_STORES:
            problems.append(
                f"group_store must be one of {', '.join(GROUP_STORES)}, got {self.group_store!r}"
            )
        if self.failure_timeout_s <= 0:
            problems.append(f"failure_timeout_s must be > 0, got {self.failure_timeout_s}")
        if not self.elastic:
            if self.group_store == "external":
                problems.append("group_store external is for elastic instances")
            if self.join:
                problems.append("join is for elastic instances (--elastic)")
            return problems
        if self.join and self.role not in ("prefill", "decode"):
            problems.append("join: a rank of a prefill or decode instance (--role), not all")
        if self.join and self.group_store == "rank0" and self.rank == 0:
            problems.append(
                "join: rank 0 hosts the store with --group-store rank0; it cannot "
                "join back (use an external store)"
            )
        if self.ranks < 2:
            problems.append("elastic needs instances of several ranks (ranks > 1)")
        if self.group_address == "env":
            problems.append("elastic: not under torchrun, which restarts every rank when one dies")
        with contextlib.suppress(ValueError):  # a bad kernels value is said on its own
            if "exchange" in self.kernel_parts():
                problems.append("elastic: not with DeepEP's exchange (kernels deepseek)")
        return problems

    def _speculative_problems(self) -> list[str]:
        if self.speculative not in SPECULATIVE:
            return [
                f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}"
            ]
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            return [f"draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, got {self.draft_tokens}"]
        if self.speculative == "off":
            return []
        if self.overlap_steps == "on":
            return ["speculative mtp does not overlap steps (overlap_steps on)"]
        return []

    @property
    def model_name(self) -> str:
        """The id clients see: never the checkpoint's path on this machine."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).resolve().name if self.model else self.preset

    def kernel_parts(self) -> tuple[str, ...]:
        """The parts DeepSeek's libraries run in each instance's model (`kernel_choice`)."""
        choice = kernel_choice.parse(self.kernels)
        return choice.parts_in(fp8=self.weight_dtype == "fp8", expert_parallel=self.ranks > 1)

    def _kernels_problems(self) -> list[str]:
        try:
            parts = self.kernel_parts()
        except ValueError as error:
            return [str(error)]
        problems = []
        if parts and self.device == "cpu":
            problems.append(f"kernels {self.kernels!r} run on CUDA, not on device cpu")
        if "attention" in parts and self.block_size != 64:
            problems.append(
                f"kernels {self.kernels!r}: FlashMLA reads pages of 64 tokens, not block_size "
                f"{self.block_size}"
            )
        return problems

    def replace(self, **changes) -> ServeConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_file(cls, path: str | Path, **flags) -> ServeConfig:
        """The TOML file's values (flat keys, the field names), then the flags; an error the
        file's values cause names the file."""
        values = read_toml(path, [f.name for f in dataclasses.fields(cls)])
        try:
            return cls(**(values | flags))
        except ValueError as error:
            cls(**flags)  # the flags' own problem, if they have one
            raise ValueError(f"config file {path}: {error}") from None


def _check_type(name: str, value, annotation: str) -> None:
    kinds = {"str": str, "int": int, "float": (int, float), "bool": bool, "None": type(None)}
    if annotation == "list[str]":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return
    elif any(
        isinstance(value, kinds[part.strip()]) and not (isinstance(value, bool) and part != "bool")
        for part in annotation.split("|")
    ):
        return
    raise ValueError(f"{name} must be {annotation}, got {value!r}")
