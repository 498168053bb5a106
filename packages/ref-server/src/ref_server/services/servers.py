"""One process of the deployment: the router, or one rank of a prefill or decode instance.

    ref_server.services.servers.serve(config)   # runs until SIGINT or SIGTERM

Both run an asyncio gRPC server. An instance's engine runs on its own thread (EngineLoop);
its internal services answer only calls that carry the deployment's secret. The router serves
the public gRPC API and, on `http_port`, the OpenAI-compatible HTTP API with /health and
/metrics, on the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import ref_server.model as M
from overlap_sched.gating import Thresholds
from ref_server.balance import PrefillPolicy, read_placement
from ref_server.engine import Engine, EplbConfig, SchedulerConfig
from ref_server.model.checkpoint import read_config, without_absent_mtp
from ref_server.services.aio import background
from ref_server.services.config import ServeConfig
from ref_server.services.elastic import Membership
from ref_server.services.engine_loop import EngineLoop
from ref_server.services.instance import DecodeService, InstanceService, PrefillService
from ref_server.services.kv_transfer import MAX_MESSAGE_BYTES, KvPuller
from ref_server.services.metrics import Metrics
from ref_server.services.request_checks import RequestChecks
from ref_server.services.router import Limits, ModelFacts, Router
from ref_server.services.router_api import RouterService
from ref_server.services.security import (
    ApiKeys,
    api_key_gate,
    read_api_keys,
    read_secret,
    secret_gate,
    server_credentials,
)
from ref_server.services.workers import Expected, WorkerPool
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SUPERVISOR_ENV = "REF_SERVER_SUPERVISOR_PID"  # set by --role all for its children
ELASTIC_GPU_ENV = "REF_SERVER_ELASTIC_GPU"  # 1: --elastic on GPUs too, where it has not run
ROUTER_SERVICE = pb.DESCRIPTOR.services_by_name["Router"].full_name
# Requests this far over max_request_bytes still reach the router's check, which names the
# limit; larger ones grpc refuses as they arrive (RESOURCE_EXHAUSTED).
REQUEST_SLACK_BYTES = 64 << 10


# ---------------------------------------------------------------- the model a config names


def model_args(config: ServeConfig) -> M.ModelArgs:
    """The model's, as an instance loads it (a checkpoint's MTP module only if it has its
    weights, a preset's with --speculative mtp): the router sizes pages by them."""
    if config.model:
        path = Path(config.model)
        args = without_absent_mtp(read_config(path), path)
    else:
        mtp = int(config.speculative == "mtp")
        args = dataclasses.replace(M.PRESETS[config.preset], num_nextn_predict_layers=mtp)
    if config.speculative == "mtp" and not args.num_nextn_predict_layers:
        raise ValueError(f"--speculative mtp: {config.model} has no MTP module")
    return args


def model_fingerprint(config: ServeConfig) -> str:
    """Equal for two configs exactly when they load the same weights (a checkpoint's config
    and weight files, or a preset, its seed and whether it has the MTP module, and the
    weights' dtype)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(config.weight_dtype.encode())
    if config.model:
        path = Path(config.model)
        digest.update((path / "config.json").read_bytes())
        for file in sorted(path.glob("*.safetensors")):
            digest.update(f"{file.name} {file.stat().st_size}".encode())
    else:
        digest.update(f"{config.preset} {config.seed} {model_args(config)!r}".encode())
    return digest.hexdigest()


def torch_device(config: ServeConfig) -> torch.device:
    """cuda when available for "auto"; a GPU without an index is the rank's own."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {config.device}: this machine's torch sees no CUDA device")
        count = torch.cuda.device_count()
        device = torch.device("cuda", config.rank % count if device.index is None else device.index)
        if device.index >= count:
            raise ValueError(f"device {config.device}: only {count} CUDA devices here")
        if config.elastic and os.environ.get(ELASTIC_GPU_ENV) != "1":
            raise ValueError(
                f"--elastic has run on the CPU only (ep_comm's torch backend over gloo); "
                f"{ELASTIC_GPU_ENV}=1 tries it on GPUs"
            )
    return device


