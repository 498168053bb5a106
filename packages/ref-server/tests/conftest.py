"""Tiny DeepSeek-V3 and V3.2 checkpoints written by `transformers` (the independent reference),
for tests through the `checkpoints` fixture; deployment helpers shared by the CPU and GPU serving
tests through `serving`.

REF_SERVER_TEST_OVERLAP_STEPS=on runs the tests with overlapped engine steps wherever an engine
leaves `overlap_steps` to "auto" and may overlap them: engines built in the test process, and
instances started from `tiny_config`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import ref_server.model as M
from ref_server.client import Client
from ref_server.model import StepBatch
from ref_server.services.config import ServeConfig
from ref_server.services.deployment import Deployment, free_port

YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def hf_config(v32: bool = False, **overrides):
    """kv_lora_rank 512 and rope 64, so decode runs through mla_kernels; small elsewhere. v32: a
    DeepSeek-V3.2 config, whose indexer picks 8 tokens with 8 heads of 128 (64 of them rope)."""
    from transformers import DeepseekV3Config, DeepseekV32Config

    values = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=48,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=24,
        max_position_embeddings=512,
        rope_parameters=YARN,
        bos_token_id=0,
        eos_token_id=1,
    )
    if v32:
        values |= dict(index_topk=8, index_n_heads=8, index_head_dim=128)
    values.update(overrides)
    return (DeepseekV32Config if v32 else DeepseekV3Config)(**values)


def write_checkpoint(path: Path, seed: int = 0, v32: bool = False, **overrides):
    """A random transformers model (v32: DeepSeek-V3.2) saved to `path`; returns it (eval
    mode)."""
    from transformers import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    kind = DeepseekV32ForCausalLM if v32 else DeepseekV3ForCausalLM
    model = kind(hf_config(v32, **overrides)).eval()
    with torch.no_grad():  # norms, routing bias and head away from their defaults
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(1.0, 0.1)
            elif name.endswith("norm.bias"):
                parameter.normal_(0.0, 0.1)
            elif name == "lm_head.weight":
                parameter.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def quantize_blocks(weight: torch.Tensor, block: int = 128):
    """e4m3 values and one fp32 scale_inv per block x block tile (DeepSeek's FP8 layout)."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = torch.zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block, grid[1], block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    values = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return values.view(padded.shape)[:rows, :cols].contiguous(), scale


# What DeepSeek's checkpoints store in FP8: the projections, V3.2's indexer's wq_b and wk included,
# but not its weights_proj.
FP8_WEIGHTS = ("_proj.weight", "mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight")


def to_fp8_sharded(source: Path, target: Path, shards: int = 2) -> dict[str, torch.Tensor]:
    """Rewrite a checkpoint with FP8 projection weights in `shards` files plus an index;
    returns the dequantized weights the FP8 checkpoint stands for."""
    tensors = load_file(source / "model.safetensors")
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    out, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(FP8_WEIGHTS) and not name.endswith("weights_proj.weight"):
            values, scale = quantize_blocks(tensor)
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = values, scale
            expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            dequantized[name] = values.float() * expanded[: tensor.shape[0], : tensor.shape[1]]
        else:
            out[name] = dequantized[name] = tensor
    names = sorted(out)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: out[n].contiguous() for n in names[i::shards]}
        save_file(part, target / file)
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return dequantized


@pytest.fixture
def checkpoints() -> SimpleNamespace:
    """write(path, seed, v32, **config overrides), config(v32, **overrides) (transformers'
    config alone) and to_fp8_sharded(source, target)."""
    return SimpleNamespace(write=write_checkpoint, config=hf_config, to_fp8_sharded=to_fp8_sharded)


