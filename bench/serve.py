"""Serving at one KV memory budget: `kvcache-ext serve` with HF's paged cache (--policy full, the
model unpatched: what `transformers serve --continuous-batching` runs) and with eviction policies,
each started as a user starts it and sent the same load by a real client (httpx).

The load: passkey prompts (every request at once, streamed), plus for the eviction policies a
few faults (clients leaving mid-stream or before a non-streamed answer, malformed or
unservable bodies, prompts above the KV budget). Printed
and written per method: requests sent / completed / refused / cancelled / lost, passkey accuracy,
the most requests running at once and the most KV bytes held (polled from GET /v1/kvcache), and
completion tokens per second; the ratios against HF's paged cache are the headline.

    python bench/serve.py --lengths 2048,4096 --requests 8 --num-blocks 24 --device cpu --dtype float32 \
        --out bench/results/serve-cpu-DATE.json
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

from common import free_port, write_out   # noqa: E402  (bench/common.py: sys.path, result files)

from kvcache_ext.cli.args import MODEL_HELP   # noqa: E402
from kvcache_ext.serving.load import run_load, summary, wait_until_idle   # noqa: E402


class Server:
    """``kvcache-ext serve`` in a subprocess, its output in a log file."""

    def __init__(self, args, method: str, log_path: str):
        self.port = free_port()
        self.base = f"http://localhost:{self.port}"
        policy, _, kv_dtype = method.partition("+")   # "snapkv+int8": its pages in int8
        command = [sys.executable, "-m", "kvcache_ext", "serve", "--policy", policy, "--num-blocks",
                   str(args.num_blocks), "--max-batch-tokens", str(args.max_batch_tokens), "--port", str(self.port),
                   "--device", args.device, "--dtype", args.dtype]
        if method != "full":
            command += ["--keep", str(args.keep)]
        if kv_dtype:
            command += ["--kv-dtype", kv_dtype]
        if args.model:
            command += ["--model", args.model]
        self.log = open(log_path, "w")
        # The kvcache_ext this script imports (bench/common.py: a built checkout, else the installed
        # one), from a folder where no source tree shadows it.
        import kvcache_ext
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(kvcache_ext.__file__)))
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(command, cwd=args.logs, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 600) -> str:
        """The model name the server answers to, once /health answers."""
        import httpx
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvcache-ext serve stopped: see {self.log.name}")
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvcache-ext serve did not answer in {timeout} s: see {self.log.name}")
            time.sleep(0.5)
        with open(self.log.name) as f:
            first = f.readline()
        return first.split("(model name: ")[1].split(")")[0]

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        finally:
            self.process.kill()
            self.log.close()


def poll_stats(base: str, stop: threading.Event, peaks: dict) -> None:
    """The most requests running at once and the most KV bytes held, until ``stop``."""
    import httpx
    while not stop.is_set():
        try:
            for entry in httpx.get(f"{base}/v1/kvcache", timeout=5).json()["models"].values():
                for key in ("running", "held_bytes", "reserved_bytes"):
                    peaks[key] = max(peaks.get(key, 0), entry.get(key, 0))
                peaks["budget_bytes"] = entry.get("budget_bytes")
        except Exception:      # the server busy answering: the next poll counts
            pass
        stop.wait(0.1)


def plan_of(args, tokenizer, method: str):
    """[(kind, prompt)] and the passkey of each passkey request (None for the others)."""
    from kvcache_ext.tasks.passkey import make_passkey_prompt
    rng = random.Random(args.seed)
    plan, answers = [], []
    for i in range(args.requests):
        length = args.lengths[i % len(args.lengths)]
        prompt = make_passkey_prompt(tokenizer, length, rng.choice((0.1, 0.5, 0.9)), seed=args.seed + i)
        plan.append(("stream", prompt.prompt))
        answers.append(prompt.answer)
    filler = make_passkey_prompt(tokenizer, max(args.lengths), 0.5, seed=args.seed).prompt
    # The faults go to the eviction servers only: in one try HF's engine, short of pages, stopped
    # answering a load with a client leaving mid-stream (bench/README.md).
    faults = [] if method == "full" else ["cancel", "abandon", "malformed", "oversized"] * args.faults
    for kind in faults:
        plan.append((kind, filler * (1 + args.max_batch_tokens // max(args.lengths)) if kind == "oversized"
                     else filler))
        answers.append(None)
    return plan, answers


def run_method(args, tokenizer, method: str) -> dict:
    from kvcache_ext.tasks.passkey import check_answer
    server = Server(args, method, os.path.join(args.logs, f"serve-{method}.log"))
    try:
        model = server.wait_ready()
        plan, answers = plan_of(args, tokenizer, method)
        peaks, stop = {}, threading.Event()
        poller = threading.Thread(target=poll_stats, args=(server.base, stop, peaks), daemon=True)
        poller.start()
        start = time.perf_counter()
        outcomes = asyncio.run(run_load(server.base, model, plan, concurrency=len(plan),
                                        max_tokens=args.max_tokens, timeout=args.timeout))
        seconds = time.perf_counter() - start
        stop.set()
        poller.join()
        idle = next(iter(wait_until_idle(server.base, timeout=60)["models"].values()))
    finally:
        code = server.stop()
    passkeys = [(o, a) for o, a in zip(outcomes, answers) if a is not None]
    tokens = sum(o.tokens for o, _ in passkeys if o.outcome == "completed")
    return {"method": method, **summary(outcomes), "seconds": seconds,
            "passkey_accuracy": sum(o.outcome == "completed" and check_answer(o.text, a) for o, a in passkeys)
            / len(passkeys),
            "tokens_per_s": tokens / seconds, "most_running": peaks.get("running", 0),
            "most_held_bytes": peaks.get("held_bytes", 0), "budget_bytes": peaks.get("budget_bytes"),
            "idle_after": {k: idle.get(k) for k in ("running", "waiting", "reserved_bytes", "held_bytes",
                                                    "kept_for_reuse_bytes")},
            "exit_status": code,
            "answers": [o.text for o, _ in passkeys]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--methods", default="full,snapkv,ada-snapkv,streamingllm",
                   help="full (HF's paged cache) or policy names; policy+int8: its pages in int8")
    p.add_argument("--keep", type=float, default=0.125, help="fraction of each prompt the policies keep")
    p.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[2048, 4096, 8192])
    p.add_argument("--requests", type=int, default=24, help="passkey requests, all sent at once")
    p.add_argument("--faults", type=int, default=2, help="requests of each fault kind")
    p.add_argument("--num-blocks", type=int, required=True, help="the KV budget, in the engine's blocks")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: the longest prompt + 64")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--logs", default="/tmp", help="folder for each server's log")
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    if args.max_batch_tokens is None:
        args.max_batch_tokens = max(args.lengths) + 64
    from transformers import AutoTokenizer

    from kvcache_ext.cli.serve import served_name
    folder, _, file = served_name(args.model).rpartition(":")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file) if file.endswith(".gguf") else \
        AutoTokenizer.from_pretrained(args.model)
    rows = []
    for method in args.methods.split(","):
        rows.append(run_method(args, tokenizer, method))
        r = rows[-1]
        print(f"{method:>14}: sent {r['sent']}, completed {r['completed']}, refused {r['refused']}, "
              f"cancelled {r['cancelled']}, lost {r['lost']}; passkey {r['passkey_accuracy']:.2f}; "
              f"most running {r['most_running']}, most held {r['most_held_bytes'] / 2**20:.1f} MiB of "
              f"{(r['budget_bytes'] or 0) / 2**20:.1f}; {r['tokens_per_s']:.2f} tokens/s", flush=True)
    full = next((r for r in rows if r["method"] == "full"), None)
    if full is not None:
        for r in rows:
            r["running_vs_full"] = r["most_running"] / max(full["most_running"], 1)
            r["tokens_per_s_vs_full"] = r["tokens_per_s"] / full["tokens_per_s"] if full["tokens_per_s"] else None
            print(f"{r['method']:>14}: {r['running_vs_full']:.2f}x the requests running at once, "
                  f"{(r['tokens_per_s_vs_full'] or 0):.2f}x the tokens/s of HF's paged cache")
    if args.out:
        import torch
        device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        write_out(args.out, args, {"command": "python bench/serve.py " + " ".join(argv or sys.argv[1:])},
                  device=device, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
