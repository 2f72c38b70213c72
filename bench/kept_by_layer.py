"""Where a policy's budget goes, layer by layer, on one RULER prompt, and whether the heads that
read the answer still hold it.

    PYTHONPATH=$PWD python bench/kept_by_layer.py --task niah_single_2 [--seed 0] [--length 4096]
        [--keep 0.125] [--mode agnostic] [--policies kvzip-global,kvzip-global-context-sentences]
        [--model NAME] [--max-new-tokens 48] [--reading-heads 10] [--out results.json]

A selection can keep the answer's tokens where the answer is read and still lose the answer:
what the other layers kept decides whether the question finds them. For each policy this
records its answer, how many prompt tokens each KV head of each layer holds once the prompt is
compressed (a head at its protected tokens holds nothing else), and, for the heads whose
attention the full cache's answer gives most to the answer's tokens (``oracle.answer_scores``),
the share of those tokens each holds. Results: a table on stdout and JSON (``--out``).
"""
from __future__ import annotations

import argparse
import bisect
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (first: it puts a built checkout ahead of an installed copy)
from kvcache_ext.cli.args import MODEL_HELP, choice_list, fraction, int_range, model_name, output_file  # noqa: E402
from kvcache_ext.evaluation.decode_together import kept_mask  # noqa: E402
from kvcache_ext.evaluation.decoding import full_cache_from, greedy_continue  # noqa: E402
from kvcache_ext.evaluation.named_policies import policy_names, policy_runs  # noqa: E402
from kvcache_ext.evaluation.oracle import answer_scores  # noqa: E402
from kvcache_ext.evaluation.retrieval import MODES, ask, budget_tokens, split_prompt, windowed  # noqa: E402
from kvcache_ext.evaluation.shared_prefill import (  # noqa: E402
    compressed_cache, record_prefill, score_by_reconstruction)
from kvcache_ext.hf.patching import patch  # noqa: E402
from kvcache_ext.tasks.ruler import TASKS  # noqa: E402


