"""The OpenAI-compatible HTTP API under generated bodies (hypothesis), on the shared `--role all`
deployment: JSON of every shape, valid requests beside wrong types, out-of-range numbers, NaN,
huge lists and unknown fields. Every answer comes within its timeout, is never a 500, is an
OpenAI-style error when it is not a 200, and a streamed 200 ends with `data: [DONE]`; afterwards
the server still answers a plain request and holds no page."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ref_server.client import Client

VOCAB = 512  # the tiny preset's
ERROR_STATUSES = {400, 404, 413, 422, 429}

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
any_json = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
token_ids = st.lists(st.integers(-3, VOCAB + 3), min_size=0, max_size=24)
prompts = st.one_of(
    st.text(max_size=60),
    token_ids,
    st.lists(st.text(max_size=20), max_size=3),
    st.lists(token_ids, max_size=3),
    any_json,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "robot", ""])
            | any_json,
            "content": st.text(max_size=40) | st.none() | any_json,
        },
        optional={"name": st.text(max_size=8), "tool_calls": any_json},
    ),
    max_size=4,
)
sampling = {
    "max_tokens": st.integers(-2, 6) | st.sampled_from([0, 2049, 2**31, 1e30, 2.5, "4"]) | any_json,
    "temperature": st.floats(-1, 3) | st.sampled_from([float("nan"), float("inf"), 1e-40]),
    "top_p": st.floats(-0.5, 1.5) | any_json,
    "top_k": st.integers(-2, 50) | any_json,
    "n": st.integers(-1, 3) | st.sampled_from([17, 10**6]),
    "seed": st.integers(-(2**70), 2**70) | any_json,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20) | any_json,
    "stop_token_ids": st.lists(st.integers(-2, VOCAB + 2), max_size=8) | any_json,
    "stream": st.booleans() | any_json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | any_json,
    "echo": st.booleans(),
    "logprobs": st.none() | st.integers(0, 3),
    "model": st.sampled_from(["tiny", "other"]) | any_json,
    "user": st.text(max_size=10),
    "unknown_field": any_json,
}
valid_sampling = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**32),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
}
valid_bodies = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
        "max_tokens": st.integers(1, 6),
    },
    optional=valid_sampling,
)
completion_bodies = st.fixed_dictionaries({"prompt": prompts}, optional=sampling)
chat_bodies = st.fixed_dictionaries({"messages": messages | any_json}, optional=sampling)
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), valid_bodies),
    st.tuples(st.just("/v1/completions"), completion_bodies),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), any_json),
)


@pytest.fixture(scope="module")
def http(tiny_deployment):
    base_url = f"http://127.0.0.1:{tiny_deployment.config.http_port}"
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


SEEN: set[int] = set()  # the statuses the generated bodies got


def check_answer(response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    SEEN.add(status)
    assert status == 200 or status in ERROR_STATUSES, (status, response.text[:500])
    if status != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert "Traceback" not in error["message"]
        return
    if streamed:
        assert response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
    else:
        assert response.json()["choices"] is not None


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=requests)
def test_generated_bodies_never_get_a_500_or_a_stall(http, case):
    path, body = case
    streamed = isinstance(body, dict) and body.get("stream") is True
    response = http.post(  # a timeout fails the test
        path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
    )
    check_answer(response, streamed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_bytes_that_are_not_json_get_a_400(http, raw):
    response = http.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    if response.status_code != 200:  # some byte strings are valid JSON bodies
        check_answer(response, streamed=False)


def test_the_server_still_serves_and_holds_no_page_after_the_fuzzing(
    http, tiny_deployment, serving
):
    assert {200, 400} <= SEEN  # the bodies reached generation as well as the checks
    answer = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    with Client(tiny_deployment.address) as client:
        serving.wait_idle(client, timeout=5)