@torch.no_grad()
def cached_logits(reference, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The reference's logits `[len(completion), vocab]` before each completion token, through
    a paged cache as an engine computes them: the prompt's prefill, then a decode step a token
    (for V3.2 with FP8 index keys, which the full pass does not quantize)."""
    device = reference.embed_tokens.weight.device
    pages = -(-(len(prompt) + len(completion)) // 16)
    cache = M.PagedKVCache(reference.args, pages, 16, device=device)
    table = torch.arange(pages, dtype=torch.int32)[None]
    steps = [(prompt, len(prompt))]
    steps += [([token], len(prompt) + i + 1) for i, token in enumerate(completion[:-1])]
    rows = [
        reference.forward_step(
            StepBatch(torch.tensor(ids, device=device), [len(ids)], [n], table), cache
        )
        for ids, n in steps
    ]
    return torch.cat(rows).float().cpu()


def near_greedy(reference, prompt: list[int], completion: list[int]) -> bool:
    """Each generated token is the reference's greedy choice, or within 3 % of the logit range
    of it (an expert-parallel instance moves its MoE rows in bf16)."""
    logits = cached_logits(reference, prompt, completion)
    chosen = logits[torch.arange(len(completion)), completion]
    return bool((logits.max(dim=-1).values - chosen <= 0.03 * (logits.max() - logits.min())).all())


def generate_together(client: Client, requests: list[dict], timeout: float = 60) -> list:
    """Every request's result (each a dict of Client.generate keywords), all sent at once."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(lambda kw: client.generate(timeout=timeout, **kw), requests))


FAULTS = Path(__file__).with_name("faults")  # faults and hooks for processes the tests start
# Prompts (and max_tokens) whose greedy continuations a speculative deployment drafts right by
# the oracle (but at every fifth position): accepted runs of up to 4 tokens. Their positions do
# not overlap.
DRAFTED = {(5, 6, 7): 40, tuple(range(100, 230)): 30}


def draft_oracle():
    """`faults/sitecustomize.py`'s `draft_oracle`."""
    spec = importlib.util.spec_from_file_location("faults", FAULTS / "sitecustomize.py")
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    return faults.draft_oracle


@pytest.fixture
def oracle():
    """`faults/sitecustomize.py`'s `draft_oracle`: speculative decoding's tests monkeypatch
    `speculative.propose` with it."""
    return draft_oracle()


def oracle_drafts(reference) -> dict[int, int]:
    """The token the oracle drafts at each position: the reference's greedy continuations of
    DRAFTED's prompts."""
    drafts = {}
    for prompt, max_tokens in DRAFTED.items():
        want = reference.generate([list(prompt)], M.SamplingParams(max_tokens=max_tokens))[0]
        drafts |= {len(prompt) + i: t for i, t in enumerate(want)}
    return drafts


def drafting_by_oracle(config: ServeConfig, reference, folder: Path) -> Deployment:
    """`config`'s deployment with `--speculative mtp`, drafting by the oracle (the reference's
    tokens, `oracle_drafts`) instead of the MTP module, whose random weights draft almost
    nothing right."""
    path = folder / "drafts.json"
    path.write_text(json.dumps(oracle_drafts(reference)))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]))
        env.setenv("REF_SERVER_TEST_DRAFTS", str(path))
        return Deployment(config.replace(speculative="mtp"), startup_timeout=120)


