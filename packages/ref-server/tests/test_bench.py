"""`ref-server bench`: the workload and the report's arithmetic on fixed inputs, then the load
generator against one live `--role all` deployment of the tiny preset (gRPC and OpenAI APIs,
the schedules, cache hits, the fill window) and the command line's answers to bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from ref_server.bench.plot import MISSING, draw, require_matplotlib
from ref_server.bench.report import (
    SCHEMA,
    Mode,
    NoFullBatch,
    Record,
    distribution,
    full_batch_window,
    summarize,
)
from ref_server.bench.runner import arrival_times, run_bench, send_all
from ref_server.bench.targets import GrpcTarget, OpenAITarget, RequestOptions
from ref_server.bench.workload import LengthSpec, Workload, read_length_file
from ref_server.services.deployment import Deployment, free_port

# ---------------------------------------------------------------- the workload


@pytest.mark.parametrize(
    ("text", "low", "high"), [("128", 128, 128), ("64..512", 64, 512), (" 3 .. 5 ", 3, 5)]
)
def test_length_specs_are_fixed_or_a_range(text, low, high):
    spec = LengthSpec.parse(text)
    assert (spec.low, spec.high) == (low, high)
    assert str(spec) == text.replace(" ", "")


@pytest.mark.parametrize("text", ["0", "5..2", "abc", "-3", "1..", "1.5", "2..x"])
def test_bad_length_specs_are_refused(text):
    with pytest.raises(ValueError, match="expected"):
        LengthSpec.parse(text)


def test_the_workload_follows_its_seed_and_shares_its_prefix():
    workload = Workload(LengthSpec(40, 80), LengthSpec(3, 9), shared_prefix=0.5, seed=7)
    requests = workload.requests(50, vocab_size=300)
    assert requests == workload.requests(50, vocab_size=300)  # the same seed, the same requests
    assert requests != Workload(
        LengthSpec(40, 80), LengthSpec(3, 9), shared_prefix=0.5, seed=8
    ).requests(50, 300)
    lengths = [(len(r.prompt), r.max_tokens) for r in requests]
    assert all(40 <= p <= 80 and 3 <= m <= 9 for p, m in lengths)
    assert len(set(lengths)) > 10  # drawn, not one value
    assert all(0 <= t < 300 for r in requests for t in r.prompt)
    longest = max(requests, key=lambda r: len(r.prompt)).prompt
    prefix = longest[: len(longest) // 2]
    for r in requests:  # floor(0.5 n) leading tokens are the one shared prefix, then its own
        shared = len(r.prompt) // 2
        assert r.prompt[:shared] == prefix[:shared]
        if shared + 8 <= len(prefix):
            assert r.prompt[shared : shared + 8] != prefix[shared : shared + 8]
    later = workload.requests(50, vocab_size=300, run=1)  # the next run of a sweep
    assert [(len(r.prompt), r.max_tokens) for r in later] == lengths
    for first, second in zip(requests, later, strict=True):
        shared = len(first.prompt) // 2
        assert second.prompt[:shared] == first.prompt[:shared]
        assert second.prompt[shared:] != first.prompt[shared:]


def test_a_length_file_is_used_in_order_and_repeated(tmp_path):
    path = tmp_path / "lengths.jsonl"
    rows = [(10, 2), (20, 3), (30, 4)]
    path.write_text(
        "\n".join(json.dumps({"prompt_tokens": p, "output_tokens": m}) for p, m in rows) + "\n\n"
    )
    workload = Workload(length_file=read_length_file(path))
    assert workload.lengths(5) == [*rows, *rows[:2]]
    assert [(len(r.prompt), r.max_tokens) for r in workload.requests(4, 50)] == [*rows, rows[0]]
    assert workload.describe()["length_file_lines"] == 3
    with pytest.raises(ValueError, match="request 2 asks 30 prompt \\+ 4 output tokens"):
        workload.check_context(3, max_model_len=33)
    workload.check_context(3, max_model_len=34)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt_tokens": 3, "output_tokens": 2}\nnot json\n', "line 2 is not JSON"),
        ('{"prompt_tokens": 3}\n', "line 1: expected"),
        ('{"prompt_tokens": 0, "output_tokens": 2}\n', "whole numbers > 0"),
        ('{"prompt_tokens": 3.0, "output_tokens": 2}\n', "whole numbers > 0"),
        ('{"prompt_tokens": true, "output_tokens": 2}\n', "whole numbers > 0"),
        ("[3, 2]\n", "line 1: expected"),
        ("\n\n", "holds no lengths"),
    ],
)
def test_malformed_length_files_are_refused_naming_the_line(tmp_path, text, message):
    path = tmp_path / "lengths.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_length_file(path)


def test_poisson_arrivals_follow_the_seed_and_the_rate():
    times = arrival_times(50.0, 20_000, seed=3)
    assert times == arrival_times(50.0, 20_000, seed=3) != arrival_times(50.0, 20_000, seed=4)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std == mean


# ---------------------------------------------------------------- the report's arithmetic


def test_percentiles_interpolate_between_ranks():
    assert distribution([float(v) for v in range(1, 11)]) == pytest.approx(
        {"mean": 5.5, "p50": 5.5, "p90": 9.1, "p99": 9.91}
    )
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_a_steady_state_run_is_summarized_from_its_records():
    records = [
        Record(0.0, 100, 5, [0.5, 0.6, 0.7, 0.8, 0.9], 0.9, 64, "length"),
        Record(0.2, 50, 8, [1.2, 1.4, 1.6], 1.7, 0, "stop"),
        Record(0.4, 30, 8, [], 0.45, error="RESOURCE_EXHAUSTED", detail="full"),
    ]
    run = summarize(records, Mode("rate", 2.0))
    assert run["label"] == "steady state (rate 2 req/s)"
    assert run["requests"] == {
        "sent": 3,
        "ok": 2,
        "errors": {"RESOURCE_EXHAUSTED": 1},
        "error_examples": {"RESOURCE_EXHAUSTED": "full"},
        "finish_reasons": {"length": 1, "stop": 1},
    }
    assert run["tokens"] == {"prompt": 150, "cached": 64, "output": 8}
    assert run["cache_hit_share"] == pytest.approx(64 / 150)
    assert run["duration_s"] == pytest.approx(1.7)
    assert run["throughput"] == pytest.approx(
        {"input_tok_s": 150 / 1.7, "output_tok_s": 8 / 1.7, "requests_per_s": 2 / 1.7}
    )
    assert run["ttft_s"] == pytest.approx({"mean": 0.75, "p50": 0.75, "p90": 0.95, "p99": 0.995})
    assert run["tpot_s"] == pytest.approx({"mean": 0.15, "p50": 0.15, "p90": 0.19, "p99": 0.199})
    assert run["latency_s"]["mean"] == pytest.approx(1.2)
    assert "window" not in run
    assert [r["output_tokens"] for r in run["records"]] == [5, 3, 0]
    assert run["records"][2]["error"] == "RESOURCE_EXHAUSTED"


def test_the_fill_window_runs_from_the_last_second_token_to_the_first_end():
    records = [
        Record(0.0, 10, 6, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.6, finish_reason="length"),
        Record(
            0.0, 10, 7, [0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75], 0.75, finish_reason="length"
        ),
        Record(0.0, 10, 7, [0.3, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85], 0.85, finish_reason="length"),
    ]
    window = full_batch_window(records)
    # from 0.35 (the third's second token) to 0.6 (the first's end): tokens after 0.35 up to
    # 0.6: 0.4, 0.5, 0.6 of the first, 0.45, 0.55 of the others
    assert (window.start_s, window.end_s, window.output_tokens) == (0.35, 0.6, 7)
    run = summarize(records, Mode("fill", 3))
    assert run["label"] == "saturation (fill 3)"
    assert run["window"] == pytest.approx(
        {"start_s": 0.35, "end_s": 0.6, "seconds": 0.25, "output_tokens": 7, "output_tok_s": 28.0}
    )
    assert run["window_problem"] is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: setattr(r[0], "token_s", [0.1, 0.2, 0.3]), "ended 0.150 s before the last one"),
        (lambda r: setattr(r[1], "error", "UNAVAILABLE"), "1 of 3 requests failed"),
        (lambda r: setattr(r[2], "token_s", [0.3, 0.4]), "1 requests ended with fewer than 3"),
        (lambda r: r[0].token_s.remove(0.9), "under 2 decode steps of 3: a request ended"),
    ],
)
def test_a_fill_run_that_never_ran_full_says_why(change, message):
    records = [Record(0.0, 10, 9, [0.1 * i, 0.1 * i + 0.25, 0.9, 1.0], 1.0) for i in range(3)]
    change(records)
    with pytest.raises(NoFullBatch, match=message):
        full_batch_window(records)
    run = summarize(records, Mode("fill", 3))
    assert run["window"] is None and message in run["window_problem"]


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("rate", -1, "rate must be a finite number > 0, got -1"),
        ("rate", float("nan"), "got nan"),
        ("concurrency", 0, "concurrency must be a finite number > 0"),
        ("fill", 2.5, "fill must be a whole number, got 2.5"),
        ("burst", 1, "mode must be one of rate, concurrency, fill"),
    ],
)
def test_bad_modes_are_refused(kind, value, message):
    with pytest.raises(ValueError, match=message):
        Mode(kind, value)


# ---------------------------------------------------------------- against a live deployment


@pytest.fixture(scope="module")
def deployment(serving):
    running = Deployment(serving.config(num_blocks=256), startup_timeout=120)
    yield running
    running.stop()


def grpc_target(deployment) -> GrpcTarget:
    return GrpcTarget(deployment.address, RequestOptions(timeout_s=60))


def openai_target(deployment) -> OpenAITarget:
    return OpenAITarget(
        f"http://127.0.0.1:{deployment.config.http_port}", RequestOptions(timeout_s=60)
    )


def outcomes(run: dict) -> list[tuple]:
    """What each request asked for and got, in the workload's order."""
    return [
        (r["prompt_tokens"], r["max_tokens"], r["output_tokens"], r["finish_reason"], r["error"])
        for r in run["records"]
    ]


