import dataclasses
import math

import pytest

from ref_server import economics
from ref_server.economics import CostInputs, EconomicsError

DAY6 = economics.PRESETS["deepseek-day6"]

# One node of one GPU for ten hours: every figure below is worked out by hand.
SMALL = CostInputs(
    gpu_hour_usd=1.0,
    gpus_per_node=1,
    mean_nodes=1,
    peak_nodes=2,
    window_hours=10,
    input_tokens=1e6,
    cache_hit_tokens=0.25e6,
    output_tokens=0.5e6,
    input_hit_usd_per_m=1.0,
    input_miss_usd_per_m=2.0,
    output_usd_per_m=4.0,
    prefill_tokens_per_s_per_node=100,
    decode_tokens_per_s_per_node=10,
)


def test_day6_preset_reproduces_the_published_cost_revenue_and_margin():
    report = economics.evaluate(DAY6)
    assert report.cost_usd == 87_072
    assert round(report.revenue_usd) == 562_027
    assert round(report.margin * 100) == 545


def test_day6_preset_volumes_are_the_published_ones_as_rounded():
    assert DAY6.input_tokens == 608e9
    assert DAY6.cache_hit_tokens == 342e9
    assert round(DAY6.output_tokens / 1e9) == 168
    assert abs(economics.evaluate(DAY6).cache_hit_share - 0.563) < 0.0005


def test_day6_throughput_accounts_for_the_mean_fleet():
    # 73.7k input and 14.8k output tok/s per node serve the day's volume on ~226.8 nodes,
    # the published daily mean being 226.75.
    report = economics.evaluate(DAY6)
    assert report.prefill_nodes_needed == pytest.approx(95.48, abs=0.01)
    assert report.decode_nodes_needed == pytest.approx(131.36, abs=0.01)
    assert report.busy_share_of_mean_nodes == pytest.approx(1.0, abs=0.001)
    assert report.prefill_usd_per_m_input == pytest.approx(16 / (73.7e3 * 3600) * 1e6)
    assert report.decode_usd_per_m_output == pytest.approx(16 / (14.8e3 * 3600) * 1e6)


def test_hand_computed_small_deployment():
    report = economics.evaluate(SMALL)
    assert report.cost_usd == pytest.approx(10.0)
    assert report.peak_provisioned_cost_usd == pytest.approx(20.0)
    assert report.revenue_usd == pytest.approx(0.25 * 1 + 0.75 * 2 + 0.5 * 4)
    assert report.margin == pytest.approx((3.75 - 10) / 10)
    assert report.cache_hit_share == pytest.approx(0.25)
    assert report.prefill_usd_per_m_input == pytest.approx(1e6 / (100 * 3600))
    assert report.decode_usd_per_m_output == pytest.approx(1e6 / (10 * 3600))
    assert report.prefill_nodes_needed == pytest.approx(1e6 / (100 * 36_000))
    assert report.decode_nodes_needed == pytest.approx(0.5e6 / (10 * 36_000))
    assert report.busy_share_of_mean_nodes == pytest.approx(report.nodes_needed)


def test_doubling_the_gpu_price_doubles_cost_and_leaves_revenue():
    base, doubled = (
        economics.evaluate(dataclasses.replace(SMALL, gpu_hour_usd=price)) for price in (1, 2)
    )
    assert doubled.cost_usd == pytest.approx(2 * base.cost_usd)
    assert doubled.revenue_usd == base.revenue_usd
    assert doubled.decode_usd_per_m_output == pytest.approx(2 * base.decode_usd_per_m_output)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"output_usd_per_m": -1.0}, "output_usd_per_m must not be negative"),
        ({"gpu_hour_usd": -2.0}, "gpu_hour_usd must not be negative"),
        ({"mean_nodes": 0}, "mean_nodes must be greater than zero"),
        ({"gpu_hour_usd": 0}, "gpu_hour_usd must be greater than zero"),
        ({"decode_tokens_per_s_per_node": 0}, "decode_tokens_per_s_per_node must be greater"),
        ({"cache_hit_tokens": 2e6}, "cache_hit_tokens (2e+06) exceeds input_tokens (1e+06)"),
        ({"peak_nodes": 0.5}, "peak_nodes (0.5) is below mean_nodes (1)"),
        ({"gpus_per_node": 1.5}, "gpus_per_node must be a whole number"),
        ({"gpus_per_node": 0}, "gpus_per_node must be a whole number >= 1"),
        ({"input_tokens": math.nan}, "input_tokens must be finite"),
        ({"window_hours": math.inf}, "window_hours must be finite"),
        ({"output_tokens": "many"}, "output_tokens must be a number, got 'many'"),
        ({"output_tokens": True}, "output_tokens must be a number"),
    ],
)
def test_bad_inputs_name_the_problem(change, message):
    with pytest.raises(EconomicsError) as error:
        dataclasses.replace(SMALL, **change)
    assert message in str(error.value)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(EconomicsError, match="unknown preset 'nope'; known presets: deepseek-day6"):
        economics.build_inputs("nope")


def test_overrides_apply_in_order_and_none_keeps_the_value():
    inputs = economics.build_inputs(
        "deepseek-day6", {"gpu_hour_usd": 3.0, "mean_nodes": 100}, {"gpu_hour_usd": None}
    )
    assert inputs.gpu_hour_usd == 3.0
    assert inputs.mean_nodes == 100
    assert inputs.output_usd_per_m == DAY6.output_usd_per_m


def test_read_toml(tmp_path):
    path = tmp_path / "day.toml"
    path.write_text('preset = "deepseek-day6"\ngpu_hour_usd = 2.5\ngpus_per_node = 8\n')
    assert economics.read_toml(path) == {
        "preset": "deepseek-day6",
        "gpu_hour_usd": 2.5,
        "gpus_per_node": 8,
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu_hour_usd = ", "is not valid TOML"),
        ("gpu_hour = 2.0\n", "unknown keys: gpu_hour; known keys: preset, gpu_hour_usd"),
        (None, "config file not found"),
    ],
)
def test_read_toml_errors(tmp_path, text, message):
    path = tmp_path / "day.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(EconomicsError, match=message):
        economics.read_toml(path)
