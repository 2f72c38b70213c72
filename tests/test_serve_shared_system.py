"""``kvcache-ext serve --shared-system FILE``: the system message compressed once (here by KVzip,
whose passes run then) and read by every request that opens with it; a request that does not
is refused alone, with what to do, since KVzip's passes do not run in the engine."""
import pytest

from test_serve_load import NEEDS_A_SERVER, start_server, stop_server

pytestmark = NEEDS_A_SERVER

SYSTEM = ("You answer questions about the following notes in one word.\n"
          "Notes: the lighthouse keeper's cat is called Biscuit. The ferry leaves at seven. "
          "The secret ingredient of the soup is marmalade. The north gate is painted green.")
QUESTIONS = ["What is the cat called?", "What is the secret ingredient?", "What colour is the north gate?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-shared")
    system = folder / "system.txt"
    system.write_text(SYSTEM, encoding="utf-8")
    base, model, process, lines = start_server(
        ["--policy", "kvzip-global", "--keep", "0.5", "--shared-system", str(system), "--num-blocks", "64",
         "--max-batch-tokens", "256", "--device", "cpu", "--dtype", "float32"], folder)
    yield base, model
    stop_server(process, lines)


def test_requests_opening_with_the_shared_system_message_are_served_over_it(server):
    import httpx
    base, model = server
    stats = httpx.get(f"{base}/v1/kvcache").json()["models"]
    (shared,) = stats[model]["shared_prefixes"]
    assert shared["tokens"] > 40 and shared["nbytes"] > 0 and shared["requests"] == 0
    with httpx.Client(timeout=300) as client:
        for question in QUESTIONS:
            answer = client.post(f"{base}/v1/chat/completions", json={
                "model": model, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
        refused = client.post(f"{base}/v1/chat/completions", json={
            "model": model, "max_tokens": 6, "messages": [{"role": "user", "content": QUESTIONS[0]}]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "needs_shared_prefix" and "--shared-system" in error["message"]
    after = httpx.get(f"{base}/v1/kvcache").json()["models"][model]
    assert after["shared_prefixes"][0]["requests"] == len(QUESTIONS)
    # Only the shared prefix stays reserved once the requests are done.
    assert after["running"] == 0 and after["held_bytes"] == 0 and after["reserved_bytes"] == shared["nbytes"]
