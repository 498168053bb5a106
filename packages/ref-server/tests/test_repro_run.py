"""`ref-server repro` end to end on the CPU with the tiny V3-shaped slice, and its parts: the
layout's stand-in exchange, the op times to the projection's parts, the synthetic loads."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from ref_server import cli
from ref_server.repro import CPU_LABEL, NotAGPUFigure, imbalance, published, shapes, slices
from ref_server.repro.projection import LayerTimes
from ref_server.repro.run import (
    LAYOUTS,
    V3_LAYOUT,
    balancedness,
    kv_length_term,
    mtp_terms,
    reproduce,
    zipf_loads,
)

MEASURED = list(LayerTimes.__dataclass_fields__)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_repro_on_the_cpu_runs_labels_every_term_and_is_no_gpu_figure(tmp_path, capsys, term_rows):
    png = tmp_path / "repro.png"
    code, out, err = run_cli(
        ["repro", "--device", "cpu", "--reps", "1", "--json", "--plot", str(png)], capsys
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["figure"] == CPU_LABEL
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for phase, local in (("prefill", 9), ("decode", 2)):
        part = data[phase]
        assert part["figure"] == CPU_LABEL and part["projected_from"] == "ideal_overlap"
        work = {row["name"]: row["value"] for row in part["per_rank_work"]}
        assert work[f"{phase}_local_experts"] == local
        inputs = {row["name"]: row for row in part["inputs"]}
        for name in MEASURED:
            row = inputs[name]
            assert row["source"] == "measured" and row["figure"] == CPU_LABEL
            assert row["value"] > 0 and "tiny slice" in row["note"] and "on cpu" in row["note"]
        assert inputs["dispatch"]["basis"][0] == "published"
        assert inputs["balancedness"]["source"] == "assumed"
        assert 0 < inputs["balancedness"]["value"] < 1  # Zipf(1) loads: EPLB evens them partly
    for row in term_rows(data):
        basis = row.get("basis") or [row["source"]]
        if "measured" in basis:
            assert CPU_LABEL in row["note"] or row.get("figure") == CPU_LABEL, row["name"]
    assert {row["kind"] for row in data["comparisons"]} == {"saturation", "day average"}
    assert all(CPU_LABEL in row["caveat"] for row in data["comparisons"])
    margin = next(row for row in data["economics"] if row["name"] == "margin")
    assert CPU_LABEL in margin["note"]
    memory = {row["name"]: row["value"] for row in data["memory"]}
    tiny = slices.TINY  # 2 of its 256 routed experts a GPU at EP144: ep_size 128
    assert memory["decode_weights_per_gpu"] == tiny.weight_bytes_per_gpu(128, "bf16")
    assert memory["hbm_left"] == pytest.approx(
        141e9 - memory["decode_weights_per_gpu"] - memory["decode_kv_cache_per_gpu"]
    )


def test_v3_beside_v32_at_two_kv_lengths_with_mtp(tmp_path, capsys, term_rows):
    """The tiny slice and its V3.2 twin (an indexer picking 8 tokens), decode at KV 64 and 256
    with MTP at the published rate: a table a KV length, the slices in columns. V3's attention
    reads every row of each context, V3.2's its picks and every index key; V3.2's verify step
    is measured, V3's projected."""
    path = tmp_path / "repro.json"
    argv = ["repro", "--device", "cpu", "--reps", "1", "--zipf", "0", "--slice", "tiny,v3.2-tiny"]
    argv += ["--kv-length", "64,256", "--mtp-acceptance", "--json", str(path)]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    heads = [line for line in out.splitlines() if line.startswith("day-6 reproduction")]
    assert heads == [f"day-6 reproduction, slices side by side: {CPU_LABEL}"] * 2
    assert "decode at KV 256, MTP at acceptance 0.85, 1 draft(s)" in out.splitlines()
    document = json.loads(path.read_text())
    for table in document["tables"]:
        assert table["columns"] == ["tiny", "v3.2-tiny"]
        for row in term_rows(table):
            if "measured" in row.get("basis", [row["source"]]):
                assert row.get("figure") == CPU_LABEL or CPU_LABEL in row["note"], row["name"]
    runs = document["tables"][1]["runs"]
    v3, v32 = (runs[name]["decode"] for name in ("tiny", "v3.2-tiny"))
    work = [{row["name"]: row["value"] for row in phase["attention"]} for phase in (v3, v32)]
    # 16 requests a microbatch at KV 256, 4 heads: V3 attends absorbed over every bf16 row
    assert work[0]["decode_attention_flops"] == 16 * 2 * 4 * 256 * (576 + 512)
    assert work[0]["decode_attention_kv_bytes"] == 16 * 256 * 1152
    # V3.2 over 8 of them, and its 4 index heads of 128 score all 256 FP8 keys (132 B each)
    assert work[1]["decode_attention_flops"] == 16 * 2 * (4 * 8 * 1088 + 4 * 128 * 256)
    assert work[1]["decode_attention_kv_bytes"] == 16 * (8 * 1152 + 256 * 132)
    mtp = [{row["name"]: row for row in phase["speculation"]} for phase in (v3, v32)]
    assert mtp[0]["verify_attention_core"]["source"] == "derived"
    assert "projected" in mtp[0]["verify_attention_core"]["note"]
    assert mtp[1]["verify_attention_core"]["source"] == "measured"
    assert (
        "16 requests a microbatch of 2 new tokens each after 255"
        in (mtp[1]["verify_attention_core"]["note"])
    )
    for terms in mtp:
        assert terms["mtp_acceptance"]["source"] == "published"
        assert terms["mtp_accepted_length"]["value"] == pytest.approx(1.85)
    inputs = {row["name"]: row for row in v32["inputs"]}
    assert inputs["decode_kv_length"]["value"] == 256
    assert "at KV 256" in inputs["attention_core"]["note"]
    assert (
        "sparse attention through mla_kernels' reference backend"
        in (inputs["attention_core"]["note"])
    )
    [profile] = [
        row
        for row in runs["v3.2-tiny"]["comparisons"]
        if row["reference"]["name"] == "profile_decode_per_node"
    ]
    assert profile["ours"] == "decode_mtp_per_node_ideal_overlap"
    assert "ours at KV 256; ours with MTP" in profile["caveat"]


