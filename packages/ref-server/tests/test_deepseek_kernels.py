"""The `kernels` option on the CPU: its values and errors, `ours` as the default, and the
adapters to DeepSeek's libraries against stand-ins that have their signatures and checks
(`deepseek_fakes.py`): decode attention (FlashMLA), the FP8 GEMMs in their three layouts
(DeepGEMM), the exchange's buffer (DeepEP), in the model, in `ref-server repro` and in
bench_model.py's side-by-side table."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ref_server.model as M
from ref_server import cli, kernel_choice
from ref_server.kernel_choice import KernelsUnavailable, parse, parse_list
from ref_server.kernels.deepseek import DeepGemm
from ref_server.kernels.fp8_cast import quantize_activations, quantize_blocks
from ref_server.model import kernel_set
from ref_server.model.attention import MLA_KERNELS
from ref_server.model.expert_parallel import ExpertParallel
from ref_server.model.fp8 import FP8Experts, FP8Linear, fp8_block_gemm
from ref_server.model.step import StepBatch
from ref_server.services.config import ServeConfig


def load(path: Path):
    """A module by path: this folder's helpers (tests import as `--import-mode=importlib`) or
    a benchmark script."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HERE = Path(__file__).parent
fakes = load(HERE / "deepseek_fakes.py")
LIBRARIES = ("flash_mla", "deep_gemm", "deep_ep")


@pytest.fixture
def deepseek(monkeypatch):
    """The stand-ins importable as DeepSeek's libraries, and allowed on the CPU they run on."""
    modules = SimpleNamespace(**{name: getattr(fakes, name)() for name in LIBRARIES})
    for name in LIBRARIES:
        monkeypatch.setitem(sys.modules, name, getattr(modules, name))
    monkeypatch.setattr(kernel_set, "DEVICE_TYPES", ("cuda", "cpu"))
    return modules


@pytest.fixture
def missing(monkeypatch):
    """None of DeepSeek's libraries imports."""
    for name in LIBRARIES:
        monkeypatch.setitem(sys.modules, name, None)


# -------------------------------------------------------------------------- the option


