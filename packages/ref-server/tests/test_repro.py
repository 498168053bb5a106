"""The day-6 projection's arithmetic (ref_server.repro) on fixed inputs, against values worked
out by hand in the comments beside them."""

import dataclasses
import json
import subprocess
import sys

import pytest

from ref_server.repro import (
    CPU_LABEL,
    DECODE_EP144,
    PREFILL_EP32,
    AttentionWork,
    Communication,
    Device,
    LayerTimes,
    NotAGPUFigure,
    OperatingPoint,
    PhaseProjection,
    Reproduction,
    SideBySide,
    Speculation,
    Term,
    V3Dims,
    communication,
    comparisons,
    imbalance,
    implied_step_time,
    margin,
    per_rank_work,
    projected_verify,
    published,
    schedule,
    tables,
)
from ref_server.repro.report import CAVEATS, SPARSE_PRICES
from ref_server.repro.terms import SOURCES

# One microbatch's parts in one layer, in units (ms below) chosen to make the hand computation
# short: attention 1 + 2, gate 1, routed experts 4, shared 2, output 1, dense layer 5;
# dispatch 3, combine 6.
UNITS = dict(
    attention_prepare=1,
    attention_core=2,
    gate=1,
    routed_experts=4,
    shared_expert=2,
    moe_output=1,
    dense_layer=5,
    dispatch=3,
    combine=6,
)
H200 = Device("cuda", "NVIDIA H200")
CPU = Device("cpu", "cpu")
# 1 dense + 2 MoE layers, 8 experts
TOY_DIMS = V3Dims(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8)
TOY_POINT = OperatingPoint(
    "prefill", gpus=4, tokens_per_gpu=1000, physical_experts=8, note="a toy layout"
)


def toy_times(head_ms=3.0, **ms):
    values = {**UNITS, **ms}
    seconds = {k: v / 1e3 for k, v in values.items() if k not in ("dispatch", "combine")}
    return LayerTimes.measured("toy run", head_and_sampling=head_ms / 1e3, **seconds)


def toy_comm(dispatch_ms=3.0, combine_ms=6.0):
    return Communication(
        Term("dispatch", dispatch_ms / 1e3, "s", "measured", "toy ep-comm run"),
        Term("combine", combine_ms / 1e3, "s", "measured", "toy ep-comm run"),
    )


def toy_projection(device=H200, balancedness=imbalance.PERFECT, measured_step=None, **kw):
    return PhaseProjection(
        kw.pop("point", TOY_POINT),
        device,
        toy_times(),
        toy_comm(),
        balancedness,
        measured_step=measured_step,
        dims=TOY_DIMS,
        **kw,
    )


def seconds(value, name="step"):
    return Term(name, value, "s", "measured", "toy two-batch run")


def test_the_package_imports_without_torch():
    code = "import sys, ref_server.repro; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the per-rank work of wave2.md §6.2 ---


def test_prefill_ep32_per_rank_work_is_wave2_table():
    work = per_rank_work(V3Dims(), PREFILL_EP32)
    assert work.routed_pairs == 4_194_304  # 32 x 16,384 x 8
    assert round(work.rows_per_physical_expert) == 14_564  # / 288
    assert work.local_experts == 9
    assert work.rows_per_gpu == 131_072
    assert work.shared_rows == 16_384
    assert round(work.dispatch_bytes_per_gpu / 1e6) == 971  # 131,072 x 7,408 B
    assert round(work.combine_bytes_per_gpu / 1e7) / 100 == 1.88  # 131,072 x 14,336 B, GB


def test_decode_ep144_per_rank_work_is_wave2_table():
    work = per_rank_work(V3Dims(), DECODE_EP144)
    assert work.routed_pairs == 147_456  # 144 x 128 x 8
    assert work.rows_per_physical_expert == 512
    assert work.local_experts == 2
    assert work.rows_per_gpu == 1_024
    assert work.shared_rows == 128
    assert round(work.dispatch_bytes_per_gpu / 1e5) / 10 == 7.6  # MB
    assert round(work.combine_bytes_per_gpu / 1e5) / 10 == 14.7  # MB