def test_bench_over_grpc_sends_what_was_asked_and_reports_it(deployment):
    workload = Workload(LengthSpec(20, 60), LengthSpec(4, 12), seed=11)
    document = run_bench(grpc_target(deployment), workload, [Mode("concurrency", 4)], requests=12)
    assert document["schema"] == SCHEMA and document["api"] == "grpc"
    assert document["model"] == {"name": "tiny", "vocab_size": 512, "max_model_len": 512}
    assert document["workload"] == {
        "prompt_tokens": "20..60",
        "output_tokens": "4..12",
        "shared_prefix": 0.0,
        "seed": 11,
        "prompt_token_ids_below": 512,
    }
    [run] = document["runs"]
    assert run["label"] == "steady state (concurrency 4)"
    assert run["requests"]["sent"] == run["requests"]["ok"] == 12
    assert run["requests"]["errors"] == {}
    asked = workload.lengths(12)
    assert [(r["prompt_tokens"], r["max_tokens"]) for r in run["records"]] == asked
    for r in run["records"]:  # no ignore_eos in the API: max_tokens unless eos came first
        assert 1 <= r["output_tokens"] <= r["max_tokens"]
        assert (r["output_tokens"] == r["max_tokens"]) == (r["finish_reason"] == "length")
    assert run["tokens"]["prompt"] == sum(p for p, _ in asked)
    assert run["tokens"]["output"] == sum(r["output_tokens"] for r in run["records"])
    assert run["tokens"]["cached"] == 0  # no prompt shares a page with another
    throughput = run["throughput"]
    assert throughput["input_tok_s"] * run["duration_s"] == pytest.approx(run["tokens"]["prompt"])
    assert throughput["output_tok_s"] * run["duration_s"] == pytest.approx(run["tokens"]["output"])
    for key in ("ttft_s", "tpot_s", "latency_s"):
        figures = run[key]
        assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"] < 30, key
    assert run["ttft_s"]["p99"] < run["latency_s"]["p99"]
    ends = [r["sent_s"] + r["latency_s"] for r in run["records"]]
    first_sent = min(r["sent_s"] for r in run["records"])
    assert max(ends) - first_sent == pytest.approx(run["duration_s"])
    json.dumps(document, allow_nan=False)  # plain JSON


