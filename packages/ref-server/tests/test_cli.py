import json
import subprocess
import sys

import pytest


def ref_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ref_server", *args], capture_output=True, text=True, timeout=60
    )


def test_economics_table_shows_the_published_day():
    result = ref_server("economics")
    assert result.returncode == 0, result.stderr
    for figure in ("$87,072", "$562,027", "545%"):
        assert figure in result.stdout


def test_economics_json_layers_preset_file_and_flags(tmp_path):
    config = tmp_path / "rented.toml"
    config.write_text('preset = "deepseek-day6"\ngpu_hour_usd = 3.0\nmean_nodes = 100\n')
    result = ref_server("economics", "--config", str(config), "--mean-nodes", "50", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["preset"] == "deepseek-day6"
    assert document["inputs"]["gpu_hour_usd"] == 3.0  # from the file
    assert document["inputs"]["mean_nodes"] == 50  # the flag wins over the file
    assert document["inputs"]["output_usd_per_m"] == 2.19  # from the preset
    assert document["report"]["cost_usd"] == pytest.approx(3.0 * 8 * 50 * 24)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--output-usd-per-m", "-1"], "output_usd_per_m must not be negative"),
        (["--mean-nodes", "0"], "mean_nodes must be greater than zero"),
        (["--cache-hit-tokens", "7e11"], "cache_hit_tokens (7e+11) exceeds input_tokens"),
        (["--preset", "gpt-day1"], "unknown preset 'gpt-day1'"),
        (["--config", "/nonexistent/day.toml"], "config file not found: /nonexistent/day.toml"),
    ],
)
def test_economics_bad_input_exits_with_one_clear_message(args, message):
    result = ref_server("economics", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("ref-server economics: error: ")
    assert message in line


def test_unparseable_number_is_rejected_by_the_parser():
    result = ref_server("economics", "--gpu-hour-usd", "cheap")
    assert result.returncode == 2
    assert "invalid float value: 'cheap'" in result.stderr
    assert "Traceback" not in result.stderr