def test_message_and_cache_bytes_follow_deepep_and_mla_kernels_layouts():
    dims = V3Dims()
    assert dims.dispatch_bytes_per_pair == 7_408
    assert dims.combine_bytes_per_pair == 14_336
    assert dims.kv_bytes_per_token_per_layer(fp8=True) == 656
    assert dims.kv_bytes_per_token_per_layer(fp8=False) == 1_152
    assert dims.num_moe_layers == 58


def test_work_terms_are_derived_from_the_layout():
    terms = per_rank_work(V3Dims(), DECODE_EP144).terms(DECODE_EP144)
    values = {t.name: t.value for t in terms}
    assert values["decode_routed_pairs"] == 147_456 and values["decode_rows_per_gpu"] == 1_024
    assert all(t.source == "derived" and t.basis == ("published",) for t in terms)


def test_v3_dims_are_the_model_v3_preset():
    from ref_server.model.args import PRESETS

    v3 = PRESETS["v3"]
    for field in dataclasses.fields(V3Dims):
        assert getattr(V3Dims(), field.name) == getattr(v3, field.name), field.name


# --- the stage schedules and step times ---


def test_schedules_are_the_models_op_lists():
    from ref_server.model.transformer import DELTA_STAGES, SCHEDULES

    for phase, items in schedule.SCHEDULES.items():
        ops = [op for item in items.split() for op in schedule.OPS_OF_ITEM[item]]
        assert " ".join(ops) == SCHEDULES[phase]
    assert schedule.DELTA_STAGES == DELTA_STAGES


def test_no_overlap_is_the_sum_of_both_microbatches():
    # per microbatch and layer 1+2+1+3+4+6+2+1 = 20; 2 layers, 2 microbatches
    assert schedule.sequential_seconds("prefill", UNITS, 0, 2) == 80
    assert schedule.sequential_seconds("decode", UNITS, 1, 2) == 90  # + 2 x dense 5


def test_ideal_prefill_overlap_of_two_toy_layers():
    # stages: [ap ac g d>] [>d re c>] [se >c mo ap ac g d>] [>d re c>] [se >c mo], A B A B ...
    # A0 ends 4, dispatch 4-7 | B0 ends 8, dispatch 8-11 | A1 12, combine 12-18 |
    # B1 16, combine 18-24 | A2 from 18: 23, dispatch 24-27 | B2 from 25: 30, dispatch 30-33 |
    # A3 34, combine 34-40 | B3 38, combine 40-46 | A4 from 40: 41 | B4 43, waits to 46: 47
    assert schedule.overlapped_seconds("prefill", UNITS, 0, 2) == 47


def test_ideal_decode_overlap_of_two_toy_layers():
    # 11 stages, B two behind A: A0 1, A1 4, A2 dispatch 4-7 and se to 6, B0 7, A3 11 and
    # combine 11-17, B1 14, A4 waits to 17, B2 dispatch 17-20 and se 19, A5 21, B3 25 and
    # combine 25-31, A6 28, B4 waits to 31, A7 dispatch 31-34 and se 33, B5 35, A8 39 and
    # combine 39-45, B6 42, A9 waits to 45, B7 dispatch 45-48 and se 47, A10 48, B8 52 and
    # combine 52-58, B9 waits to 58, B10 59
    assert schedule.overlapped_seconds("decode", UNITS, 0, 2) == 59


def test_step_times_of_a_projection():
    projection = toy_projection(measured_step=seconds(0.075))
    steps = projection.step_times
    # dense layer 5 ms at the head of both first stages shifts the prefill overlap by 10: 57,
    # + head 3 ms
    assert steps["ideal_overlap"].value == pytest.approx(0.060)
    assert steps["no_overlap"].value == pytest.approx(0.093)  # 80 + 2 x 5 + 3
    assert steps["measured_overlap"].value == 0.075
    assert steps["ideal_overlap"].basis == ("measured", "assumed")  # assumed: balancedness 1


def test_imbalance_scales_routed_experts_and_communication():
    projection = toy_projection(balancedness=Term("balancedness", 0.5, "1", "assumed", "toy"))
    # per microbatch and layer 1+2+1 + (3+4+6)/0.5 + 2+1 = 33; x 2 layers x 2 + 10 + 3
    assert projection.step_times["no_overlap"].value == pytest.approx(0.145)
    assert projection.step_times["no_overlap"].basis == ("measured", "assumed")