def scheduler_config(config: ServeConfig) -> SchedulerConfig:
    names = [f.name for f in SchedulerConfig.__dataclass_fields__.values()]
    return SchedulerConfig(**{name: getattr(config, name) for name in names})


def membership(config: ServeConfig) -> Membership | None:
    """An elastic instance's (`ref_server.services.elastic`): None without --elastic."""
    if not config.elastic:
        return None
    return Membership(
        config.group_address,
        config.rank,
        config.ranks,
        timeout=timedelta(seconds=config.failure_timeout_s),
        startup_timeout=timedelta(seconds=config.group_timeout_s),
        host_store=config.group_store == "rank0" and config.rank == 0 and not config.join,
    )


def join_group(config: ServeConfig, members: Membership | None = None) -> dist.ProcessGroup | None:
    """This instance's gloo group, once every rank has joined; None for one rank. members:
    an elastic instance's, whose first group it is."""
    if config.ranks == 1:
        return None
    if members is not None:
        return members.join()
    address = config.group_address
    dist.init_process_group(
        "gloo",
        init_method="env://" if address == "env" else f"tcp://{address}",
        rank=config.rank,
        world_size=config.ranks,
        timeout=timedelta(seconds=config.group_timeout_s),
    )
    return dist.group.WORLD


def load_model(
    config: ServeConfig, group: dist.ProcessGroup | None, slots: dict | None = None
) -> M.Model:
    """slots: `expert_slots(config, ...)`, if already read. With --join, group is None: the
    model is built as rank --rank of the instance as it started, its group to come."""
    device = torch_device(config)
    dtype = torch.float32
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
    weights = dict(
        dtype=dtype,
        device=device,
        group=group,
        weight_dtype=_weight_dtype(config),
        kernels=config.kernels,
        joining=(config.rank, config.ranks) if config.join else None,
    )
    weights |= expert_slots(config, model_args(config)) if slots is None else slots
    if config.model:
        return M.from_pretrained(config.model, **weights)
    mtp = config.speculative == "mtp"
    return M.from_preset(config.preset, seed=config.seed, mtp=mtp, **weights)


def expert_slots(config: ServeConfig, args: M.ModelArgs) -> dict:
    """The model's expert slots and their placement, where the instance balances experts or
    is elastic (its slots are placed anew over the ranks left when it loses some)."""
    if not (
        config.redundant_experts
        or config.eplb_interval
        or config.expert_placement
        or config.elastic
    ):
        return {}
    slots = args.n_routed_experts + config.redundant_experts
    if slots % config.ranks:
        raise ValueError(
            f"{args.n_routed_experts} routed experts + {config.redundant_experts} redundant "
            f"do not split over {config.ranks} ranks"
        )
    if config.expert_placement is None:
        return dict(num_physical_experts=slots)
    placement = read_placement(config.expert_placement, args.n_routed_experts)
    if config.redundant_experts and placement.shape[1] != slots:
        raise ValueError(
            f"{config.expert_placement} places {placement.shape[1]} slots per layer, not the "
            f"{slots} of --redundant-experts {config.redundant_experts}"
        )
    return dict(expert_placement=placement)


def eplb(config: ServeConfig) -> EplbConfig | None:
    if not config.eplb_interval:
        return None
    save_to = Path(config.eplb_save) if config.eplb_save else None
    return EplbConfig(config.eplb_interval, config.eplb_layers_per_step, save_to)


def _weight_dtype(config: ServeConfig) -> str | None:
    return None if config.weight_dtype == "dense" else config.weight_dtype


def model_facts(config: ServeConfig) -> tuple[ModelFacts, object]:
    args = model_args(config)
    tokenizer = M.load_tokenizer(args, config.model)
    facts = ModelFacts(
        name=config.model_name,
        vocab_size=args.vocab_size,
        max_model_len=config.max_model_len,
        num_layers=args.num_hidden_layers,
        num_parameters=args.num_parameters(),
        eos_token_ids=[] if args.eos_token_id is None else [args.eos_token_id],
        page_size=config.block_size,
        page_bytes=M.cache_page_bytes(args, config.block_size),
    )
    return facts, tokenizer