def test_kernel_values_parse_and_lists_keep_a_sets_parts_together():
    assert parse("ours").parts == () and not parse("ours").named
    assert parse("deepseek").parts == ("attention", "gemm", "exchange")
    assert parse("deepseek:gemm,attention").parts == ("attention", "gemm")
    assert parse("deepseek:gemm,attention").named
    specs = [c.spec for c in parse_list("ours,deepseek:attention,gemm,deepseek")]
    assert specs == ["ours", "deepseek:attention,gemm", "deepseek"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("foo", "unknown kernels 'foo': expected ours, deepseek or deepseek:PART[,PART...]"),
        ("deepseek:", "kernels 'deepseek:': unknown parts ['']"),
        (
            "deepseek:attn",
            "unknown parts ['attn']; the parts are ('attention', 'gemm', 'exchange')",
        ),
        ("deepseek:gemm,gemm", "kernels 'deepseek:gemm,gemm' names a part twice"),
        ("Ours", "unknown kernels 'Ours'"),
        ("ours,ours", "kernels 'ours,ours' names a set twice"),
        ("ours,attention", "unknown kernels 'attention'"),
    ],
)
def test_bad_kernel_values_are_named(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_list(text)


def test_a_model_runs_deepseeks_parts_where_it_has_them_and_a_named_missing_part_is_an_error():
    everything = parse("deepseek")
    assert everything.parts_in(fp8=False, expert_parallel=False) == ("attention",)
    assert everything.parts_in(fp8=True, expert_parallel=True) == kernel_choice.PARTS
    assert parse("deepseek:attention,exchange").parts_in(fp8=True, expert_parallel=True) == (
        "attention",
        "exchange",
    )
    with pytest.raises(ValueError, match=r"gemm: its weights are not FP8.*exchange: its experts"):
        parse("deepseek:gemm,exchange").parts_in(fp8=False, expert_parallel=False)


def test_ours_is_the_default_and_takes_none_of_deepseeks_libraries():
    default = M.from_preset("tiny", seed=3, weight_dtype="fp8")
    ours = M.from_preset("tiny", seed=3, weight_dtype="fp8", kernels="ours")
    assert default.kernels == ours.kernels == kernel_set.OURS
    assert default.kernels.describe() == "ours (ref-server's kernels, mla_kernels, ep_comm)"
    assert all(layer.self_attn.decode is MLA_KERNELS for layer in default.layers)
    fp8 = [m for m in default.modules() if isinstance(m, (FP8Linear, FP8Experts))]
    assert fp8 and all(m.gemm is fp8_block_gemm for m in fp8)
    assert not set(LIBRARIES) & set(sys.modules)
    batches = steps(default.args, lengths=(9, 3), decodes=2)
    for got, want in zip(run(default, batches), run(ours, batches), strict=True):
        assert torch.equal(got, want)


def test_a_missing_library_is_one_line_naming_it_and_where_to_get_it(missing):
    with pytest.raises(KernelsUnavailable) as caught:
        M.from_preset(  # refused before the model touches CUDA
            "tiny", kernels="deepseek", device="cuda", dtype=torch.bfloat16, weight_dtype="fp8"
        )
    [line] = str(caught.value).splitlines()
    assert line.startswith("kernels 'deepseek': flash_mla (FlashMLA, decode attention) does not ")
    assert "deep_gemm (DeepGEMM, FP8 GEMMs) does not import (ModuleNotFoundError" in line
    assert "build it from https://github.com/deepseek-ai/DeepGEMM" in line
    assert "deep_ep" not in line  # one rank: no exchange asked for
    assert line.endswith("or choose kernels 'ours'")


def test_with_one_library_missing_the_error_offers_the_others(deepseek, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    with pytest.raises(KernelsUnavailable, match=r"or choose kernels 'deepseek:attention'$"):
        kernel_set.resolve(
            "deepseek", device="cuda", dtype=torch.bfloat16, fp8=True, expert_parallel=False
        )


def test_a_library_that_fails_to_import_gives_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "flash_mla").mkdir()
    (tmp_path / "flash_mla" / "__init__.py").write_text("raise AssertionError('Invalid NCCL')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KernelsUnavailable, match=r"\(AssertionError: Invalid NCCL\): build it"):
        kernel_set.resolve(
            "deepseek:attention",
            device="cuda",
            dtype=torch.bfloat16,
            fp8=False,
            expert_parallel=False,
        )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (dict(device="cpu"), "kernels 'deepseek': DeepSeek's libraries run on CUDA, not on cpu"),
        (
            dict(device="cuda", weight_dtype="fp8"),
            "DeepGEMM's FP8 GEMMs write torch.bfloat16; build the model in it, not in torch.float32",
        ),
        (dict(device="cuda", kernels="deepseek:exchange"), "exchange: its experts are on one rank"),
        (dict(device="cuda", kernels="deepseek;gemm"), "unknown kernels 'deepseek;gemm'"),
    ],
)
def test_kernels_that_cannot_run_are_refused_when_the_model_is_built(build, message):
    build = {"kernels": "deepseek", **build}
    with pytest.raises(ValueError, match=message):
        M.from_preset("tiny", **build)