# --- throughput and token accounting ---


def test_throughput_per_node_and_cache_hits():
    projection = toy_projection(measured_step=seconds(0.075))
    ideal, measured = (
        projection.throughput["ideal_overlap"],
        projection.throughput["measured_overlap"],
    )
    assert ideal[0].value == pytest.approx(133_333.33, abs=0.01)  # 8 x 1000 / 0.060
    assert ideal[1].value == pytest.approx(305_110.61, abs=0.01)  # / (1 - 0.563)
    assert projection.throughput["no_overlap"][0].value == pytest.approx(86_021.51, abs=0.01)
    assert measured[0].value == pytest.approx(106_666.67, abs=0.01)  # 8000 / 0.075
    assert projection.projected() is measured[1]
    assert projection.projected_variant == "measured_overlap"


def test_day6_cache_hit_accounting():
    # day 6's 73.7k incl. cache hits are 73,700 x 0.437 = 32,206.9 computed (SGLang: 32,206):
    # a step that computes that many gives back 73.7k
    step = seconds(8 * 16_384 / 32_206.9)
    projection = toy_projection(point=PREFILL_EP32, measured_step=step)
    computed, with_hits = projection.throughput["measured_overlap"]
    assert computed.value == pytest.approx(32_206.9)
    assert with_hits.value == pytest.approx(73_700)
    assert (
        round(published.DAY6_PREFILL_PER_NODE.value * (1 - published.CACHE_HIT_SHARE.value))
        == 32_207
    )


def test_decode_counts_output_tokens_without_mtp():
    point = OperatingPoint("decode", gpus=4, tokens_per_gpu=64, physical_experts=8)
    projection = toy_projection(point=point, measured_step=seconds(0.032))
    (output,) = projection.throughput["measured_overlap"]
    assert output.value == pytest.approx(16_000)  # 8 x 64 / 0.032
    assert "no MTP" in output.note


def test_profile_data_implied_step_times():
    prefill = implied_step_time(
        published.PROFILE_PREFILL_PER_NODE, published.PROFILE_PREFILL_TOKENS_PER_GPU
    )
    decode = implied_step_time(
        published.PROFILE_DECODE_PER_NODE, published.PROFILE_DECODE_REQUESTS_PER_GPU
    )
    with_mtp = Term("tokens_per_gpu_step", 128 * 1.7, "tok", "assumed", "1.7 tokens a step")
    assert round(prefill.value, 2) == 2.09  # 16,384 / (62,713 / 8)
    assert round(prefill.value / 61 * 1e3) == 34  # ms a layer
    assert round(decode.value * 1e3) == 55  # 128 / (18,598 / 8)
    assert round(implied_step_time(published.PROFILE_DECODE_PER_NODE, with_mtp).value * 1e3) == 94


# --- communication from published figures ---


def test_low_latency_times_scale_deepep_by_pairs():
    # a decode microbatch of 64 tokens x top-8 = 512 pairs, half DeepEP's 128 x 8
    dispatch = communication.low_latency_seconds(
        "dispatch", published.DEEPEP_LL_DISPATCH_EP128, 512
    )
    combine = communication.low_latency_seconds("combine", published.DEEPEP_LL_COMBINE_EP128, 512)
    assert dispatch.value == pytest.approx(96e-6)
    assert combine.value == pytest.approx(184.5e-6)
    assert "published-H800-IB" in dispatch.note and dispatch.basis == ("published",)


def test_normal_times_at_deepep_rdma_bandwidth():
    nodes = Term("destinations_per_token", 4, "node", "assumed", "every node of EP32")
    dispatch = communication.normal_seconds(
        "dispatch", published.DEEPEP_NORMAL_DISPATCH_EP32, 8192, nodes, fp8=True
    )
    combine = communication.normal_seconds(
        "combine", published.DEEPEP_NORMAL_COMBINE_EP32, 8192, nodes, fp8=False
    )
    assert dispatch.value == pytest.approx(242_221_056 / 58e9)  # 8192 x 4 x 7168 x 1.03125
    assert combine.value == pytest.approx(469_762_048 / 57e9)  # 8192 x 4 x 14,336
    assert dispatch.basis == ("published", "assumed")


# --- imbalance ---