# ---------------------------------------------------------------- servers


def supervised_service(supervisor_pid: int | str) -> str:
    """The health service a child of `--role all` also reports under: its supervisor's
    readiness checks ask for this name, which no other deployment's processes answer."""
    return f"ref_server.supervised.{supervisor_pid}"


def health_names(*names: str) -> list[str]:
    """`names`, and this process's supervised name when a supervisor started it."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    return [*names, supervised_service(supervisor)] if supervisor else list(names)


def grpc_server(config: ServeConfig, gates: list, max_request_bytes: int | None = None):
    """An asyncio gRPC server behind `gates` that serves at most `max_concurrent_rpcs` calls
    at once and refuses undecodable requests and, given `max_request_bytes`, larger ones. It
    binds its port alone: grpcio's default would let a second server share it."""
    if max_request_bytes is None:
        receive = MAX_MESSAGE_BYTES
    else:
        receive = max_request_bytes + REQUEST_SLACK_BYTES
    return grpc.aio.server(
        interceptors=[*gates, RequestChecks(max_request_bytes)],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", receive),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )


def router_limits(config: ServeConfig) -> Limits:
    return Limits(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Limits)})


def _listen(server: grpc.aio.Server, config: ServeConfig, credentials=None) -> int:
    """The port bound (config.port, or a free one for 0)."""
    address = f"{config.host}:{config.port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the address is not local")
    return bound


def internal_secret(config: ServeConfig) -> str:
    secret = read_secret(config.internal_secret_file)
    if secret is None:
        raise ValueError(
            "the internal services need the deployment's secret: set REF_SERVER_INTERNAL_SECRET "
            "or --internal-secret-file (--role all makes one and hands it to its children)"
        )
    return secret


