"""``kvcache-ext serve`` and each request on its own, against the real server on localhost (the
CLI as a user starts it, the default model): a bad request gets a 4xx error in OpenAI's shape
naming the field and the value, before anything runs; each request samples with its own
settings; a non-streamed request whose client leaves gives its pages back; and GET /v1/kvcache
tells the pages live requests hold from those HF's paged cache keeps for reuse."""
import json
import threading
import time

import pytest

from test_serve_load import NEEDS_A_SERVER, start_server, stop_server

pytestmark = NEEDS_A_SERVER

HELLO = [{"role": "user", "content": "Say hello."}]
ENGINE = ["--num-blocks", "3", "--max-batch-tokens", "256", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base, model, process, lines = start_server(["--policy", "ada-snapkv", "--keep", "0.125", *ENGINE],
                                               tmp_path_factory.mktemp("serve-requests"))
    yield base, model
    stop_server(process, lines)


def stats(base: str) -> dict:
    import httpx
    return next(iter(httpx.get(f"{base}/v1/kvcache", timeout=10).json()["models"].values()))


# (route, body, the field named, what the message shows of the value): each must get a 4xx.
BAD = [
    ("chat/completions", {"max_tokens": 4}, "messages", "missing"),
    ("chat/completions", {"messages": "hi"}, "messages", '"hi"'),
    ("chat/completions", {"messages": []}, "messages", "[]"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", '"robot"'),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "text only"),
    ("chat/completions", {"messages": HELLO, "max_tokens": "abc"}, "max_tokens", '"abc"'),
    ("chat/completions", {"messages": HELLO, "max_tokens": -1}, "max_tokens", "-1"),
    ("chat/completions", {"messages": HELLO, "max_tokens": 0}, "max_tokens", "0"),
    ("chat/completions", {"messages": HELLO, "max_completion_tokens": 2.5}, "max_completion_tokens", "2.5"),
    ("chat/completions", {"messages": HELLO, "temperature": -5}, "temperature", "-5"),
    ("chat/completions", {"messages": HELLO, "temperature": "hot"}, "temperature", '"hot"'),
    ("chat/completions", {"messages": HELLO, "top_p": 0}, "top_p", "0"),
    ("chat/completions", {"messages": HELLO, "top_k": 0}, "top_k", "0"),
    ("chat/completions", {"messages": HELLO, "n": 3}, "n", "3"),
    ("chat/completions", {"messages": HELLO, "seed": 7}, "seed", "7"),
    ("chat/completions", {"messages": HELLO, "stop": ["\n"]}, "stop", '["\\n"]'),
    ("chat/completions", {"messages": HELLO, "frequency_penalty": 0.5}, "frequency_penalty", "0.5"),
    ("chat/completions", {"messages": HELLO, "logprobs": True}, "logprobs", "true"),
    ("chat/completions", {"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format",
     "json_object"),
    ("chat/completions", {"messages": HELLO, "stream": "yes"}, "stream", '"yes"'),
    ("chat/completions", {"messages": HELLO, "no_such_field": 1}, "no_such_field", "unrecognized"),
    ("completions", {"max_tokens": 4}, "prompt", "missing"),
    ("completions", {"prompt": ["a", "b"]}, "prompt", '["a", "b"]'),
    ("completions", {"prompt": ""}, "prompt", '""'),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "0"),
    ("completions", {"prompt": "hi", "best_of": 2}, "best_of", "2"),
    ("completions", {"prompt": "hi", "echo": True}, "echo", "true"),
    ("responses", {"stream": False}, "input", "missing"),
    ("responses", {"input": [], "stream": False}, "input", "[]"),
    ("responses", {"input": "hi", "max_output_tokens": 0, "stream": False}, "max_output_tokens", "0"),
    ("responses", {"input": "hi", "previous_response_id": "r1", "stream": False}, "previous_response_id", '"r1"'),
]


def test_every_bad_request_gets_a_4xx_error_naming_the_field_and_the_value(server):
    import httpx
    base, model = server
    with httpx.Client(timeout=30) as client:
        for route, body, param, shown in BAD:
            response = client.post(f"{base}/v1/{route}", json=body)
            assert response.status_code == 400, (route, body, response.status_code, response.text)
            assert response.headers["content-type"] == "application/json", (route, body)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == param and shown in error["message"], (route, body, error)
        for content in (b'{"messages": [', b'[1, 2]'):         # not JSON; JSON but not an object
            response = client.post(f"{base}/v1/chat/completions", content=content,
                                   headers={"content-type": "application/json"})
            assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"], content
        wrong = client.post(f"{base}/v1/chat/completions", json={"model": "no-such-model", "messages": HELLO})
        assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model", wrong.text
        assert "no-such-model" in wrong.json()["error"]["message"] and model in wrong.json()["error"]["message"]
        missing = client.get(f"{base}/v1/no-such-route")
        assert missing.status_code == 404 and missing.json()["error"]["message"], missing.text
    # Nothing reached the engine, which is built at the first request that does (this module's first).
    assert "running" not in stats(base)


def answer(client, base: str, **fields) -> str:
    response = client.post(f"{base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8, **fields})
    assert response.status_code == 200, (fields, response.text)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    return choice["message"]["content"]


def test_each_request_samples_with_its_own_settings(server):
    """A greedy request first does not make the later ones greedy (the engine's config is not
    the first request's), nor does a sampled one make a greedy one sample, alone or in a batch
    beside it; top_k 1 is greedy at any temperature. The model decodes greedily by default."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor
    base, _ = server
    with httpx.Client(timeout=120) as client:
        greedy = answer(client, base, temperature=0)
        sampled = [answer(client, base, temperature=2.0) for _ in range(2)]
        assert any(s != greedy for s in sampled), (greedy, sampled)
        assert answer(client, base, temperature=2.0, top_k=1) == greedy
        assert answer(client, base) == greedy
        with ThreadPoolExecutor(4) as pool:      # greedy and sampled requests in the same batches
            together = list(pool.map(lambda t: answer(client, base, temperature=t), (0, 2.0, 0, 2.0)))
        assert together[0] == together[2] == greedy, together


def test_a_non_streamed_request_cancelled_by_its_client_frees_its_pages_within_a_second(server):
    import httpx
    base, _ = server
    outcome = {}

    def leaving_client():
        body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
                "max_tokens": 400, "temperature": 0}
        try:
            outcome["answered"] = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=4).status_code
        except httpx.TimeoutException:
            outcome["left"] = time.monotonic()
    client = threading.Thread(target=leaving_client)
    client.start()
    busy = False
    while client.is_alive():
        now = stats(base)
        busy = busy or (now["running"] == 1 and now["held_bytes"] > 0)
        time.sleep(0.1)
    client.join()
    assert "left" in outcome, f"answered before its client left: {outcome}"
    assert busy, "the request never ran while its client waited"
    while True:
        now = stats(base)
        idle = (now["running"], now["waiting"], now["reserved_bytes"], now["held_bytes"]) == (0, 0, 0, 0)
        if idle or time.monotonic() - outcome["left"] > 1.0:
            break
        time.sleep(0.05)
    assert idle, f"still held {time.monotonic() - outcome['left']:.2f} s after the client left: {now}"
    with httpx.Client(timeout=120) as c:      # and the server goes on serving
        assert answer(c, base, temperature=0)


def test_hf_paged_cache_tells_the_pages_live_requests_hold_from_those_kept_for_reuse(tmp_path):
    """--policy full: after a request, HF's paged cache keeps its prompt's complete blocks (256
    tokens each) for a later prompt that starts the same way; no live request holds them."""
    import httpx
    base, model, process, lines = start_server(["--policy", "full", *ENGINE], tmp_path)
    try:
        with httpx.Client(timeout=120) as client:
            story = "Once upon a time a lighthouse keeper counted the ships that passed. " * 30
            response = client.post(f"{base}/v1/completions", json={"prompt": story, "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
        after = stats(base)
    finally:
        stop_server(process, lines)
    assert after["policy"] is None and after["budget_bytes"] > 0
    assert (after["running"], after["waiting"], after["held_bytes"], after["reserved_bytes"]) == (0, 0, 0, 0), after
    assert 0 < after["kept_for_reuse_bytes"] < after["budget_bytes"], json.dumps(after)