def test_balancedness_from_loads_through_eplb():
    # layer 0: loads 4 1 1 2 on 2 GPUs of 2 slots: 4 | 2 1 | then 1 beside the 4: 5 and 3,
    # mean 4 / max 5 = 0.8; layer 1 even: 1.0; harmonic mean 2 / (1.25 + 1)
    term = imbalance.from_loads([[4, 1, 1, 2], [1, 1, 1, 1]], 4, 1, 1, 2, "assumed", "toy loads")
    assert term.value == pytest.approx(0.888_889, abs=1e-6)
    assert term.source == "assumed" and "toy loads" in term.note


# --- economics ---


def test_margin_at_deepseeks_own_throughput_is_the_published_545_percent():
    terms = {
        t.name: t for t in margin(published.DAY6_PREFILL_PER_NODE, published.DAY6_DECODE_PER_NODE)
    }
    # 608e9 / (73,700 x 86,400) = 95.48 and 167.97e9 / (14,800 x 86,400) = 131.36 nodes;
    # 226.84 nodes x 8 x $2 x 24 h = $87,106 against $562,027
    assert terms["prefill_nodes_needed"].value == pytest.approx(95.48, abs=0.01)
    assert terms["decode_nodes_needed"].value == pytest.approx(131.36, abs=0.01)
    assert terms["cost_usd_per_day"].value == pytest.approx(87_106, abs=1)
    assert round(terms["margin"].value * 100) == 545
    assert terms["margin"].basis == ("published",)


def test_margin_at_twice_the_throughput_and_a_higher_rent():
    double = [
        Term(t.name, 2 * t.value, t.unit, "assumed", "twice day 6")
        for t in (published.DAY6_PREFILL_PER_NODE, published.DAY6_DECODE_PER_NODE)
    ]
    rent = Term("gpu_hour_usd", 4.0, "USD/GPU-hour", "assumed", "toy rent")
    terms = {t.name: t for t in margin(*double, rent)}
    # half the nodes at twice the rent: the same $87,106 and margin
    assert terms["cost_usd_per_day"].value == pytest.approx(87_106, abs=1)
    assert terms["decode_usd_per_m_output"].value == pytest.approx(32 / (29_600 * 3600) * 1e6)
    cheaper = {t.name: t for t in margin(*double)}
    assert cheaper["margin"].value == pytest.approx(562_027 / (87_105.6 / 2) - 1, abs=1e-3)


# --- labels and the CPU guard ---


def reproduction(device):
    decode = OperatingPoint("decode", gpus=4, tokens_per_gpu=64, physical_experts=8)
    weights = Term("decode_weights_per_gpu", 40e9, "B", "assumed", "toy weights")
    return Reproduction(
        toy_projection(device),
        toy_projection(device, point=decode, measured_step=seconds(0.05)),
        decode_weights_per_gpu=weights,
    )


def test_every_serialized_term_is_labelled(term_rows):
    data = json.loads(json.dumps(reproduction(H200).to_json()))
    rows = list(term_rows(data))
    assert len(rows) > 60
    for row in rows:
        assert row["source"] in SOURCES and row["note"] and row["unit"], row
        assert ("basis" in row) == (row["source"] == "derived"), row
    assert data["figure"] == "GPU figure, measured on NVIDIA H200"
    assert data["prefill"]["projected_from"] == "ideal_overlap"
    assert data["decode"]["projected_from"] == "measured_overlap"
    kinds = {row["kind"] for row in data["comparisons"]}
    assert kinds == {"saturation", "day average"}
    day_average = [r for r in data["comparisons"] if r["kind"] == "day average"]
    assert all("not like with like" in r["caveat"] for r in day_average)


def test_memory_check_of_the_decode_layout():
    memory = {t.name: t for t in reproduction(H200).memory()}
    # 64 requests x 4,989 tokens x 3 layers x 656 B
    assert memory["decode_kv_cache_per_gpu"].value == 628_374_528
    assert memory["hbm_left"].value == pytest.approx(141e9 - 40e9 - 628_374_528)