def answer_positions(tokenizer, ids: list[int], answers: list[str]) -> list[int]:
    """The positions of ``ids`` whose text overlaps an occurrence of one of ``answers`` in the
    text the tokens decode to one by one (every occurrence)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    starts, at = [], 0
    for piece in pieces:
        starts.append(at)
        at += len(piece)
    text, found = "".join(pieces), set()
    for answer in answers:
        begin = text.find(answer)
        while answer and begin >= 0:
            first = bisect.bisect_right(starts, begin) - 1
            last = bisect.bisect_right(starts, begin + len(answer) - 1)
            found.update(range(first, last))
            begin = text.find(answer, begin + 1)
    return sorted(found)


@torch.no_grad()
def kept_by_layer(model, tokenizer, prompt, mode: str, names: list[str], keep: float, max_new_tokens: int,
                  reading_heads: int = 10) -> dict:
    """The full cache's answer, its reading heads, and per policy (``names``, at ``keep`` of the
    compressed part) its answer, tokens per head per layer and the answer held in those heads."""
    context, question = split_prompt(prompt, mode)
    device = next(model.parameters()).device
    context = context.to(device)
    question = None if question is None else question.to(device)
    n, eos = context.shape[1], tokenizer.eos_token_id
    recorded = record_prefill(model, context)

    def answer_of(cache):
        logits = (recorded.logits[:, -1] if question is None
                  else ask(model, cache, question, one_at_a_time=windowed(recorded)))
        new, _ = greedy_continue(model, cache, logits, max_new_tokens, eos)
        return new, tokenizer.decode(new, skip_special_tokens=True)

    full_ids, full_text = answer_of(full_cache_from(model, recorded))
    where = torch.tensor(answer_positions(tokenizer, context[0].tolist(), prompt.answers), dtype=torch.long)
    reading = []
    if len(where) and len(full_ids):
        asked = context if question is None else torch.cat([context, question], dim=1)
        scores = torch.stack([s[0] for s in answer_scores(model, asked, torch.tensor([full_ids]), n)])   # [L, H, n]
        share = scores[:, :, where].sum(-1) / scores.sum(-1).clamp_min(1e-30)
        top = share.flatten().topk(min(reading_heads, share.numel()))
        heads = share.shape[1]
        reading = [(int(i) // heads, int(i) % heads, float(v)) for v, i in zip(top.values, top.indices)]
    out = {"task": prompt.task, "seed": prompt.seed, "mode": mode, "length": prompt.length, "compressed": n,
           "keep": keep, "answers": prompt.answers, "answer_positions": where.tolist(),
           "full": {"output": full_text, "score": prompt.score(full_text)},
           "reading_heads": [{"layer": l, "head": h, "share": s} for l, h, s in reading], "policies": []}
    for name, tokens, policy in policy_runs(names, [budget_tokens(keep, n)]):
        with patch(model, policy, tokenizer=tokenizer) as handle:
            cache = compressed_cache(policy, recorded, handle.model_parts)
            score_by_reconstruction(handle, cache, recorded, context)
            kept = torch.stack([kept_mask(cache, layer, n)[0] for layer in range(len(recorded.views))])   # [L, H, n]
            _, text = answer_of(cache)
        held = kept[:, :, where].float().mean(-1) if len(where) else None
        out["policies"].append({
            "policy": name, "budget_tokens": tokens, "output": text, "score": prompt.score(text),
            "tokens_per_head": kept.sum(-1).tolist(),
            "answer_held_in_reading_heads": [float(held[l, h]) for l, h, _ in reading] if held is not None else []})
    return out


def table(result: dict) -> str:
    """Per policy: its score and, per layer, the least / mean / most tokens a KV head holds."""
    lines = [f"{result['task']} seed {result['seed']}, {result['mode']}, keep {result['keep']} of "
             f"{result['compressed']} tokens; full cache: {result['full']['score'] * 100:.0f}",
             "reading heads (layer, head, share): " + ", ".join(
                 f"({r['layer']}, {r['head']}, {r['share']:.2f})" for r in result["reading_heads"])]
    for run in result["policies"]:
        lines.append(f"{run['policy']}: score {run['score'] * 100:.0f}, answer held in the reading heads "
                     + " ".join(f"{x:.2f}" for x in run["answer_held_in_reading_heads"]))
        per_layer = [f"{min(t)}/{sum(t) / len(t):.0f}/{max(t)}" for t in run["tokens_per_head"]]
        lines.append("  tokens per head by layer (least/mean/most): " + " ".join(per_layer))
    return "\n".join(lines)


def main(argv=None) -> int:
    from kvcache_ext.cli.args import load_model_or_fail
    from kvcache_ext.tasks.ruler import make_ruler_prompt
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--seed", type=int_range(0), default=0)
    p.add_argument("--length", type=int_range(64), default=4096, help="tokens in the prompt")
    p.add_argument("--keep", type=fraction, default=0.125, help="fraction of the compressed part kept")
    p.add_argument("--mode", choices=MODES, default="agnostic")
    p.add_argument("--policies", type=choice_list(policy_names()[1:]),   # ours, not "full"
                   default="kvzip-global,kvzip-global-context-sentences")
    p.add_argument("--model", type=model_name, default=None, help=MODEL_HELP)
    p.add_argument("--max-new-tokens", type=int_range(1), default=48)
    p.add_argument("--reading-heads", type=int_range(1), default=10, help="answer-reading heads to follow")
    p.add_argument("--out", type=output_file, default=None, help="JSON of the result")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    loaded = load_model_or_fail("bench/kept_by_layer.py", args.model)
    if loaded is None:
        return 1
    model, tokenizer = loaded
    prompt = make_ruler_prompt(tokenizer, args.task, args.length, seed=args.seed)
    result = kept_by_layer(model, tokenizer, prompt, args.mode, args.policies, args.keep, args.max_new_tokens,
                           args.reading_heads)
    print(table(result))
    if args.out:
        common.write_out(args.out, args, result=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