def test_the_openai_api_gives_the_same_counts(deployment):
    workload = Workload(LengthSpec(20, 60), LengthSpec(4, 12), seed=12)
    modes = [Mode("concurrency", 3)]
    over_grpc = run_bench(grpc_target(deployment), workload, modes, requests=9)
    over_http = run_bench(openai_target(deployment), workload, modes, 9)
    assert over_http["api"] == "openai"  # /v1/models told the vocabulary
    assert over_http["model"] == {"name": "tiny", "vocab_size": 512, "max_model_len": 512}
    [grpc_run], [http_run] = over_grpc["runs"], over_http["runs"]
    assert http_run["requests"]["errors"] == {}
    # the same prompts, greedy: the same tokens (the second time from the prefix cache)
    assert outcomes(http_run) == outcomes(grpc_run)
    assert http_run["tokens"]["output"] == grpc_run["tokens"]["output"]
    assert http_run["tokens"]["cached"] > 0
    assert http_run["ttft_s"]["p50"] > 0 and http_run["tpot_s"]["p50"] > 0


def test_a_shared_prefix_is_found_in_the_cache(deployment):
    # 48 of 64 tokens shared: 3 pages of 16; one request at a time, so each after the first
    # finds them
    workload = Workload(LengthSpec(64, 64), LengthSpec(4, 4), shared_prefix=0.75, seed=13)
    document = run_bench(grpc_target(deployment), workload, [Mode("concurrency", 1)], requests=6)
    [run] = document["runs"]
    assert [r["cached_tokens"] for r in run["records"]] == [0, 48, 48, 48, 48, 48]
    assert run["cache_hit_share"] == pytest.approx(240 / 384)