def test_cpu_measurement_is_labelled_everywhere_and_refused_as_gpu_figure(term_rows):
    table = reproduction(CPU)
    data = table.to_json()
    assert data["figure"] == CPU_LABEL
    rows = list(term_rows(data))
    resting_on_cpu = [r for r in rows if "measured" in r.get("basis", [r["source"]])]
    assert resting_on_cpu and all(r["figure"] == CPU_LABEL for r in resting_on_cpu)
    derived_rows = [r for r in resting_on_cpu if r["source"] == "derived"]
    assert derived_rows and all(CPU_LABEL in r["note"] for r in derived_rows)
    assert all(row["figure"] == CPU_LABEL for row in data["comparisons"])
    text = table.to_text(every_term=True)
    assert text.startswith(f"day-6 reproduction: {CPU_LABEL}")
    for row in resting_on_cpu:
        lines = [x for x in text.splitlines() if x.strip().startswith(row["name"] + " ")]
        assert lines and all(CPU_LABEL in line for line in lines), row["name"]
    with pytest.raises(NotAGPUFigure, match="CPU, not a GPU figure"):
        table.decode.gpu_figure()


def test_the_text_fits_100_columns_and_cites_only_public_documents(term_rows):
    table = reproduction(H200)
    summary, full = table.to_text(), table.to_text(every_term=True)
    for text in (summary, full):
        assert max(len(line) for line in text.splitlines()) <= 100
        assert ".md" not in text and "§" not in text
    assert len(summary.splitlines()) < 60 < len(full.splitlines())
    assert " / profile_decode_per_node (18,598, saturation)" in summary
    assert "prefill inputs" not in summary and "prefill inputs" in full
    assert "--terms" in summary
    assert not [r["name"] for r in term_rows(table.to_json()) if ".md" in r["note"]]


def test_gpu_figure_needs_a_measured_two_batch_step():
    table = reproduction(H200)
    assert table.decode.gpu_figure().value == pytest.approx(10_240)  # 8 x 64 / 0.05
    with pytest.raises(ValueError, match="upper bound, not a figure"):
        table.prefill.gpu_figure()


# --- V3.2's cache, long-context memory, attention work ---


def test_v32_dims_cache_the_indexers_fp8_keys_beside_the_latent():
    from ref_server.model.args import PRESETS
    from ref_server.model.cache import cache_bytes_per_token

    v32 = V3Dims(index_topk=2048)
    assert v32.kv_bytes_per_token_per_layer(fp8=True) == 656 + 128 + 4  # e4m3 key, fp32 scale
    # against the model's paged cache (bf16 latent, FP8 index keys), a layer's share
    assert (
        v32.kv_bytes_per_token_per_layer(fp8=False) == cache_bytes_per_token(PRESETS["v3.2"]) / 61
    )
    assert (
        V3Dims().kv_bytes_per_token_per_layer(fp8=False)
        == cache_bytes_per_token(PRESETS["v3"]) / 61
    )


def long_context(kv_length):
    decode = OperatingPoint("decode", gpus=4, tokens_per_gpu=64, physical_experts=8)
    projection = toy_projection(point=decode, kv_length=kv_length)
    weights = Term("decode_weights_per_gpu", 40e9, "B", "assumed", "toy weights")
    return Reproduction(toy_projection(), projection, decode_weights_per_gpu=weights)


def test_the_memory_check_at_a_long_kv_length_says_how_many_requests_fit():
    table = long_context(Term("decode_kv_length", 1_000_000, "tok", "assumed", "toy"))
    memory = {t.name: t.value for t in table.memory()}
    # 64 requests x 1M tokens x 3 layers x 656 B = 125.95 GB beside 40 GB of 141 GB
    assert memory["decode_kv_cache_per_gpu"] == 125_952_000_000
    assert memory["hbm_left"] == pytest.approx(141e9 - 40e9 - 125.952e9)
    assert memory["decode_requests_that_fit"] == 51  # 101 GB / 1.968 GB a request
    [caveat] = [c for c in table.caveats() if "do not fit" in c]
    assert (
        "At KV 1,000,000 the decode layout's 64 requests a GPU" in caveat and "(51 would)" in caveat
    )
    assert not [c for c in reproduction(H200).caveats() if "do not fit" in c]  # day 6's 4,989