def test_a_cpu_projection_refuses_to_be_a_gpu_figure():
    [reproduction] = reproduce("tiny", "cpu", reps=1, zipf=0)
    assert reproduction.prefill.balancedness is imbalance.PERFECT
    for phase in (reproduction.prefill, reproduction.decode):
        with pytest.raises(NotAGPUFigure, match="CPU, not a GPU figure"):
            phase.gpu_figure()


def test_the_table_heads_with_its_label(capsys):
    code, out, _ = run_cli(["repro", "--device", "cpu", "--reps", "1", "--zipf", "0"], capsys)
    assert code == 0
    assert out.splitlines()[0] == f"day-6 reproduction: {CPU_LABEL}"
    assert "prefill_step_ideal_overlap" in out and "decode_per_node_no_overlap" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--zipf", "-1"], "zipf must be >= 0, got -1"),
        (["--kv-length", "1"], "decode KV lengths must be >= 2 tokens, got [1]"),
        (
            ["--slice", "tiny,v3.2-tiny", "--plot", "x.png"],
            "--plot draws one kernel set, one slice and one KV length",
        ),
        (["--device", "cuda"], "--device cuda: this torch has no CUDA device"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    if torch.cuda.is_available() and argv[0] == "--device":
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli(["repro", "--device", "cpu", "--reps", "1", *argv], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slice", "v3,v4"], "invalid choice: 'v4'"),
        (["--kv-length", "4989,0"], "expected whole numbers > 0 separated by commas, got '4989,0'"),
        (["--mtp-acceptance", "1.5"], "must be a rate from 0 to 1, got '1.5'"),
        (["--mtp-drafts", "4"], "invalid choice: 4"),
    ],
)
def test_bad_flags_are_refused_by_their_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["repro", *argv])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_the_layout_exchange_gives_each_slot_the_layouts_rows():
    point = LAYOUTS["tiny"].prefill
    args = slices.slice_args("tiny")
    work = shapes.per_rank_work(slices.dims_of(args), point)
    exchange = slices.LayoutExchange(point, args)
    assert exchange.rank_and_size == (0, 32) and exchange.local == 9
    assert exchange.rows_per_slot == round(work.rows_per_physical_expert / 2) == 114
    x = torch.randn(128, args.hidden_size)
    received, _ = exchange.dispatch(x, None, None)
    assert received.x.shape == (114 * 9, args.hidden_size)
    slots = received.ids[:, 0]
    assert (received.ids[:, 1:] == -1).all()
    assert torch.bincount(slots, minlength=9).tolist() == [114] * 9
    assert torch.equal(received.x[:128], x)  # copies of the microbatch's own tokens
    combined, _ = exchange.combine(torch.randn(len(slots), args.hidden_size), received.handle)
    assert combined.shape == (128, args.hidden_size)
    packed, hook = exchange.low_latency_dispatch(x, None, None)
    assert packed.x.shape == (9, 114, args.hidden_size) and hook() is None
    assert packed.count.tolist() == [114] * 9
    values, scales = exchange.low_latency_dispatch(x, None, None, use_fp8=True)[0].x
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (9, 114, 1)


def test_op_times_become_the_projections_parts():
    seconds = {"embed": 9.0, "L0.attn.core": 1.0, "L0.mlp": 2.0, "head": 0.5, "sampling": 0.25}
    ops = {
        "comm_prepare_attn": 0.1, "attn.prepare": 0.2, "attn.core": 0.3, "comm_prepare_mlp": 0.4,
        "gate": 0.5, "select_experts": 0.6, "dispatch_a": 7.0, "dispatch_b": 7.0, "experts": 0.7,
        "combine_a": 7.0, "shared_experts": 0.8, "combine_b": 7.0, "output": 0.9,
        "postprocess": 1.1,
    }  # fmt: skip
    seconds |= {f"L1.{name}": s for name, s in ops.items()}
    parts = slices._items(seconds)
    assert parts == pytest.approx(
        dict(
            attention_prepare=0.3, attention_core=0.3, gate=1.5, routed_experts=0.7,
            shared_expert=0.8, moe_output=2.0, dense_layer=3.0, head_and_sampling=0.75,
        )
    )  # fmt: skip


