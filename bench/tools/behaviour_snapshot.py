"""What a patched model computes, written to a file, to compare two commits of the library.

For refactors that must not change behaviour: run it at the old commit and at the new one
(each with its own build), then compare. It drives tiny random-weight models of every
supported architecture through the public API only (``kvcache_ext.patch``, ``handle.new_cache``,
``kvcache_ext.policies``), so the same script runs on both sides: a batch of two left-padded
prompts, then decode steps, for one policy of each kind (one-shot, head-wise, pyramid,
block-wise prefill, every-step and every-N-steps eviction, the wrapped and query-agnostic
scorers). It records the logits of every step and, per layer and head, the positions the
cache holds.

    python bench/tools/behaviour_snapshot.py --out /tmp/old.pt        # at the old commit
    python bench/tools/behaviour_snapshot.py --out /tmp/new.pt        # at the new one
    python bench/tools/behaviour_snapshot.py --compare /tmp/old.pt /tmp/new.pt

``--compare`` prints one line per case and exits with status 1 when any logits differ or any
kept position does (logits are compared exactly: the same kernels on the same inputs give the
same bits).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/tools -> the root
sys.path.insert(0, os.path.join(ROOT, "tests"))

STEPS = 6          # decode steps after the prompt
PROMPT = 40        # tokens of the longer prompt (the other is 29, left-padded)


def policies():
    from kvcache_ext.policies import (CAOTE, H2O, KVEC, TOVA, AdaKV, AhaKV, EveryNSteps, EveryStep,
                                      ExpectedAttention, KVzip, OneShot, Policy, Pyramid, Random, RoCo,
                                      ScissorHands, SnapKV, StreamingLLM, BlockwisePrefill)
    ids = (7, 8, 9)   # KVzip's instructions as token ids: no tokenizer needed
    return {
        "snapkv": Policy(SnapKV(window=8), budget=16),
        "ada-snapkv": Policy(SnapKV(window=8), budget=16, allocation=AdaKV()),
        "pyramid": Policy(SnapKV(window=8), budget=16, allocation=Pyramid()),
        "streamingllm": Policy(StreamingLLM(), budget=12, schedule=EveryStep()),
        "h2o-every-step": Policy(H2O(recent=4), budget=14, schedule=EveryStep()),
        "tova-blockwise": Policy(TOVA(), budget=12, schedule=BlockwisePrefill(8)),
        "roco-every-2": Policy(RoCo(), budget=14, schedule=EveryNSteps(2)),
        "scissorhands": Policy(ScissorHands(), budget=14, schedule=EveryStep()),
        "ahakv": Policy(AhaKV(recent=8), budget=16),
        "caote-h2o": Policy(CAOTE(H2O()), budget=14, schedule=BlockwisePrefill(8)),
        "kvec": Policy(KVEC(window=8, extended_window=12), budget=16),
        "random": Policy(Random(seed=3), budget=12),
        "expected-attention": Policy(ExpectedAttention(), budget=16, allocation=AdaKV()),
        "kvzip": Policy(KVzip(chunk=16, prompt=ids, continue_prompt=ids, suffix=ids, skip_prefix=None),
                        budget=16, schedule=OneShot()),
    }


def kept_positions(cache) -> list:
    """Per layer, [B, H] lists of the positions each head holds (sorted)."""
    out = []
    for i in range(len(cache.layers)):
        kv = cache.layer_kv(i)
        store = getattr(kv, "store", None)
        dense = store.to_dense()
        pos = dense.pos.masked_fill(~dense.mask, 2**31 - 1).sort(dim=-1).values
        out.append([[row[: int(n)].tolist() for row, n in zip(head_rows, head_lens)]
                    for head_rows, head_lens in zip(pos, dense.lens)])
    return out


@torch.no_grad()
def run_case(arch: str, kv_heads: int, policy, padded: bool = True) -> dict:
    import kvcache_ext
    from tiny_models import VOCAB, tiny_model
    model = tiny_model(arch, heads=4, kv_heads=kv_heads, head_dim=16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=gen)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    if padded:
        mask[1, : PROMPT - 29] = 0
        ids[1, : PROMPT - 29] = 0
    key = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    logits = []
    with kvcache_ext.patch(model, policy) as handle:
        cache = handle.new_cache()
        out = model(ids, attention_mask=mask, use_cache=True, **{key: cache})
        logits.append(out.logits[:, -1])
        pos = mask.sum(dim=1, keepdim=True)
        for _ in range(STEPS):
            nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            # Unpadded: no mask, as generate passes none when no token is padding (the decode
            # steps that need no validity mask).
            step_mask = {"attention_mask": mask} if padded else {}
            out = model(nxt, position_ids=pos, use_cache=True, **step_mask, **{key: cache})
            pos = pos + 1
            logits.append(out.logits[:, -1])
        kept = kept_positions(cache)
    return {"logits": torch.stack(logits), "kept": kept}


def snapshot() -> dict:
    results = {}
    for arch, kv_heads in (("llama", 2), ("qwen3", 1), ("mistral", 4)):
        for name, policy in policies().items():
            for padded in (True, False):
                case = f"{arch}/{name}" + ("" if padded else "/unpadded")
                results[case] = run_case(arch, kv_heads, policy, padded)
                print(case, flush=True)
    return results


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    bad = 0
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b:
            print(f"{case}: only in {'the first' if case in a else 'the second'}")
            bad += 1
            continue
        same_kept = a[case]["kept"] == b[case]["kept"]
        diff = (a[case]["logits"] - b[case]["logits"]).abs().max().item()
        ok = same_kept and diff == 0.0
        bad += not ok
        print(f"{case}: logits max |diff| {diff:.3g}, kept positions {'equal' if same_kept else 'DIFFER'}"
              f"{'' if ok else '  <-- differs'}")
    print(f"{len(set(a) | set(b)) - bad} of {len(set(a) | set(b))} cases equal")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", help="write the snapshot of this checkout to this file")
    group.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two snapshots")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    torch.set_num_threads(1)
    torch.save(snapshot(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