def test_attention_work_over_the_measured_core_gives_its_rates():
    work = AttentionWork(
        Term("decode_attention_flops", 4e9, "FLOP", "assumed", "toy count"),
        Term("decode_attention_kv_bytes", 1e6, "B", "assumed", "toy count"),
    )
    decode = OperatingPoint("decode", gpus=4, tokens_per_gpu=64, physical_experts=8)
    terms = {t.name: t for t in toy_projection(point=decode, attention=work).attention_terms()}
    assert terms["decode_attention_core_flop_rate"].value == pytest.approx(2e12)  # / 2 ms
    assert terms["decode_attention_core_kv_byte_rate"].value == pytest.approx(5e8)
    assert terms["decode_attention_core_flop_rate"].basis == ("measured", "assumed")
    assert toy_projection().attention_terms() == []


# --- MTP ---

# one MoE layer, no dense one: the steps below are worked out by hand
ONE_LAYER = V3Dims(num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=8)
DECODE = OperatingPoint("decode", gpus=4, tokens_per_gpu=64, physical_experts=8)


def speculation(acceptance=0.5, drafts=2):
    rate = Term("mtp_acceptance", acceptance, "1", "assumed", "toy rate")
    k = Term("mtp_drafts", drafts, "tok", "assumed", "toy drafts")
    return Speculation(rate, k, projected_verify(toy_times(), k), toy_comm(6.0, 12.0))


def mtp_projection(**kw):
    return PhaseProjection(
        DECODE, H200, toy_times(), toy_comm(), imbalance.PERFECT, dims=ONE_LAYER, **kw
    )


def test_a_projected_verify_step_is_the_decode_step_times_its_tokens():
    k = Term("mtp_drafts", 2, "tok", "published", "toy")
    verify = projected_verify(toy_times(), k)
    assert verify.attention_core.value == pytest.approx(6e-3)  # 2 ms x 3 tokens a request
    assert verify.head_and_sampling.value == pytest.approx(9e-3)
    assert verify.gate.basis == ("measured", "published") and "projected" in verify.gate.note


def test_accepted_length_of_a_round():
    assert speculation(0.5, 2).accepted_length().value == 1.75  # 1 + 0.5 + 0.25
    assert speculation(1.0, 3).accepted_length().value == 4
    assert speculation(0.0, 1).accepted_length().value == 1
    assert published.MTP_ACCEPTANCE.value == 0.85 and published.MTP_DRAFTS.value == 1


def test_decode_with_mtp_of_one_toy_layer():
    projection = mtp_projection(speculation=speculation())
    steps = projection.speculation_steps
    # the decode schedule of one layer, B two stages behind A (ms): A0 ap 1, A1 ac g 4, A2
    # dispatch 4-7 and se 6, B0 7, A3 re 11 and combine 11-17, B1 14, A4 waits to 17, B2
    # dispatch 17-20 and se 19, A5 20, B3 24 and combine 24-30, B4 waits to 30, B5 31; + head 3
    assert steps["ideal_overlap"]["draft"].value == pytest.approx(0.034)
    assert steps["no_overlap"]["draft"].value == pytest.approx(0.043)  # 2 x 20 + 3
    # the verify step: compute x 3, dispatch 6, combine 12: A0 3, A1 12, A2 dispatch 12-18 and
    # se 18, B0 21, A3 33 and combine 33-45, B1 42, A4 waits to 45, B2 dispatch 45-51 and se
    # 51, A5 54, B3 66 and combine 66-78, B4 waits to 78, B5 81; + head 9
    assert steps["ideal_overlap"]["verify"].value == pytest.approx(0.090)
    assert steps["no_overlap"]["verify"].value == pytest.approx(0.111)  # 2 x 51 + 9
    assert steps["ideal_overlap"]["step"].value == pytest.approx(0.158)  # 90 + 2 x 34
    assert steps["no_overlap"]["step"].value == pytest.approx(0.197)  # 111 + 2 x 43
    plain, mtp = projection.throughput["ideal_overlap"]
    assert plain.value == pytest.approx(8 * 64 / 0.034)
    assert mtp.value == pytest.approx(8 * 64 * 1.75 / 0.158)  # 5,670.9 tok/s a node
    assert mtp.name == "decode_mtp_per_node_ideal_overlap" and projection.projected() is mtp
    assert projection.throughput["no_overlap"][1].value == pytest.approx(8 * 64 * 1.75 / 0.197)
    speedup = {t.name: t for t in projection.speculation_terms()}
    assert speedup["decode_mtp_speedup_ideal_overlap"].value == pytest.approx(0.034 * 1.75 / 0.158)
    assert speedup["mtp_decode_speedup"] is published.MTP_DECODE_SPEEDUP
    assert speedup["verify_dispatch"].value == 6e-3
    assert mtp_projection().speculation_terms() == [] and mtp_projection().speculation_steps == {}


