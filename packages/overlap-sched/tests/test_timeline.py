import json
import subprocess
import sys
import time

import numpy as np
import pytest

from overlap_sched.executor import run_overlapped
from overlap_sched.operations import Op, Yield
from overlap_sched.recorder import Recorder
from overlap_sched.state import State
from overlap_sched.timeline import COLOURS, draw

image = pytest.importorskip("matplotlib.image")

OPS = [
    ("attn.core", "compute", 40),
    ("dispatch_a", "communication", 40),
    ("mlp", "compute", 50),
    ("combine_a", "communication", 35),
]


def event(name, cat, ts, dur, rank, track, microbatch=0, stage=0):
    args = {"microbatch": microbatch, "stage": stage}
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": ts,
        "dur": dur,
        "pid": rank,
        "tid": track,
        "args": args,
    }


def synthetic_events(layers=2, ranks=2):
    """Per rank: embed, then each layer's ops for microbatch 0 then 1, each track back to back."""
    events = []
    for rank in range(ranks):
        events.append(event("embed", "op", 0, 10, rank, "compute"))
        clock = {"compute": 10.0, "communication": 10.0}
        for layer in range(layers):
            for microbatch in (0, 1):
                for stage, (op, track, dur) in enumerate(OPS):
                    ts, clock[track] = clock[track], clock[track] + dur
                    events.append(
                        event(f"L{layer}.{op}", "op", ts, dur, rank, track, microbatch, stage)
                    )
                    events.append(
                        event(f"L{layer}.{op}", "host", ts, 1, rank, "host", microbatch, stage)
                    )
    return events


def colour_pixels(png, colour):
    pixels = image.imread(png)[..., :3]
    rgb = np.array([int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(pixels - rgb).max(axis=-1) < 0.02).sum())


def check_png(png, width=(700, 4100), height=(100, 1200)):
    assert png.exists()
    rows, cols = image.imread(png).shape[:2]
    assert width[0] <= cols <= width[1] and height[0] <= rows <= height[1]
    for colour in COLOURS[:2]:  # both microbatches drawn
        assert colour_pixels(png, colour) > 200


def test_synthetic_trace(tmp_path):
    out = draw({"traceEvents": synthetic_events()}, tmp_path / "t.png", title="two ranks")
    assert out == tmp_path / "t.png"
    check_png(out)


@pytest.mark.parametrize("form", ["dict", "list", "str", "path"])
def test_input_forms(tmp_path, form):
    events = synthetic_events(ranks=1)
    file = tmp_path / "trace.json"
    file.write_text(json.dumps({"traceEvents": events}))
    trace = {"dict": {"traceEvents": events}, "list": events, "str": str(file), "path": file}[form]
    check_png(draw(trace, str(tmp_path / "t.png")))


def test_width_grows_with_events(tmp_path):
    small = image.imread(draw(synthetic_events(layers=2), tmp_path / "s.png"))
    large = image.imread(draw(synthetic_events(layers=40), tmp_path / "l.png"))
    assert large.shape[1] > small.shape[1]
    assert large.shape[1] <= 4000


def test_milliseconds_for_long_spans(tmp_path):
    events = [dict(e, ts=e["ts"] * 100, dur=e["dur"] * 100) for e in synthetic_events()]
    check_png(draw(events, tmp_path / "t.png"))


class Event:
    def current_stream_wait(self):
        time.sleep(0.002)


def compute(key, reads=None):
    def op(state):
        if reads:
            getattr(state, reads)
        time.sleep(0.002)
        setattr(state, key, 1)

    return op


def communication(key, reads):
    def op(state):
        getattr(state, reads)
        setattr(state, key, 1)
        return Event()

    return op


def test_recorder_run(tmp_path):
    ops = [Op("embed", compute("x"))]
    previous = "x"
    for layer in range(2):
        ops += [Op(f"L{layer}.attn", compute(f"a{layer}", previous)), Yield()]
        ops += [Op(f"L{layer}.dispatch", communication(f"d{layer}", f"a{layer}")), Yield()]
        ops += [Op(f"L{layer}.experts", compute(f"e{layer}", f"d{layer}")), Yield()]
        ops += [Op(f"L{layer}.combine", communication(f"c{layer}", f"e{layer}")), Yield()]
        previous = f"c{layer}"
    ops += [Op("head", compute("y", previous))]
    events = []
    for rank in (0, 1):
        recorder = Recorder(cuda=False, rank=rank)
        run_overlapped(ops, [State(num_tokens=4), State(num_tokens=4)], 1, recorder=recorder)
        events += recorder.events()
    assert {e["tid"] for e in events if e["cat"] == "op"} == {"compute", "communication"}
    file = tmp_path / "run.trace.json"
    file.write_text(json.dumps({"traceEvents": events}))
    check_png(draw(file, tmp_path / "run.png", title="Recorder, CPU"))


@pytest.mark.parametrize(
    "trace", [[], {"traceEvents": []}, [e for e in synthetic_events() if e["cat"] == "host"]]
)
def test_no_op_events(tmp_path, trace):
    with pytest.raises(ValueError, match="no op events"):
        draw(trace, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_no_events_on_the_tracks(tmp_path):
    with pytest.raises(ValueError, match="no op events"):
        draw(synthetic_events(), tmp_path / "t.png", tracks=("host",))


def test_missing_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install overlap-sched\[plot\]"):
        draw(synthetic_events(), tmp_path / "t.png")


def test_import_needs_no_matplotlib():
    probe = "import sys, overlap_sched, overlap_sched.timeline; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