def test_serving_checks_the_kernels_before_anything_starts(missing, capsys):
    assert ServeConfig().kernels == "ours"
    for settings, message in (
        (
            dict(kernels="deepseek", device="cpu"),
            "kernels 'deepseek' run on CUDA, not on device cpu",
        ),
        (
            dict(kernels="deepseek", block_size=16),
            "FlashMLA reads pages of 64 tokens, not block_size 16",
        ),
        (dict(kernels="deepseek:gemm"), "names parts this model does not have: gemm"),
        (dict(kernels="fast"), "unknown kernels 'fast'"),
    ):
        with pytest.raises(ValueError, match=message):
            ServeConfig(**settings)
    assert ServeConfig(kernels="deepseek", weight_dtype="fp8").kernel_parts() == (
        "attention",
        "gemm",
    )
    assert ServeConfig(kernels="deepseek", ranks=2, rank=1, group_address="h:1").kernel_parts() == (
        "attention",
        "exchange",
    )
    assert cli.main(["serve", "--kernels", "deepseek", "--http-port", "0"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("ref-server serve: error: kernels 'deepseek': flash_mla (FlashMLA")
    assert "no module named 'flash_mla'" in line


# -------------------------------------------------------------------------- the model


def steps(args, lengths, decodes, seed=0) -> list[StepBatch]:
    """A cached prefill of sequences of `lengths` tokens, then `decodes` decode steps, each
    sequence on its own pages of 64 tokens (a sequence of more than 64 spans two)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(n + decodes) // 64) for n in lengths]
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    for row, count in enumerate(pages):
        table[row, :count] = torch.arange(sum(pages[:row]), sum(pages[: row + 1]))
    ids = torch.randint(2, args.vocab_size, (sum(lengths),), generator=g)
    batches = [StepBatch(ids, list(lengths), list(lengths), table)]
    for step in range(1, decodes + 1):
        token = torch.randint(2, args.vocab_size, (len(lengths),), generator=g)
        batches.append(StepBatch(token, [1] * len(lengths), [n + step for n in lengths], table))
    return batches


def run(model, batches, page_size=64, cache_dtype=torch.bfloat16) -> list[torch.Tensor]:
    pages = int(batches[0].block_table.max()) + 1
    cache = M.PagedKVCache(model.args, pages, page_size, cache_dtype)
    return [model.forward_step(batch, cache) for batch in batches]


def test_decode_attention_through_flash_mla_matches_ours(deepseek):
    """Two sequences, one over two pages: FlashMLA's decode (float64 in the stand-in) gives
    ours' logits; one schedule per step, filled by the first layer and reused by the others."""
    ours = M.from_preset("tiny", seed=1, dtype=torch.bfloat16)
    theirs = M.from_preset("tiny", seed=1, dtype=torch.bfloat16, kernels="deepseek")
    assert theirs.kernels.describe() == "deepseek (FlashMLA for decode attention; ours elsewhere)"
    batches = steps(ours.args, lengths=(70, 5), decodes=3)
    for got, want in zip(run(theirs, batches), run(ours, batches), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    calls = deepseek.flash_mla.calls
    layers = ours.args.num_hidden_layers
    assert [c[0] for c in calls] == (["get_mla_metadata"] + ["flash_mla_with_kvcache"] * layers) * 3
    heads = ours.args.num_attention_heads
    assert calls[1][1:] == ((2, 1, heads, 576), (4, 64, 1, 576))  # 3 pages + the padding one


@pytest.mark.parametrize(
    ("page_size", "dtype", "message"),
    [
        (16, torch.bfloat16, "kernels 'deepseek': FlashMLA reads pages of 64 tokens, not 16"),
        (64, torch.float16, r"FlashMLA reads caches in torch\.bfloat16, not torch\.float16"),
    ],
)
def test_flash_mla_refuses_caches_it_cannot_read(deepseek, page_size, dtype, message):
    model = M.from_preset("tiny", seed=1, dtype=torch.bfloat16, kernels="deepseek")
    batches = steps(model.args, lengths=(4,), decodes=1)
    with pytest.raises(ValueError, match=message):
        run(model, batches, page_size, dtype)
    assert not deepseek.flash_mla.calls


def quantized(shape, generator):
    """Random weights `[..., n, k]` in FP8 with their 128 x 128 block scales."""
    return quantize_blocks(torch.randn(shape, generator=generator))


def activations(shape, generator):
    """Random bf16 activations cast per token and 128 channels."""
    return quantize_activations(torch.randn(shape, generator=generator).bfloat16())


def test_deep_gemm_dense_layout_matches_ours(deepseek):
    g = torch.Generator().manual_seed(2)
    x, w = activations((2, 3, 200), g), quantized((136, 200), g)
    got = DeepGemm(deepseek.deep_gemm)(*x, *w, None, torch.bfloat16)
    torch.testing.assert_close(got, fp8_block_gemm(*x, *w, None, torch.bfloat16))
    assert deepseek.deep_gemm.calls == [("fp8_gemm_nt", (6, 200), (136, 200))]


def test_deep_gemm_contiguous_layout_takes_each_group_at_its_aligned_start(deepseek):
    """Rows grouped by expert, one group empty, rows past the groups (another rank's): each
    group's rows go to the padded layout and come back in order; none the kernel left alone."""
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 130, 1]
    offsets = torch.tensor(counts).cumsum(0).int()
    x, w = activations((sum(counts) + 7, 256), g), quantized((4, 48, 256), g)
    got = DeepGemm(deepseek.deep_gemm)(*x, *w, offsets, torch.bfloat16)
    want = fp8_block_gemm(*x, *w, offsets, torch.bfloat16)
    rows = int(offsets[-1])
    torch.testing.assert_close(got[:rows], want[:rows])
    assert deepseek.deep_gemm.calls == [
        ("m_grouped_fp8_gemm_nt_contiguous", (143 + 4 * 127, 256), 4)
    ]


def test_deep_gemm_masked_layout_takes_the_counts(deepseek):
    g = torch.Generator().manual_seed(4)
    x, w = activations((3, 8, 128), g), quantized((3, 64, 128), g)
    counts = torch.tensor([8, 0, 5], dtype=torch.int32)
    got = DeepGemm(deepseek.deep_gemm)(*x, *w, None, torch.bfloat16, counts)
    want = fp8_block_gemm(*x, *w, None, torch.bfloat16, counts)
    for e, count in enumerate(counts.tolist()):
        torch.testing.assert_close(got[e, :count], want[e, :count])
    assert deepseek.deep_gemm.calls == [("m_grouped_fp8_gemm_nt_masked", (3, 8, 128), 8)]


def test_deep_gemm_writes_bf16_only(deepseek):
    g = torch.Generator().manual_seed(5)
    x, w = activations((4, 128), g), quantized((64, 128), g)
    with pytest.raises(
        ValueError, match=r"DeepGEMM's FP8 GEMMs write torch\.bfloat16, not torch\.float32"
    ):
        DeepGemm(deepseek.deep_gemm)(*x, *w, None, torch.float32)


def test_fp8_experts_packed_rows_go_through_the_masked_layout(deepseek):
    """A low-latency dispatch's FP8 blocks with counts, through `FP8Experts.packed`."""
    g = torch.Generator().manual_seed(6)
    experts = [FP8Experts(4, 128, 64), FP8Experts(4, 128, 64, DeepGemm(deepseek.deep_gemm))]
    for name in ("gate_up_proj", "down_proj"):
        values, scales = quantized(getattr(experts[0], name).shape, g)
        for module in experts:
            getattr(module, name).copy_(values)
            getattr(module, name + "_scale_inv").copy_(scales)
    rows = activations((4, 6, 128), g)
    counts = torch.tensor([6, 2, 0, 3], dtype=torch.int32)
    want, got = (m.packed(rows, counts, torch.bfloat16) for m in experts)
    for e, count in enumerate(counts.tolist()):
        torch.testing.assert_close(got[e, :count], want[e, :count], rtol=2e-2, atol=2e-2)
    assert [c[0] for c in deepseek.deep_gemm.calls] == ["m_grouped_fp8_gemm_nt_masked"] * 2


def test_an_fp8_model_through_deepseeks_kernels_matches_ours(deepseek):
    """Every projection through DeepGEMM's dense GEMM, the routed experts through its
    contiguous layout, decode through FlashMLA: ours' logits, prefill and decode."""
    ours = M.from_preset("tiny", seed=7, dtype=torch.bfloat16, weight_dtype="fp8")
    theirs = M.from_preset(
        "tiny", seed=7, dtype=torch.bfloat16, weight_dtype="fp8", kernels="deepseek"
    )
    fp8 = [m for m in theirs.modules() if isinstance(m, (FP8Linear, FP8Experts))]
    assert all(isinstance(m.gemm, DeepGemm) for m in fp8)
    batches = steps(ours.args, lengths=(20, 66), decodes=2)
    for got, want in zip(run(theirs, batches), run(ours, batches), strict=True):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    kinds = {c[0] for c in deepseek.deep_gemm.calls}
    assert kinds == {"fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous"}
    assert len(deepseek.flash_mla.calls) == 2 * (1 + ours.args.num_hidden_layers)


# -------------------------------------------------------------------------- the exchange


def group(size: int, rank: int = 0):
    return SimpleNamespace(size=lambda: size, rank=lambda: rank)


def test_deep_ep_buffers_are_sized_as_deep_ep_asks(deepseek):
    ep = ExpertParallel(group(2), 8, 256, deep_ep=deepseek.deep_ep)
    [normal] = deepseek.deep_ep.buffers
    assert ep.buffer is normal and ep.capturable
    assert normal.num_nvl_bytes == 5 * 256 * 2 * 2  # the combine config's hint, the larger
    assert (normal.num_rdma_bytes, normal.low_latency_mode) == (0, False)
    assert normal.num_qps_per_rank == 4 and normal.explicitly_destroy
    assert ep.use_low_latency(7, 2)
    assert normal.destroyed
    low_latency = deepseek.deep_ep.buffers[-1]
    assert ep.buffer is low_latency and low_latency.low_latency_mode
    assert low_latency.num_rdma_bytes == 7 * 8 * 256 * 2 + 8  # T = 7 rounded up to 8
    ep.raise_if_failed()  # DeepEP keeps no failure to agree on
    ep.reset()
    assert low_latency.destroyed and ep.buffer is deepseek.deep_ep.buffers[-1]
    assert ep.buffer.low_latency_mode and len(deepseek.deep_ep.buffers) == 3


def test_deep_ep_refuses_rank_counts_it_has_no_config_for(deepseek):
    with pytest.raises(ValueError, match="DeepEP: Unsupported number of EP ranks: 3"):
        ExpertParallel(group(3), 9, 256, deep_ep=deepseek.deep_ep)


# -------------------------------------------------------------------------- side by side


def test_repro_sets_kernel_sets_side_by_side(deepseek, capsys):
    """The CPU's tiny slice through ours and through FlashMLA's decode (the stand-in): both
    reproductions in the JSON, their summaries in columns with the second over the first."""
    argv = ["repro", "--device", "cpu", "--reps", "1", "--zipf", "0", "--kernels", "ours,deepseek"]
    assert cli.main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["kernels"] == ["ours", "deepseek"]
    assert [run["kernels"] for run in document["runs"].values()] == ["ours", "deepseek"]
    inputs = document["runs"]["deepseek"]["decode"]["inputs"]
    notes = [term["note"] for term in inputs if term["source"] == "measured"]
    assert notes and all(
        "kernels deepseek (FlashMLA for decode attention; ours elsewhere)" in n for n in notes
    )
    rows = {(row["section"], row["name"]): row for row in document["side_by_side"]}
    step = rows[("decode step_times", "decode_step_no_overlap")]
    decode = [document["runs"][k]["decode"]["step_times"][0]["value"] for k in ("ours", "deepseek")]
    assert step["values"] == dict(zip(("ours", "deepseek"), decode, strict=True))
    assert step["over_base"] == {"deepseek": pytest.approx(decode[1] / decode[0])}
    assert ("economics", "margin") in rows and any(s == "ours / published" for s, _ in rows)
    assert deepseek.flash_mla.calls  # the decode slice attended through it

    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("day-6 reproduction, kernels side by side: CPU, not a GPU figure")
    [head] = [line for line in lines if line.startswith("decode step_times")]
    assert head.split() == ["decode", "step_times", "ours", "deepseek", "deepseek", "/", "ours"]
    [row] = [line for line in lines if line.startswith("  decode_step_no_overlap (s)")]
    assert len(row.split()) == 5  # the name, its unit, two values and a ratio


def test_repro_draws_one_kernel_set(capsys):
    assert (
        cli.main(["repro", "--device", "cpu", "--kernels", "ours,deepseek", "--plot", "x.png"]) == 2
    )
    assert "--plot draws one kernel set" in capsys.readouterr().err


def test_bench_model_sets_the_figures_side_by_side_with_each_sets_speed(capsys):
    bench = load(HERE.parent / "benchmarks" / "bench_model.py")
    rows = [
        dict(
            kernels="ours",
            batch=1,
            prefill_tok_s=100.0,
            decode_tok_s=50.0,
            decode_replay_ms=2.0,
            decode_engine_tok_s=40.0,
        ),
        dict(
            kernels="deepseek",
            batch=1,
            prefill_tok_s=125.0,
            decode_tok_s=40.0,
            decode_replay_ms=1.6,
            decode_engine_tok_s=None,
        ),
    ]
    [entry] = bench.side_by_side(rows, ["ours", "deepseek"])
    assert entry["prefill_tok_s_deepseek_over_ours"] == 1.25
    assert entry["decode_tok_s_deepseek_over_ours"] == 0.8
    assert entry["decode_replay_ms_deepseek_over_ours"] == pytest.approx(1.25)  # a time: faster
    assert entry["decode_engine_tok_s_deepseek_over_ours"] is None
    assert entry["decode_replay_ms_ours"] == 2.0
    assert "speed deepseek / ours" in capsys.readouterr().out