def test_a_sweep_of_rates_sends_on_the_poisson_schedule(deployment):
    workload = Workload(LengthSpec(16, 16), LengthSpec(4, 4), seed=14)
    modes = [Mode("rate", 20.0), Mode("rate", 40.0)]
    document = run_bench(grpc_target(deployment), workload, modes, requests=8)
    assert [run["label"] for run in document["runs"]] == [
        "steady state (rate 20 req/s)",
        "steady state (rate 40 req/s)",
    ]
    for run, mode in zip(document["runs"], modes, strict=True):
        assert run["requests"]["ok"] == 8
        sent = [r["sent_s"] for r in run["records"]]
        assert sent == pytest.approx(arrival_times(mode.value, 8, seed=14), abs=0.05)


def test_fill_mode_measures_the_window_in_which_all_decode(deployment):
    workload = Workload(LengthSpec(24, 24), LengthSpec(64, 64), seed=15)
    document = run_bench(grpc_target(deployment), workload, [Mode("fill", 8)])
    [run] = document["runs"]
    assert run["label"] == "saturation (fill 8)"
    assert run["requests"]["sent"] == run["requests"]["ok"] == 8
    window = run["window"]
    assert window is not None, run["window_problem"]
    assert 0 < window["start_s"] < window["end_s"] <= run["duration_s"]
    assert window["seconds"] == pytest.approx(window["end_s"] - window["start_s"])
    # each of the 8 decodes through the whole window, one token per step
    assert 2 * 8 <= window["output_tokens"] < run["tokens"]["output"]
    assert window["output_tok_s"] == pytest.approx(window["output_tokens"] / window["seconds"])
    assert max(r["ttft_s"] for r in run["records"]) < window["start_s"]
    # over HTTP, with tokens spread evenly between each request's first and last chunk
    over_http = run_bench(openai_target(deployment), workload, [Mode("fill", 8)], vocab_size=512)
    [http_run] = over_http["runs"]
    assert http_run["window"] is not None, http_run["window_problem"]
    assert 2 * 8 <= http_run["window"]["output_tokens"] < http_run["tokens"]["output"]


def test_refusals_are_counted_by_status(deployment, monkeypatch):
    # token ids up to 1000 against a vocabulary of 512 (as if the server did not tell it): the
    # server refuses every request
    workload = Workload(LengthSpec(40, 40), LengthSpec(4, 4), seed=18)
    target = openai_target(deployment)
    probe = target.probe
    monkeypatch.setattr(target, "probe", lambda: dataclasses.replace(probe(), vocab_size=None))
    document = run_bench(target, workload, [Mode("concurrency", 2)], 4, vocab_size=1000)
    [run] = document["runs"]
    assert run["requests"]["ok"] == 0
    assert run["requests"]["errors"] == {"HTTP 400": 4}
    assert "outside [0, 512)" in run["requests"]["error_examples"]["HTTP 400"]
    assert run["throughput"]["output_tok_s"] == 0 and run["ttft_s"]["p50"] is None
    refused = asyncio.run(
        send_all(grpc_target(deployment), workload.requests(3, 1000), Mode("concurrency", 3), 0)
    )
    assert [r.error for r in refused] == ["INVALID_ARGUMENT"] * 3
    assert all("outside [0, 512)" in r.detail for r in refused), refused[0].detail


