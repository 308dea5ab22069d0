"""Fuzz: hypothesis-generated JSON bodies (right fields with wrong or extreme values, random
types, random extra keys) for both endpoints never get a 5xx, and the server stays healthy and
leaks nothing."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server import ServerThread  # noqa: E402  (tests/ is on sys.path under pytest)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_any = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), c, max_size=4)),
                        max_leaves=8)

small_int = st.integers(-3, 40)
num = st.one_of(st.floats(-3, 3, allow_nan=False), small_int)
common = {
    "model": st.sampled_from(["tiny", "other", "", None]),
    "max_tokens": st.one_of(st.integers(-2, 12), json_any),
    "temperature": st.one_of(num, json_any), "top_p": st.one_of(num, json_any),
    "top_k": st.one_of(small_int, json_any), "min_p": num, "seed": st.one_of(st.integers(-2**65, 2**65), json_any),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), json_any),
    "n": st.one_of(st.integers(-1, 3), json_any), "stream": st.one_of(st.booleans(), json_any),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_any),
    "ignore_eos": st.booleans(), "presence_penalty": num, "frequency_penalty": num,
    "repetition_penalty": num, "min_tokens": small_int,
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 1000), max_size=3), json_any),
}
token_ids = st.lists(st.integers(-5, 600), max_size=30)
completion_body = st.fixed_dictionaries({}, optional={
    **common,
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3), token_ids,
                        st.lists(token_ids, max_size=3), json_any),
    "logprobs": st.one_of(st.integers(-2, 25), json_any),
})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "bot"])},
                                optional={"content": st.one_of(st.text(max_size=30), json_any)})
chat_body = st.fixed_dictionaries({}, optional={
    **common,
    "messages": st.one_of(st.lists(message, max_size=4), json_any),
    "max_completion_tokens": st.one_of(st.integers(-2, 12), json_any),
    "logprobs": st.one_of(st.booleans(), json_any), "top_logprobs": st.one_of(st.integers(-2, 25), json_any),
})

# mostly valid bodies, so the fuzz also exercises generation (and its stop/penalty paths)
knobs = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
         "min_p": st.floats(0, 1), "seed": st.integers(0, 2**32), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
         "stream": st.booleans(), "ignore_eos": st.booleans(), "repetition_penalty": st.floats(0.5, 2)}
valid_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(3, 500), min_size=1, max_size=20)),
     "max_tokens": st.integers(1, 8)}, optional={**knobs, "logprobs": st.integers(0, 5)})
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=20)}), min_size=1, max_size=3),
     "max_tokens": st.integers(1, 8)}, optional={**knobs, "logprobs": st.booleans()})


@pytest.fixture(scope="module")
def fuzz_server(make_tiny_model):
    srv = ServerThread(make_tiny_model("llama"), served_name="tiny", max_model_len=64)
    yield srv
    srv.stop()


def _post(srv, path: str, body) -> int:
    with httpx.stream("POST", srv.url + path, content=json.dumps(body), timeout=30,
                      headers={"Content-Type": "application/json"}) as r:
        r.read()
        return r.status_code


@pytest.mark.parametrize("path,strategy", [("/v1/completions", st.one_of(completion_body, valid_completion)),
                                           ("/v1/chat/completions", st.one_of(chat_body, valid_chat))])
def test_fuzz_no_5xx(fuzz_server, path, strategy):
    seen: set[int] = set()

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=st.one_of(strategy, json_any))
    def check(body):
        status = _post(fuzz_server, path, body)
        seen.add(status)
        assert status < 500, body

    check()
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    assert {200, 400} <= seen  # the strategies reach both outcomes
    fuzz_server.wait_idle(timeout=10)
