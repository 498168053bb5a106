"""benchmarks/bench_speculative.py on the CPU at the tiny preset: every table's rows, its step
costs timing the engine's speculative steps, the accepted lengths the forced acceptance rates
ask for, the projection read off the curve, and its refusals of bad options."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its neighbour bench_model
    spec = importlib.util.spec_from_file_location(
        "bench_speculative", BENCHMARKS / "bench_speculative.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cpu_run_gives_every_figure_and_the_accepted_lengths_asked_for(
    bench, tmp_path, capsys, monkeypatch
):
    batch, steps, rates = 16, 16, (0.0, 0.5, 1.0)
    out = tmp_path / "speculative.json"
    called = []  # the step costs' calls of the engine's speculative steps

    class Recorded(bench.SpeculativeSteps):
        def verify(self, batch, *args, **kwargs):
            called.append(("verify", self.draft_tokens, batch.query_lens, self.captured))
            return super().verify(batch, *args, **kwargs)

        def draft(self, batch, hidden, params, counts):
            called.append(("draft", self.draft_tokens, counts, self.captured))
            return super().draft(batch, hidden, params, counts)

    monkeypatch.setattr(bench, "SpeculativeSteps", Recorded)
    bench.main(
        ["--device", "cpu", "--preset", "tiny", "--prompt", "12", "--batches", "1,3",
         "--engine-batches", str(batch), "--draft-tokens", "1,3", "--rates", "1,0,0.5",
         "--steps", str(steps), "--reps", "1", "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    for table in ("step costs, ms", "engine decode", "projected: "):
        assert table in printed
    found = json.loads(out.read_text())

    costs = found["step_costs"]
    assert [(r["batch"], r["k"]) for r in costs] == [(1, 1), (1, 3), (3, 1), (3, 3)]
    # each step two untimed calls and one timed, eagerly (no CUDA here): verify over k + 1
    # tokens a sequence, then k drafts for each
    assert called == [
        call
        for b in (1, 3)
        for k in (1, 3)
        for call in [("verify", k, [k + 1] * b, False)] * 3 + [("draft", k, [k] * b, False)] * 3
    ]
    for r in costs:
        off_cuda = ("decode_graphs_ms", "decode_replay_ms", "verify_graphs_ms", "draft_replay_ms")
        assert all(r[name] is None for name in off_cuda)
        assert r["break_even_graphs"] is None and r["break_even_replay"] is None
        assert min(r["decode_eager_ms"], r["verify_eager_ms"], r["draft_eager_ms"]) > 0
        total = r["verify_eager_ms"] + r["draft_eager_ms"]
        assert r["break_even_eager"] == pytest.approx(total / r["decode_eager_ms"])

    plain, *speculative = found["engine"]
    assert (plain["draft_tokens"], plain["decode_path"]) == (0, "eager")
    assert plain["tokens"] == batch * steps
    assert [(r["draft_tokens"], r["forced_acceptance"], r["decode_path"]) for r in speculative] == [
        (k, rate, "eager") for k in (1, 3) for rate in rates
    ]
    rounds = batch * steps
    for r in speculative:
        k, rate = r["draft_tokens"], r["forced_acceptance"]
        want = sum(rate**j for j in range(k + 1))
        assert r["expected_accepted_length"] == pytest.approx(want)
        if rate in (0, 1):  # every draft rejected, or every one kept: exact
            assert r["accepted_length"] == want
            assert r["tokens"] == rounds * want
            assert r["acceptance_rate"] == rate
        else:  # within four standard deviations of the mean over the rounds
            kept = [(1 - rate) * rate**j for j in range(k)] + [rate**k]  # P(length j + 1)
            spread = math.sqrt(sum(p * (j + 1 - want) ** 2 for j, p in enumerate(kept)))
            assert abs(r["accepted_length"] - want) < 4 * spread / math.sqrt(rounds)
        assert r["tok_s"] == pytest.approx(r["tokens"] / (r["step_ms"] * steps / 1e3))
        assert r["speedup"] == pytest.approx(r["tok_s"] / plain["tok_s"])
        assert min(r["verify_ms"], r["draft_ms"]) > 0
        assert r["verify_ms"] + r["draft_ms"] < r["step_ms"]

    tok_s = {(r["draft_tokens"], r["forced_acceptance"]): r["tok_s"] for r in speculative}
    projected = found["projection"]
    assert [(r["draft_tokens"], r["acceptance"], r["decode_path"]) for r in projected] == [
        (1, 0.85, "eager"), (1, 0.9, "eager"), (3, 0.85, "eager"), (3, 0.9, "eager")
    ]  # fmt: skip
    for r in projected:
        k, share = r["draft_tokens"], (r["acceptance"] - 0.5) / 0.5  # of the way from 0.5 to 1
        want = (1 - share) * tok_s[k, 0.5] + share * tok_s[k, 1.0]
        assert r["tok_s"] == pytest.approx(want)
        assert r["speedup"] == pytest.approx(want / plain["tok_s"])


def test_sampled_requests_draft_by_sampling(bench, tmp_path, capsys, monkeypatch):
    """--temperature: the engines' requests are sampled at it."""
    out, drafted = tmp_path / "speculative.json", []
    fill = bench.fill

    def recorded(engine, batch, prompt, max_tokens, temperature):
        drafted.append(temperature)
        fill(engine, batch, prompt, max_tokens, temperature)
        assert all(s.params.temperature == temperature for s in engine.scheduler.running)

    monkeypatch.setattr(bench, "fill", recorded)
    bench.main(
        ["--device", "cpu", "--preset", "tiny", "--prompt", "12", "--batches", "1",
         "--engine-batches", "4", "--draft-tokens", "2", "--rates", "0.5", "--steps", "3",
         "--reps", "1", "--temperature", "0.8", "--json", str(out)]
    )  # fmt: skip
    assert "sampled at temperature 0.8" in capsys.readouterr().out
    assert drafted == [0.8, 0.8]  # the plain engine's requests, the speculative one's
    rows = json.loads(out.read_text())["engine"]
    assert [(r["draft_tokens"], r["decode_path"]) for r in rows] == [(0, "eager"), (2, "eager")]


def test_help_and_bad_options(bench, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0
    assert "--draft-tokens" in capsys.readouterr().out
    for options, problem in (
        (["--rates", "0,1.5"], "--rates takes rates from 0 to 1 separated by commas, got '0,1.5'"),
        (["--rates", "0,half"], "--rates takes rates from 0 to 1 separated by commas"),
        (["--draft-tokens", "1,4"], "draft_tokens must be 1 to 3, got 4"),
        (["--batches", "8,0"], "--batches takes integers >= 1 separated by commas, got '8,0'"),
        (["--engine-batches", "x"], "--engine-batches takes integers >= 1"),
        (["--steps", "0"], "--steps takes integers >= 1 separated by commas, got '0'"),
        (["--temperature", "-1"], "--temperature takes 0 to 100, got -1.0"),
        (["--temperature", "nan"], "--temperature takes 0 to 100, got nan"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--device", "cpu", *options])
        assert exit_.value.code == 2
        assert problem in capsys.readouterr().err