def test_the_command_prints_json_and_draws_the_plot(deployment, tmp_path):
    png = tmp_path / "curve.png"
    args = ["--address", deployment.address, "--concurrency", "1,2", "--requests", "4"]
    args += ["--prompt-tokens", "16..32", "--output-tokens", "4", "--seed", "16"]
    result = bench(*args, "--json", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert [run["label"] for run in document["runs"]] == [
        "steady state (concurrency 1)",
        "steady state (concurrency 2)",
    ]
    assert all(run["requests"]["ok"] == 4 for run in document["runs"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 16 tokens: a window of all 3 decoding that outlasts 2 steps on a loaded machine too
    fill = ["--address", deployment.address, "--fill", "3", "--output-tokens", "16", "--seed", "17"]
    table = bench(*fill)
    assert table.returncode == 0, table.stderr
    assert "saturation (fill 3)" in table.stdout
    assert "output tok/s at saturation" in table.stdout


# ---------------------------------------------------------------- the command line


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ref_server", "bench", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("ref-server bench: error: "), line
    return line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "-1"], "rate must be a finite number > 0, got -1"),
        (["--rate", "0"], "rate must be a finite number > 0, got 0"),
        (["--rate", "fast"], "argument --rate: expected numbers separated by commas"),
        (["--concurrency", "1.5"], "concurrency must be a whole number, got 1.5"),
        (
            ["--concurrency", "2", "--requests", "0"],
            "argument --requests: must be a whole number > 0",
        ),
        (
            ["--rate", "1", "--concurrency", "2"],
            "argument --concurrency: not allowed with argument --rate",
        ),
        ([], "one of the arguments --rate --concurrency --fill is required"),
        (["--fill", "4", "--requests", "3"], "fill N sends N requests; leave out --requests"),
        (["--rate", "1", "--prompt-tokens", "9..3"], "--prompt-tokens: expected 0 < LO <= HI"),
        (["--rate", "1", "--shared-prefix", "1.5"], "shared prefix ratio must be in 0..1"),
        (
            ["--rate", "1", "--lengths", "/nonexistent/l.jsonl"],
            "length file not found: /nonexistent/l.jsonl",
        ),
        (["--rate", "1", "--lengths", "{bad}"], "line 2 is not JSON"),
        (
            ["--rate", "1", "--lengths", "{good}", "--output-tokens", "4"],
            "leave out --prompt-tokens",
        ),
        (["--rate", "1", "--api-key-file", "/nonexistent/key"], "API key file not found"),
        (["--rate", "1", "--timeout", "0"], "--timeout must be > 0"),
    ],
)
def test_bad_arguments_exit_with_one_clear_line(tmp_path, args, message):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"prompt_tokens": 3, "output_tokens": 2}\n')
    bad.write_text('{"prompt_tokens": 3, "output_tokens": 2}\n{"prompt_tokens": \n')
    args = [{"{bad}": str(bad), "{good}": str(good)}.get(a, a) for a in args]
    assert message in one_error_line(bench(*args))


def test_an_unreachable_address_is_one_line():
    port = free_port()  # nothing listens there
    line = one_error_line(bench("--rate", "1", "--address", f"127.0.0.1:{port}"))
    assert f"cannot reach the router at 127.0.0.1:{port}: UNAVAILABLE" in line
    line = one_error_line(
        bench("--rate", "1", "--api", "openai", "--url", f"http://127.0.0.1:{port}")
    )
    assert f"cannot reach http://127.0.0.1:{port}/v1/models" in line


def test_a_server_that_does_not_tell_its_vocabulary_needs_vocab_size(deployment, monkeypatch):
    target = openai_target(deployment)
    probe = target.probe
    monkeypatch.setattr(target, "probe", lambda: dataclasses.replace(probe(), vocab_size=None))
    workload = Workload(LengthSpec(4, 4), LengthSpec(2, 2), seed=1)
    with pytest.raises(ValueError, match="--api openai needs --vocab-size"):
        run_bench(target, workload, [Mode("concurrency", 1)], 1)
    document = run_bench(target, workload, [Mode("concurrency", 1)], 1, vocab_size=512)
    assert document["runs"][0]["requests"]["ok"] == 1


def test_what_the_server_refuses_is_one_line(deployment):
    line = one_error_line(
        bench("--fill", "2", "--address", deployment.address, "--prompt-tokens", "500")
    )
    assert (
        "request 0 asks 500 prompt + 32 output tokens, over the server's context limit of 512"
        in line
    )


def test_plotting_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match="--plot needs matplotlib: pip install"):
        require_matplotlib()
    with pytest.raises(RuntimeError, match=re.escape(MISSING)):
        draw({"runs": []}, tmp_path / "x.png")


def test_bench_help_imports_no_torch_grpc_fastapi_or_rich():
    probe = """
import contextlib, io, sys
from ref_server.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(["bench", "--help"])
assert "--concurrency" in out.getvalue() and "saturation" in out.getvalue()
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "grpc", "fastapi", "rich"}))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
