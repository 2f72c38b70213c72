"""Our KVzip scores and kept tokens against kvpress's ``KVzipPress`` on one prompt.

    # kvpress 0.5.5 needs transformers < 5.3: a venv with `pip install ".[bench]"`.
    PYTHONPATH=$PWD python bench/kvzip_vs_kvpress.py [--task passkey] [--length 2048] [--depth 0.5]
        [--seed 1] [--keep 0.05] [--out result.json]

kvpress runs its press around the prefill of the prompt's context (as ``bench/agnostic.py`` does);
its scores (``score_val``, one per layer, KV head and context token) and the tokens it masks are
read as it compresses. Ours scores the same context with ``kvzip-global-rebuild`` under two
readings of the chat template's prefix (``bench/kvzip_prefix.py``): ``rebuild``
(``skip_prefix=None``) and ``drop`` (kvpress's, the library's default since 2026-11-26). Printed
per reading: the largest score difference on the tokens after the prefix, and the kept (layer,
head, token) entries that both, only ours or only kvpress hold.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (first: the checkout's kvcache_ext ahead of an installed copy)
import kvcache_ext  # noqa: E402
from kvcache_ext.hf.cache_argument import with_cache  # noqa: E402
from kvcache_ext.evaluation.named_policies import make_policy  # noqa: E402
from kvcache_ext.evaluation.retrieval import budget_tokens  # noqa: E402
from kvcache_ext.evaluation.kvpress_runs import kvpress_missing, kvzip_tokenizer, unmask  # noqa: E402
from kvcache_ext.evaluation.shared_prefill import compressed_cache, record_prefill  # noqa: E402
from kvcache_ext.hf.models import load_model  # noqa: E402
from agnostic import KVPRESS_CHUNK  # noqa: E402
from kvzip_prefix import MAKERS, chat_prefix, reading  # noqa: E402


def kvpress_scores(model, tokenizer, context, keep):
    """kvpress's KVzip scores [L, H, n] and kept mask [L, H, n] of ``context`` [1, n]."""
    from kvpress import KVzipPress
    from transformers import DynamicCache
    seen = {}
    compress = KVzipPress.compress_post

    def recording(press, model_):
        seen["scores"] = press.score_val[:, 0].float().clone()
        compress(press, model_)
        seen["masked"] = [layer.self_attn.masked_key_indices for layer in model_.model.layers]

    KVzipPress.compress_post = recording
    try:
        with kvzip_tokenizer(tokenizer), KVzipPress(compression_ratio=1 - keep)(model):   # a GGUF model: no hub name
            model(context, **with_cache(model, DynamicCache(config=model.config)), use_cache=True)
    finally:
        KVzipPress.compress_post = compress
        unmask(model)
    kept = torch.ones_like(seen["scores"], dtype=torch.bool)
    for layer, masked in enumerate(seen["masked"]):
        if masked is not None:
            _, heads, tokens = masked
            kept[layer, heads, tokens] = False
    return seen["scores"], kept


def our_scores(model, tokenizer, context, keep, name, method="kvzip-global-rebuild"):
    """Our ``method``'s scores [L, H, n] and kept mask [L, H, n] under prefix reading ``name``."""
    n = context.shape[1]
    # kvpress's chunk, not the library's default (1024): the same passes as kvpress's.
    policy = common.at_chunk(make_policy(method, budget_tokens(keep, n)), KVPRESS_CHUNK)
    recorded = record_prefill(model, context)
    with kvcache_ext.patch(model, policy, tokenizer=tokenizer) as handle, reading(name, chat_prefix(tokenizer)):
        cache = compressed_cache(policy, recorded)
        scores = torch.stack([s[0] for s in handle.score_prompt(cache, context)])
    kept = torch.zeros_like(scores, dtype=torch.bool)
    for layer in range(len(cache.layers)):
        view = cache.layer_kv(layer).view(None, False)
        for head in range(scores.shape[1]):
            kept[layer, head, view["pos"][0, head][view["mask"][0, head]]] = True
    return scores, kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(MAKERS), default="passkey")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=1, help="1: the 2K passkey of bench/agnostic.py")
    p.add_argument("--keep", type=float, default=0.05)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not 0 < args.keep < 1:
        p.error(f"--keep must be in (0, 1), got {args.keep}")
    if why := kvpress_missing():
        p.error(why)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model()
    prompt = MAKERS[args.task](tokenizer, args.length, args.depth, seed=args.seed)
    context = prompt.input_ids[None, :prompt.haystack_end]
    theirs, theirs_kept = kvpress_scores(model, tokenizer, context, args.keep)
    skip = len(chat_prefix(tokenizer))
    rows = []
    for name in ("rebuild", "drop"):
        ours, ours_kept = our_scores(model, tokenizer, context, args.keep, name)
        rows.append({"reading": name,
                     "max_abs_score_diff_after_prefix": float((ours - theirs)[..., skip:].abs().max()),
                     "kept_ours": int(ours_kept.sum()), "kept_kvpress": int(theirs_kept.sum()),
                     "kept_both": int((ours_kept & theirs_kept).sum()),
                     "ours_only": int((ours_kept & ~theirs_kept).sum()),
                     "kvpress_only": int((~ours_kept & theirs_kept).sum())})
    print(f"{args.task}, {context.shape[1]} context tokens (chat prefix {skip}), keep {args.keep:g}\n")
    print("| our reading | max |score diff| after the prefix | kept: ours | kvpress | both | ours only "
          "| kvpress only |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['reading']} | {r['max_abs_score_diff_after_prefix']:.2e} | {r['kept_ours']} | "
              f"{r['kept_kvpress']} | {r['kept_both']} | {r['ours_only']} | {r['kvpress_only']} |")
    if args.out:
        common.write_out(args.out, args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