def drafts_as_one_engine(running: Deployment, reference) -> None:
    """DRAFTED's prompts through a deployment `drafting_by_oracle`, one at a time: the
    reference's greedy tokens, and the decode instance's drafting stats equal one engine's
    (prefill and decode in one) drafting by the same oracle. So each request's first decode
    step verified drafts, made from the prompt's last hidden state the prefill instance
    handed over; without it, the first step would verify none and every round after would
    start a token later."""
    import ref_server.model.speculative as S
    from ref_server.engine import Engine, SchedulerConfig

    config = running.config
    args = dataclasses.replace(reference.args, num_nextn_predict_layers=1)
    engine = Engine(
        M.from_args(args, seed=config.seed),
        SchedulerConfig(num_blocks=96, block_size=config.block_size, max_model_len=512),
        draft_tokens=config.draft_tokens,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(S, "propose", draft_oracle()(oracle_drafts(reference), wrong_every=5))
        with Client(running.address) as client:
            for prompt, max_tokens in DRAFTED.items():
                params = M.SamplingParams(max_tokens=max_tokens)
                want = reference.generate([list(prompt)], params)[0]
                assert engine.generate([list(prompt)], params)[0] == want
                got = client.generate(list(prompt), temperature=0, max_tokens=max_tokens)
                assert got.token_ids == want
            stats = engine.speculative_stats

            def decode_load():  # as the router last read it, once it counts every request
                load = next(w.load for w in client.server_info().workers if w.role == "decode")
                return load if load.accepted_length == stats.accepted_length else None

            load = wait_until(decode_load, 3, f"the decode instance's stats to be {stats}")
    assert load.draft_acceptance_rate == stats.acceptance_rate
    assert 0.3 < stats.acceptance_rate < 1 and stats.accepted_length > 1.3


OVERLAP_STEPS_FORCED = os.environ.get("REF_SERVER_TEST_OVERLAP_STEPS") == "on"


@pytest.fixture(autouse=True)
def overlap_steps_forced(monkeypatch):
    """With REF_SERVER_TEST_OVERLAP_STEPS=on, "auto" means "on" for every engine that allows it."""
    if not OVERLAP_STEPS_FORCED:
        return
    from ref_server.engine import engine

    built = engine.Engine.__init__

    def build(self, model, config, overlap_steps="auto", **options):
        refusal = engine.overlap_refusal(model, options.get("eplb"))
        if overlap_steps == "auto" and not refusal and not options.get("draft_tokens"):
            overlap_steps = "on"
        built(self, model, config, overlap_steps, **options)

    monkeypatch.setattr(engine.Engine, "__init__", build)


def tiny_config(**overrides) -> ServeConfig:
    """The tiny preset on CPU, small pages (so prompts span several), free ports, health
    checked often (so tests see changes quickly)."""
    values = dict(
        port=free_port(),
        http_port=free_port(),
        preset="tiny",
        seed=4,
        device="cpu",
        num_blocks=96,
        block_size=16,
        max_model_len=512,
        max_num_seqs=80,
        health_interval_s=0.25,
    )
    config = ServeConfig(**(values | overrides))
    # where "on" is allowed
    one_rank = config.ranks == 1 and not config.eplb_interval and config.speculative == "off"
    if OVERLAP_STEPS_FORCED and config.overlap_steps == "auto" and one_rank:
        return config.replace(overlap_steps="on")
    return config


def wait_until(condition, timeout: float, what: str):
    """condition()'s first truthy value within timeout; AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def idle(client: Client) -> bool:
    """No instance holds a page, runs or queues a request (as the router last saw them)."""
    info = client.server_info()
    return all(
        w.load.kv_usage == 0 and w.load.held == 0 and w.load.running == 0 and w.load.waiting == 0
        for w in info.workers
    ) and bool(info.workers)


def wait_idle(client: Client, timeout: float = 3.0) -> None:
    """Every page free again soon (the router's view lags its health interval)."""
    wait_until(lambda: idle(client), timeout, f"pages free again: {client.server_info()}")


def instances_of_two_ranks(config: ServeConfig, reference, batch_invariant: bool = True) -> None:
    """Prefill and decode instances of two ranks each: data-parallel attention, MoE layers
    expert-parallel over gloo. Requests sent one at a time all land on rank 0 of each instance
    (the balancers' ties), so rank 1 serves its experts through idle steps; sent together they
    spread over both ranks. Every completion is the reference's greedy tokens within the bf16
    rounding of the exchange (with --speculative mtp, both decode ranks verified drafts). With
    batch_invariant (CPU float32, where a token's result does not depend on its batch), a
    prompt gets the same tokens alone or among others."""
    running = Deployment(config, startup_timeout=300)
    try:
        client = Client(running.address)
        roles = sorted(w.role for w in client.server_info().workers)
        assert roles == ["decode", "decode", "prefill", "prefill"]
        prompts = [list(range(3, 3 + n)) for n in (4, 20, 70)]
        alone = [
            client.generate(p, temperature=0, max_tokens=12, timeout=60).token_ids for p in prompts
        ]
        for prompt, completion in zip(prompts, alone, strict=True):
            assert len(completion) > 0 and near_greedy(reference, prompt, list(completion))
        together = [
            r.token_ids
            for r in generate_together(
                client, [dict(prompt=p, max_tokens=12, temperature=0) for p in prompts * 3]
            )
        ]
        if batch_invariant:
            assert together == alone * 3
        for i, completion in enumerate(together):
            assert near_greedy(reference, prompts[i % len(prompts)], list(completion))
        if config.speculative == "mtp":

            def drafted() -> bool:  # as the router last read the loads
                workers = client.server_info().workers
                return all(w.load.accepted_length >= 1 for w in workers if w.role == "decode")

            wait_until(drafted, 3, "drafts verified on both decode ranks")
        if config.eplb_interval:

            def balanced() -> bool:
                workers = client.server_info().workers
                return all(w.load.expert_rebalances > 0 for w in workers if w.role == "decode")

            wait_until(balanced, 3, "experts placed anew on both decode ranks")
        client.close()
    finally:
        running.stop()


@pytest.fixture(scope="session")
def serving():
    return SimpleNamespace(
        instances_of_two_ranks=instances_of_two_ranks,
        drafted=DRAFTED,
        drafting_by_oracle=drafting_by_oracle,
        drafts_as_one_engine=drafts_as_one_engine,
        near_greedy=near_greedy,
        generate_together=generate_together,
        config=tiny_config,
        wait_until=wait_until,
        wait_idle=wait_idle,
        idle=idle,
    )


@pytest.fixture(scope="session")
def deployment_of():
    """deployment_of(preset): one `--role all` deployment of that preset (`tiny_config`'s
    settings), started on first use and shared by the serving tests."""
    running: dict[str, Deployment] = {}

    def get(preset: str) -> Deployment:
        if preset not in running:
            running[preset] = Deployment(tiny_config(preset=preset), startup_timeout=120)
        return running[preset]

    yield get
    for deployment in running.values():
        deployment.stop()


@pytest.fixture(scope="session")
def tiny_deployment(deployment_of):
    return deployment_of("tiny")


@pytest.fixture
def in_triton_interpreter(tmp_path):
    """Runs a test file as a script (its `__main__` checks) in a child process with Triton's
    interpreter on, which must be so before triton is first imported (torch imports it early);
    fails with the child's output. Then compiles every kernel variant the child launched for the
    H200 (sm_90, with programmatic dependent launch) ahead of time, here: the interpreter
    accepts code that Triton's compiler rejects (a loop that gives a variable another shape, one
    such kernel failed on the GPU only). Skips without triton."""
    pytest.importorskip("triton")

    def run(path: str) -> None:
        launches = tmp_path / "launches.jsonl"
        script = (
            f"import runpy, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import conftest; conftest.record_triton_launches({str(launches)!r}); "
            f"runpy.run_path({path!r}, run_name='__main__')"
        )
        child = subprocess.run(
            [sys.executable, "-c", script],
            env=os.environ | {"TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert child.returncode == 0, child.stdout + child.stderr
        failures = compile_for_sm90(launches.read_text().splitlines() if launches.exists() else [])
        assert not failures, "\n\n".join(failures)

    return run


TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def _triton_type(value) -> str | None:
    """A run-time argument's type in Triton's signature notation; None: not a run-time one."""
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPES[value.dtype]
    if type(value).__name__ == "TensorDescriptor":
        shape = ", ".join(str(size) for size in value.block_shape)
        return f"tensordesc<{TRITON_TYPES[value.base.dtype]}[{shape}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def record_triton_launches(path: str) -> None:
    """In a process under Triton's interpreter: append each kernel launch's function, argument
    types, constexpr values and launch options to `path` (JSON lines)."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    interpreted_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        names = list(inspect.signature(self.fn).parameters)
        bound = dict(zip(names, args, strict=False)) | kwargs
        options = {key: bound.pop(key) for key in ("num_warps", "num_stages") if key in bound}
        signature, constexprs = {}, {}
        for name in names:
            if name not in bound:
                continue  # a default
            annotation = str(inspect.signature(self.fn).parameters[name].annotation)
            kind = None if "constexpr" in annotation else _triton_type(bound[name])
            if kind is None:
                signature[name], constexprs[name] = "constexpr", bound[name]
            else:
                signature[name] = kind
        launch = dict(
            module=self.fn.__module__,
            name=self.fn.__name__,
            signature=signature,
            constexprs=constexprs,
            options=options,
        )
        with open(path, "a") as f:
            f.write(json.dumps(launch, default=repr) + "\n")
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


_COMPILED_FOR_SM90: set[str] = set()  # launches compiled in this session, across test files


def compile_for_sm90(launches: list[str]) -> list[str]:
    """Compiles each distinct recorded launch (`record_triton_launches`) for sm_90 with
    programmatic dependent launch on; the compiler's errors, one string per failed launch."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    failures = []
    for line in dict.fromkeys(launches):
        if line in _COMPILED_FOR_SM90:
            continue
        launch = json.loads(line)
        constexprs = launch["constexprs"] | ({"PDL": True} if "PDL" in launch["constexprs"] else {})
        module = importlib.import_module(launch["module"])
        for make in ("_triton_kernel", "_triton_kernels"):  # jits the kernels' helpers too
            if hasattr(module, make):
                getattr(module, make)()
        kernel = JITFunction(getattr(module, launch["name"]))
        source = ASTSource(fn=kernel, signature=launch["signature"], constexprs=constexprs)
        try:
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
        except Exception as error:  # the compiler's, whatever their type
            failures.append(f"{launch['name']} {launch['constexprs']}: {error}")
        _COMPILED_FOR_SM90.add(line)
    return failures


def _term_rows(data):
    """Every serialized `ref_server.repro.Term` (a dict with value, unit, source and note) in a
    JSON document, depth first."""
    if isinstance(data, dict):
        if {"value", "unit", "source", "note"} <= data.keys():
            yield data
        for value in data.values():
            yield from _term_rows(value)
    elif isinstance(data, list):
        for value in data:
            yield from _term_rows(value)


@pytest.fixture
def term_rows():
    """`_term_rows`: the serialized terms of a repro JSON document."""
    return _term_rows
