"""A load and fault generator for an OpenAI-compatible server (``kvcache-ext serve``, or
``transformers serve``): many concurrent requests of several kinds, each classified by what came
back. Used by tests/test_serve_load.py (a short form in CI) and bench/serve.py (a long form).

Kinds: ``stream`` (a streaming completion read to its end), ``chat`` (a non-streaming chat
completion), ``cancel`` (a streaming completion whose client goes away after a few chunks),
``abandon`` (a non-streaming chat completion whose client goes away before its answer),
``malformed`` (a body the server must refuse with a 4xx and a message), ``oversized`` (a prompt
above the server's KV budget). Outcomes: ``completed`` (the whole answer), ``refused`` (an error response or error
event with a message), ``cancelled`` (by the client), ``lost`` (anything else: no answer in
time, a dropped connection, an error without a message, an answer cut short).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

KINDS = ("stream", "chat", "cancel", "abandon", "malformed", "oversized")
OUTCOMES = ("completed", "refused", "cancelled", "lost")
HELLO = [{"role": "user", "content": "hi"}]
ABANDONED_TOKENS = 256     # what an abandoned request asks for: more than it decodes before its client leaves
MALFORMED = (  # (route, body bytes, what is wrong): each must be refused with a 4xx and a message
    ("completions", b'{"prompt": "unterminated', "invalid JSON"),
    ("chat/completions", json.dumps({"max_tokens": 4}).encode(), "no messages"),
    ("completions", json.dumps({"prompt": 42, "max_tokens": 4}).encode(), "a prompt that is not a string"),
    ("chat/completions", json.dumps({"messages": "hi"}).encode(), "messages a string"),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": 4, "no_such_field": 1}).encode(), "an unknown field"),
    ("chat/completions", json.dumps({"messages": [], "max_tokens": 4}).encode(), "no message"),
    ("completions", b'[1, 2, 3]', "a body that is not an object"),
    ("chat/completions", json.dumps({"messages": HELLO, "max_tokens": "abc"}).encode(), "max_tokens not a number"),
    ("chat/completions", json.dumps({"messages": HELLO, "max_tokens": 0}).encode(), "no token to generate"),
    ("chat/completions", json.dumps({"messages": HELLO, "temperature": -5}).encode(), "a negative temperature"),
    ("chat/completions", json.dumps({"messages": HELLO, "n": 3}).encode(), "several choices"),
)


@dataclass
class Outcome:
    index: int
    kind: str
    outcome: str
    status: int | None       # HTTP status
    detail: str              # the error message, or what was lost
    tokens: int              # completion tokens received
    seconds: float
    text: str = ""           # the completion (completed requests)


def _message(body: bytes) -> str:
    """The error message of an error response ('' when it has none)."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if isinstance(data, dict):
        error = data.get("error", data.get("detail"))
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, list):      # FastAPI's validation errors
            error = "; ".join(str(e.get("msg", e)) for e in error)
        return str(error) if error else ""
    return ""


async def _stream(client, url, body, cancel_after: int | None):
    """(outcome, status, detail, tokens, text) of a streaming completion."""
    text, chunks, finished = [], 0, False
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            message = _message(await response.aread())
            return ("refused" if message else "lost"), response.status_code, message, 0, ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: "):])
            if "error" in data:
                return ("refused" if data["error"] else "lost"), 200, str(data["error"]), chunks, "".join(text)
            for choice in data.get("choices", []):
                text.append(choice.get("text") or "")
                chunks += 1
                finished = finished or choice.get("finish_reason") is not None
            if cancel_after is not None and chunks >= cancel_after:
                return "cancelled", 200, "", chunks, "".join(text)     # leaving the block closes the stream
    if finished:
        return "completed", 200, "", chunks, "".join(text)
    return "lost", 200, "the stream ended without a finish reason", chunks, "".join(text)