def test_comparisons_with_mtp_set_the_mtp_row_against_references_that_have_it():
    rows = {
        row.reference.name: row for row in comparisons(mtp_projection(speculation=speculation()))
    }
    mtp, plain = "decode_mtp_per_node_ideal_overlap", "decode_per_node_ideal_overlap"
    assert rows["profile_decode_per_node"].ours.name == mtp
    assert rows["sglang_decode_simulated_mtp_per_node"].ours.name == mtp
    assert rows["sglang_decode_per_node"].ours.name == plain
    assert "ours with MTP" in rows["profile_decode_per_node"].caveat
    assert "ours without MTP" in rows["sglang_decode_per_node"].caveat
    without = {row.reference.name: row for row in comparisons(mtp_projection())}
    assert without["profile_decode_per_node"].ours.name == plain
    assert "ours without MTP" in without["profile_decode_per_node"].caveat


# --- side by side ---


def run_of(model, kernels="ours", kv_length=None, **decode):
    point = OperatingPoint("decode", gpus=4, tokens_per_gpu=64, physical_experts=8)
    return Reproduction(
        toy_projection(),
        toy_projection(point=point, kv_length=kv_length, **decode),
        kernels=kernels,
        model=model,
    )


def test_slices_side_by_side_name_their_columns_by_what_differs():
    v3 = run_of("v3")
    core = Term("attention_core", 1e-3, "s", "measured", "toy")
    faster = dataclasses.replace(v3.decode.times, attention_core=core)  # from 2 ms
    sparse = dataclasses.replace(TOY_DIMS, index_topk=8)
    decode = dataclasses.replace(v3.decode, times=faster, dims=sparse)
    v32 = dataclasses.replace(v3, decode=decode, model="v3.2")
    table = SideBySide((v3, v32))
    assert table.differing == ["slices"] and table.columns == ["v3", "v3.2"]
    rows = {(row["section"], row["name"]): row for row in table.rows()}
    step = rows[("decode step_times", "decode_step_no_overlap")]
    # 1 ms less in each of 2 MoE layers of 2 microbatches
    assert step["values"]["v3"] - step["values"]["v3.2"] == pytest.approx(4e-3)
    assert step["over_base"] == {"v3.2": step["values"]["v3.2"] / step["values"]["v3"]}
    text = table.to_text()
    assert (
        text.splitlines()[0]
        == "day-6 reproduction, slices side by side: GPU figure, measured on NVIDIA H200"
    )
    assert text.splitlines()[1] == "decode at KV 4,989"
    caveats = table.caveats()
    assert caveats[: len(CAVEATS)] == list(CAVEATS)  # both runs': unnamed
    assert f"v3.2: {SPARSE_PRICES}" in caveats and f"- v3.2: {SPARSE_PRICES[:40]}" in text
    both = SideBySide((run_of("v3"), run_of("v3.2", "deepseek")))
    assert both.differing == ["slices", "kernels"] and both.columns == ["v3 ours", "v3.2 deepseek"]
    assert list(both.to_json()["runs"]) == ["v3 ours", "v3.2 deepseek"]


def test_tables_set_the_runs_at_each_kv_length_side_by_side():
    long = Term("decode_kv_length", 32_768, "tok", "assumed", "toy")
    runs = [
        run_of("v3"),
        run_of("v3", kv_length=long),
        run_of("v3.2"),
        run_of("v3.2", kv_length=long),
    ]
    first, second = tables(runs)
    assert first.runs == (runs[0], runs[2]) and second.runs == (runs[1], runs[3])
    assert second.to_text().splitlines()[1] == "decode at KV 32,768"
    [alone] = tables(runs[:1])
    assert alone is runs[0]