def test_zipf_loads_and_their_balancedness():
    loads = zipf_loads(58, 256, 1e6, 1.0, seed=0)
    assert loads.shape == (58, 256)
    np.testing.assert_allclose(loads.sum(axis=1), 1e6)
    assert loads.max() / loads.min() == pytest.approx(256, rel=1e-9)  # 1 / (1/256)
    dims = slices.dims_of(slices.slice_args("tiny"))
    skewed = balancedness(shapes.PREFILL_EP32, dims, 8, 1.5, seed=0)
    milder = balancedness(shapes.PREFILL_EP32, dims, 8, 0.5, seed=0)
    assert 0 < skewed.value < milder.value < 1
    assert balancedness(shapes.PREFILL_EP32, dims, 8, 0, seed=0) is imbalance.PERFECT


def test_the_v3_slice_is_deepseek_v3_at_the_published_layouts():
    args = slices.slice_args("v3")
    assert (args.hidden_size, args.n_routed_experts, args.num_experts_per_tok) == (7168, 256, 8)
    assert (args.num_hidden_layers, args.first_k_dense_replace) == (2, 1)
    assert slices.dims_of(args) == shapes.V3
    layout = LAYOUTS["v3"]
    assert layout.prefill is shapes.PREFILL_EP32 and layout.decode is shapes.DECODE_EP144
    assert layout.prompt == 4096
    assert layout.kv_length == 4_989 and kv_length_term(4_989) is published.DAY6_MEAN_KV_LENGTH
    assert kv_length_term(32_768).source == "assumed"


def test_the_v32_slice_is_v3_with_deepseeks_indexer():
    args = slices.slice_args("v3.2")
    assert (args.index_topk, args.index_n_heads, args.index_head_dim) == (2048, 64, 128)
    assert dataclasses.replace(args, index_topk=None) == slices.slice_args("v3")
    assert slices.dims_of(args) == dataclasses.replace(shapes.V3, index_topk=2048)
    assert LAYOUTS["v3.2"] is V3_LAYOUT
    tiny = slices.slice_args("v3.2-tiny")
    assert dataclasses.replace(tiny, index_topk=None, index_n_heads=64) == slices.slice_args("tiny")


def test_mtp_terms_are_published_where_they_are_deepseeks():
    assert mtp_terms(0.85, 1) == (published.MTP_ACCEPTANCE, published.MTP_DRAFTS)
    rate, drafts = mtp_terms(0.7, 3)
    assert (rate.value, rate.source, drafts.value, drafts.source) == (0.7, "assumed", 3, "assumed")
    with pytest.raises(ValueError, match="draft_tokens must be 1 to 3, got 4"):
        mtp_terms(0.85, 4)


def test_a_verify_slice_has_each_requests_drafts_after_its_newest_token():
    point = dataclasses.replace(LAYOUTS["tiny"].decode, tokens_per_gpu=3 * 32)
    part = slices.Slice.build(point, slices.slice_args("tiny"), "cpu", context=100, query_len=3)
    assert part.batch.query_lens == [3] * 16 and part.batch.context_lens == [102] * 16


def test_on_the_cpu_the_host_ahead_context_does_nothing():
    ahead = slices.HostAhead(torch.device("cpu"))
    with ahead:
        pass
    ahead.count()
    assert ahead.hidden and ahead.note() == ""


@pytest.mark.gpu
def test_the_gpu_sleeps_while_the_host_enqueues_unless_the_host_waits_for_it():
    """Small kernels enqueued under HostAhead, the host dawdling between launches, run back
    to back: events around them measure a fraction of the host's time. A sync inside shows,
    and doubles the sleep. The untimed steps run the same kernels first: a kernel's first
    launch loads its module (lazily), which can wait for the sleeping stream."""
    x = torch.ones(1024, device="cuda")
    ahead = slices.HostAhead(torch.device("cuda"), cycles=200_000_000)  # about 0.1 s
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step() -> float:
        began = time.perf_counter()
        start.record()
        for _ in range(100):
            x.mul_(1.0)
            dawdle = time.perf_counter() + 2e-5  # busy: time.sleep's slack varies by machine
            while time.perf_counter() < dawdle:
                pass
        end.record()
        return time.perf_counter() - began

    for _ in range(3):  # the untimed steps, then the timed one
        with ahead:
            launched = step()
    ahead.count()
    end.synchronize()
    assert ahead.hidden and ahead.note().endswith("(launch time hidden)")
    assert start.elapsed_time(end) / 1e3 < 0.25 * launched
    cycles = ahead.cycles
    with ahead:
        x.sum().item()  # the host waits for the stream: nothing is hidden
    ahead.count()
    assert not ahead.hidden and ahead.cycles == 2 * cycles
    assert "1 of 2 steps with the host's time exposed" in ahead.note()