async def _until(stop: asyncio.Event | None) -> None:
    """Until `stop` is set, SIGINT or SIGTERM, or the supervisor that started this process
    is gone (no orphans when `--role all` is killed outright)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    supervisor = os.environ.get(SUPERVISOR_ENV)
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        if supervisor and os.getppid() != int(supervisor):
            log.warning("the supervisor (pid %s) is gone: stopping", supervisor)
            stop.set()


async def run_instance(
    config: ServeConfig,
    secret: str,
    engine: Engine,
    members: Membership | None = None,
    stop: asyncio.Event | None = None,
):
    """Serve `engine` until `stop` (or a signal); members: an elastic instance's, whose
    process then also ends when its engine loop stops for good (a supervisor sees it)."""
    aio_loop = asyncio.get_running_loop()
    health_service = health.aio.HealthServicer()
    stop = stop or asyncio.Event()

    def failed() -> None:  # the ranks lost each other: out of service for good
        for name in health_names(""):
            asyncio.run_coroutine_threadsafe(health_service.set(name, NOT_SERVING), aio_loop)
        if members is not None:
            aio_loop.call_soon_threadsafe(stop.set)

    loop = EngineLoop(engine, config.hold_seconds, members, on_failure=failed)
    args, cache = engine.model.args, engine.runner.cache
    info = pb.InstanceInfo(
        role=config.role,
        model=config.model_name,
        model_fingerprint=model_fingerprint(config),
        num_layers=args.num_hidden_layers,
        page_size=cache.page_size,
        cache_width=args.cache_width,
        cache_dtype=str(cache.dtype).removeprefix("torch."),
        max_running=config.max_num_seqs,
        rank=config.rank,
        ranks=config.ranks,
        speculative=engine.draft_tokens > 0,
    )
    server = grpc_server(config, [secret_gate(secret)])
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    if config.role == "prefill":
        rpc.add_InstanceServicer_to_server(InstanceService(loop, info), server)
        puller = None
        service = PrefillService(loop, config.max_model_len)
        rpc.add_PrefillServicer_to_server(service, server)
        rpc.add_KvTransferServicer_to_server(service, server)
    else:
        puller = KvPuller(engine.runner, secret, config.kv_transfer)
        rpc.add_InstanceServicer_to_server(InstanceService(loop, info, puller), server)
        rpc.add_DecodeServicer_to_server(DecodeService(loop, config.max_model_len, puller), server)
    port = _listen(server, config)
    await server.start()
    for name in health_names(""):
        await health_service.set(name, SERVING)
    print(f"ref-server {config.role}: serving on {config.host}:{port}", flush=True)
    try:
        await _until(stop)
    finally:
        await health_service.enter_graceful_shutdown()
        await server.stop(grace=2)
        try:
            if puller is not None:
                await puller.close()
        except Exception:  # NIXL's own errors among them: the engine stops all the same
            log.exception("closing the KV puller failed")
        finally:
            loop.stop()


async def run_router(config: ServeConfig, secret: str, stop=None) -> None:
    facts, tokenizer = model_facts(config)
    metrics = Metrics()
    keys = ApiKeys(read_api_keys(config.api_key_file), config.isolate_cache)
    credentials = server_credentials(config.tls_cert, config.tls_key)
    health_service = health.aio.HealthServicer()
    serving = False

    async def show() -> None:
        nonlocal serving
        serving = not pool.problem
        status = SERVING if serving else NOT_SERVING
        for name in health_names("", ROUTER_SERVICE):
            await health_service.set(name, status)
        metrics.show_workers(pool.workers)

    args = model_args(config)
    expected = Expected(
        model_fingerprint(config),
        args.num_hidden_layers,
        config.block_size,
        args.cache_width,
        speculative=config.speculative == "mtp",
    )
    pool = WorkerPool(
        config.prefill,
        config.decode,
        expected,
        secret,
        on_update=lambda: background(show()),
        interval=config.health_interval_s,
        failures=config.health_failures,
        policy=PrefillPolicy(
            config.cache_threshold, config.balance_abs_threshold, config.balance_rel_threshold
        ),
        prefix_index_pages=config.prefix_index_pages,
    )
    router = Router(pool, facts, tokenizer, metrics, router_limits(config))
    gates = [api_key_gate(keys)] if keys.required else []
    server = grpc_server(config, gates, config.max_request_bytes)
    service = RouterService(router, keys, lambda: serving)
    rpc.add_RouterServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    names = [ROUTER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = _listen(server, config, credentials)
    http = None
    if config.http_port:
        from ref_server.services.http_server import HttpServer, create_app

        app = create_app(router, keys, lambda: serving, metrics, config.max_request_bytes)
        http = HttpServer(app, config.host, config.http_port, config.tls_cert, config.tls_key)
    await server.start()
    await pool.start()
    await show()
    http_task = asyncio.create_task(http.serve()) if http else None
    print(f"ref-server router: serving on {config.host}:{port}", flush=True)
    try:
        await _until(stop)
    finally:
        await health_service.enter_graceful_shutdown()
        if http is not None:
            http.should_exit = True
            await http_task
        await server.stop(grace=2)
        await router.close()
        await pool.close()


def serve(config: ServeConfig) -> None:
    """Run this config's process until SIGINT or SIGTERM. What is missing (the secret, the
    device) is said before the slow parts (joining the ranks, loading the model)."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    secret = internal_secret(config)
    if config.role == "router":
        asyncio.run(run_router(config, secret))
        return
    torch_device(config)
    slots = expert_slots(config, model_args(config))
    members = membership(config)
    # no name here holds the group: an elastic instance drops it to close its connections
    model = load_model(config, None if config.join else join_group(config, members), slots)
    if members is not None:  # buffers built from now on wait as long as the group
        model.expert_parallel.timeout = members.timeout
    thresholds = Thresholds(config.two_batch_decode_tokens, config.two_batch_prefill_tokens)
    engine = Engine(
        model,
        scheduler_config(config),
        two_batch=config.two_batch,
        thresholds=thresholds,
        eplb=eplb(config),
        prefill_graph_tokens=config.prefill_graph_tokens,
        overlap_steps=config.overlap_steps,
        draft_tokens=config.draft_tokens if config.speculative == "mtp" else 0,
    )
    if config.join:  # the running ranks take it in between two of their steps
        sources = members.wait_admitted()
        engine.regroup(members.join(), sources)
    if members is not None:
        members.ready()
    asyncio.run(run_instance(config, secret, engine, members))