async def _one(client, base_url: str, model: str, index: int, kind: str, prompt: str, max_tokens: int,
               cancel_after: int, abandon_after: float) -> Outcome:
    import httpx

    start = time.perf_counter()
    try:
        if kind == "oversized" and index % 2:   # half of them without streaming: an error response
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = await client.post(f"{base_url}/v1/completions", json=body)
            status, tokens, text, detail = response.status_code, 0, "", _message(response.content)
            outcome = "refused" if status != 200 and detail else "lost"
        elif kind in ("stream", "cancel", "oversized"):
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            outcome, status, detail, tokens, text = await _stream(
                client, f"{base_url}/v1/completions", body, cancel_after if kind == "cancel" else None)
        elif kind == "chat":
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0}
            response = await client.post(f"{base_url}/v1/chat/completions", json=body)
            status, tokens, text = response.status_code, 0, ""
            if status == 200:
                data = response.json()
                text = data["choices"][0]["message"]["content"] or ""
                tokens = data.get("usage", {}).get("completion_tokens", 0)
                complete = data["choices"][0].get("finish_reason") is not None
                outcome, detail = ("completed", "") if complete else ("lost", "no finish reason")
            else:
                detail = _message(response.content)
                outcome = "refused" if detail else "lost"
        elif kind == "abandon":     # the client leaves before the answer: nothing comes back
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": ABANDONED_TOKENS,
                    "temperature": 0}
            try:
                response = await client.post(f"{base_url}/v1/chat/completions", json=body, timeout=abandon_after)
            except httpx.TimeoutException:
                return Outcome(index, kind, "cancelled", None, "", 0, time.perf_counter() - start)
            status, tokens, text, detail = response.status_code, 0, "", "answered before its client left"
            outcome = "lost"
        elif kind == "malformed":
            route, content, _ = MALFORMED[index % len(MALFORMED)]
            response = await client.post(f"{base_url}/v1/{route}", content=content,
                                         headers={"content-type": "application/json"})
            status, tokens, text, detail = response.status_code, 0, "", _message(response.content)
            outcome = "refused" if 400 <= status < 500 and detail else "lost"
        else:
            raise ValueError(f"unknown request kind {kind!r}; known: {', '.join(KINDS)}")
    except Exception as error:      # a dropped connection, a timeout: the request is lost
        return Outcome(index, kind, "lost", None, f"{type(error).__name__}: {error}", 0,
                       time.perf_counter() - start)
    return Outcome(index, kind, outcome, status, detail, tokens, time.perf_counter() - start, text)


async def run_load(base_url: str, model: str, plan: list[tuple[str, str]], *, concurrency: int,
                   max_tokens: int, cancel_after: int = 2, abandon_after: float = 1.0,
                   timeout: float = 300.0) -> list[Outcome]:
    """Sends ``plan`` ([(kind, prompt)]), at most ``concurrency`` requests at once; every request
    ends within ``timeout`` seconds (or is lost). ``cancel_after``: the chunks a ``cancel``
    client reads; ``abandon_after``: the seconds an ``abandon`` client waits."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def gated(index, kind, prompt):
            async with gate:
                return await _one(client, base_url, model, index, kind, prompt, max_tokens, cancel_after,
                                  abandon_after)
        return await asyncio.gather(*(gated(i, kind, prompt) for i, (kind, prompt) in enumerate(plan)))


def summary(outcomes: list[Outcome]) -> dict:
    """Requests sent, and how many ended in each outcome (overall and per kind)."""
    counts = {name: sum(o.outcome == name for o in outcomes) for name in OUTCOMES}
    per_kind = {kind: {name: sum(o.kind == kind and o.outcome == name for o in outcomes) for name in OUTCOMES}
                for kind in KINDS if any(o.kind == kind for o in outcomes)}
    return {"sent": len(outcomes), **counts, "per_kind": per_kind}


def wait_until_idle(base_url: str, timeout: float = 30.0) -> dict:
    """Polls ``GET /v1/kvcache`` until no request runs, waits or holds memory; returns its last
    answer (which still shows what was held when ``timeout`` ran out)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base_url}/v1/kvcache", timeout=10).json()
        busy = [m for m in stats["models"].values()
                if m.get("running") or m.get("waiting") or m.get("reserved_bytes") or m.get("held_bytes")]
        if not busy or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


__all__ = ["KINDS", "OUTCOMES", "Outcome", "run_load", "summary", "wait_until_idle"]