@pytest.mark.parametrize(
    "runs, message",
    [
        (lambda: (run_of("v3"),), "two or more reproductions"),
        (lambda: (run_of("v3"), run_of("v3")), "different slices or kernels"),
        (
            lambda: (
                run_of("v3"),
                run_of("v3.2", kv_length=Term("decode_kv_length", 8, "tok", "assumed", "x")),
            ),
            "at one decode KV length",
        ),
    ],
)
def test_side_by_side_refuses_runs_it_cannot_set_in_columns(runs, message):
    with pytest.raises(ValueError, match=message):
        SideBySide(runs())


def test_side_by_side_refuses_runs_with_mtp_and_without():
    table = SideBySide((run_of("v3"), run_of("v3.2", speculation=speculation())))
    with pytest.raises(ValueError, match="decode step_times terms differ: set MTP alike"):
        table.rows()


# --- bad inputs ---


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: toy_times(attention_core=-1.0), "attention_core must not be negative"),
        (lambda: toy_times(gate=float("nan")), "'gate': value must be finite"),
        (lambda: toy_comm(combine_ms=-2.0), "combine must not be negative"),
        (
            lambda: toy_projection(balancedness=Term("balancedness", 0, "1", "assumed", "x")),
            r"balancedness must be in \(0, 1\]",
        ),
        (
            lambda: toy_projection(balancedness=Term("balancedness", 1.2, "1", "assumed", "x")),
            r"balancedness must be in \(0, 1\]",
        ),
        (lambda: toy_projection(measured_step=seconds(0.0)), "step must be greater than zero"),
        (lambda: OperatingPoint("prefill", 4, 0), "tokens_per_gpu must be a whole number >= 1"),
        (lambda: OperatingPoint("prefill", 4, 15), "split evenly into 2 microbatches"),
        (lambda: OperatingPoint("prefill", 5, 16), "physical_experts .* split evenly"),
        (lambda: OperatingPoint("serve", 4, 16), "phase must be one of"),
        (
            lambda: toy_projection(point=dataclasses.replace(TOY_POINT, microbatches=4)),
            "the two-batch schedules run 2 microbatches",
        ),
        (
            lambda: implied_step_time(
                published.PROFILE_DECODE_PER_NODE, Term("tokens", 0, "tok", "assumed", "x")
            ),
            "tokens must be greater than zero",
        ),
        (
            lambda: communication.low_latency_seconds(
                "dispatch", published.DEEPEP_LL_DISPATCH_EP128, 0
            ),
            "pairs must be greater than zero",
        ),
        (lambda: Term("x", 1, "s", "guessed", "n"), "source 'guessed' not one of"),
        (lambda: Term("x", 1, "s", "measured", ""), "a note saying where it comes from"),
        (
            lambda: dataclasses.replace(toy_times(), gate=seconds(1e-3, "router")),
            "gate must be a Term named 'gate' in seconds",
        ),
        (lambda: Device("tpu", "x"), "device kind must be 'cuda' or 'cpu'"),
        (lambda: schedule.stages("decode", 0, 0), "moe_layers >= 1"),
        (lambda: speculation(acceptance=1.2), r"mtp_acceptance must be in \[0, 1\], got 1.2"),
        (lambda: speculation(drafts=0), "mtp_drafts must be a whole number >= 1, got 0"),
        (
            lambda: toy_projection(speculation=speculation()),
            "speculation \\(MTP\\) is a decode projection's",
        ),
        (
            lambda: mtp_projection(speculation=speculation(), measured_step=seconds(0.1)),
            "give measured_step or speculation, not both",
        ),
        (
            lambda: AttentionWork(
                Term("decode_attention_flops", 1, "FLOP/s", "assumed", "x"),
                Term("decode_attention_kv_bytes", 1, "B", "assumed", "x"),
            ),
            "decode_attention_flops must be in FLOP, got 'FLOP/s'",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_problem(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_step_of_no_time_is_refused():
    zero = LayerTimes.measured(
        "zeros",
        head_and_sampling=0.0,
        **{k: 0.0 for k in UNITS if k not in ("dispatch", "combine")},
    )
    projection = PhaseProjection(
        TOY_POINT, H200, zero, toy_comm(0, 0), imbalance.PERFECT, dims=TOY_DIMS
    )
    with pytest.raises(ValueError, match="prefill_step_no_overlap must be greater than zero"):
        projection.step_times  # noqa: B018
