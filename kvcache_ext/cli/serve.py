"""``kvcache-ext serve``: transformers' OpenAI-compatible server with continuous batching, on a
model patched with a named policy (``kvcache_ext.serving.server``)."""
from __future__ import annotations

import dataclasses
import os
import sys

from kvcache_ext.cli.args import MODEL_HELP, fraction, int_range, model_name, usage_error

DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_arguments(p) -> None:
    p.add_argument("--model", type=model_name, default=None, help=MODEL_HELP)
    p.add_argument("--policy", default="snapkv",
                   help="a named policy (kvcache-ext eval's names, such as snapkv, ada-snapkv, streamingllm, h2o); "
                        "full: HF's paged cache, the model unpatched")
    p.add_argument("--budget", type=int_range(1, 2**31 - 1), default=None, help="tokens kept per KV head")
    p.add_argument("--keep", type=fraction, default=None,
                   help="the fraction of each prompt kept (default 0.125 when --budget is not given)")
    p.add_argument("--decode-every", type=int_range(1), default=None,
                   help="also evict every N decode steps (default: never while decoding)")
    p.add_argument("--num-blocks", type=int_range(1), default=None,
                   help="the KV memory budget, in the engine's blocks (page_size tokens of every layer); "
                        "default: what the engine gives its paged cache from free memory")
    p.add_argument("--max-batch-tokens", type=int_range(1), default=None, help="tokens per engine step")
    p.add_argument("--page-size", type=int, default=16, choices=[2**i for i in range(11)],
                   help="tokens per page of kvcache_ext's store (default 16)")
    p.add_argument("--kv-dtype", default=None, choices=("int8",),
                   help="what kvcache_ext's pages hold: int8 quantizes K and V per token and KV head "
                        "(default: the model's dtype)")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int_range(1, 65535), default=8000)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the weights' (float32 for a .gguf)")
    p.add_argument("--shared-system", default=None, metavar="FILE",
                   help="a text file: the system message compressed once by the policy when the model loads, and "
                        "read in place by every request that opens with it (a shared prefix; KVzip serves only such "
                        "requests)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def policy_of(args):
    """The policy named by --policy at --budget or --keep (None for "full"; ValueError saying
    what is wrong)."""
    from kvcache_ext.evaluation.named_policies import make_policy
    from kvcache_ext.policies import Schedule

    if args.budget is not None and args.keep is not None:
        raise ValueError(f"--budget {args.budget} and --keep {args.keep}: give one of them "
                         "(tokens per KV head, or the fraction of each prompt kept)")
    if args.policy.strip().lower() == "full":
        return None      # HF's own paged cache, the model unpatched (what transformers serve runs)
    schedule = Schedule(decode_every=args.decode_every)
    if args.budget is not None:
        policy = make_policy(args.policy, args.budget, schedule)
    else:   # the scorer is built as for a 1K-token prompt (H2O's recent window: half of it)
        keep = 0.125 if args.keep is None else args.keep
        policy = make_policy(args.policy, max(2, round(keep * 1024)), schedule)
        policy = dataclasses.replace(policy, budget=None, ratio=keep)
    if policy.scorer.capabilities.reconstructs and args.shared_system is None:
        raise ValueError(f"--policy {args.policy} re-runs the model over each prompt (reconstruction), "
                         "which the continuous batching engine does not run: give --shared-system FILE (that "
                         "system message compressed once, with its passes, for every request that opens with "
                         "it), or serve it with generate")
    if policy.schedule.evicts_over_cache and args.shared_system is not None:
        raise ValueError(f"--shared-system: --decode-every {args.decode_every} evicts while decoding, which would "
                         "write the shared system message's tokens; a shared prefix needs a one-shot policy")
    return policy


def shared_system_of(args) -> str | None:
    """The text of --shared-system (None when not given); ValueError naming what is wrong."""
    if args.shared_system is None:
        return None
    if args.policy.strip().lower() == "full":
        raise ValueError("--shared-system needs a policy to compress it; --policy full is HF's paged cache")
    try:
        with open(args.shared_system, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--shared-system {args.shared_system}: cannot read it as UTF-8 text ({err})") from None
    if not text.strip():
        raise ValueError(f"--shared-system {args.shared_system} is empty")
    return text


def served_name(model: str | None) -> str:
    """The name transformers serve loads: a .gguf file (a named model's too) as ``folder:file.gguf``."""
    from kvcache_ext.hf.models import named_model_path
    model = named_model_path(model) or model
    if model.endswith(".gguf") and os.path.isfile(model):
        folder, file = os.path.split(os.path.abspath(model))
        return f"{folder}:{file}"
    return model


def main(args) -> int:
    prog = "kvcache-ext serve"
    try:
        policy = policy_of(args)
        shared_system = shared_system_of(args)
    except ValueError as err:
        return usage_error(prog, str(err))
    if args.kv_dtype is not None and policy is None:
        return usage_error(prog, f"--kv-dtype {args.kv_dtype} is what kvcache_ext's pages hold; --policy full is "
                                 "HF's paged cache, which has none")
    try:
        from kvcache_ext.serving.server import require_serving, start
        require_serving()
        name = served_name(args.model)
    except (ImportError, RuntimeError) as err:
        return usage_error(prog, str(err))
    what = policy if policy is not None else "HF's paged cache (unpatched)"
    print(f"{prog}: {name} with {what}; the OpenAI API at http://{args.host}:{args.port}/v1 "
          f"(model name: {name}), the KV memory at http://{args.host}:{args.port}/v1/kvcache", flush=True)
    start(name, policy, page_size=args.page_size, host=args.host, port=args.port, device=args.device,
          dtype=args.dtype, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens,
          log_level=args.log_level, shared_system=shared_system, kv_dtype=args.kv_dtype)
    # Stopped (Ctrl-C): the engine, the model and the HTTP server are down. transformers' server
    # thread leaves an AnyIO worker thread waiting for work forever, which would keep the
    # interpreter from exiting: leave without waiting for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
