"""`ref-server repro` end to end on the CPU with the tiny V3-shaped slice, and its parts: the
layout's stand-in exchange, the op times to the projection's parts, the synthetic loads."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from ref_server import cli
from ref_server.repro import CPU_LABEL, NotAGPUFigure, imbalance, shapes, slices
from ref_server.repro.projection import LayerTimes
from ref_server.repro.run import LAYOUTS, balancedness, reproduce, zipf_loads

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


def test_a_cpu_projection_refuses_to_be_a_gpu_figure():
    reproduction = reproduce("tiny", "cpu", reps=1, zipf=0)
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
        (["--device", "cuda"], "--device cuda: this torch has no CUDA device"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    if torch.cuda.is_available() and argv[0] == "--device":
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli(["repro", "--device", "cpu", "--reps", "1", *argv], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_an_unknown_slice_is_refused_by_its_flag(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["repro", "--slice", "v4"])
    assert exit.value.code == 2
    assert "invalid choice: 'v4'" in capsys.readouterr().err


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
