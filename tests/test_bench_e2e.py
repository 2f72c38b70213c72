"""bench/e2e.py on a tiny random Llama: every method runs; methods that keep the same tokens
decode the same greedy tokens (the masked cache and Ada-SnapKV at a small budget; everything and
the full cache at a budget above context + steps); the KV bytes rank as the design says. Where
kvpress imports (``pip install ".[bench]"``), its SnapKV keeps our budget exactly and its AdaKV
masks the full cache; elsewhere the script says it skipped them, and their tests skip."""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
from child import child_env

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "e2e.py")
SMALL, LARGE = 48, 1024          # budgets: one evicts, one keeps every token (contexts 200, 300)
STEPS = 6
WARMUP, REPEATS = 2, 2           # untimed decode steps per run (the second also times the host's
                                 # share: e2e.HOST_PROBES); interleaved runs per method
DECODED = WARMUP + STEPS         # tokens decoded per run (the warmup's are in the cache too)
METHODS = ("full", "masked-ada-snapkv", "snapkv", "ada-snapkv", "h2o-step", "caote-step", "snapkv-graph",
           "ada-snapkv-graph", "h2o-step-graph")
KVPRESS = ("kvpress-snapkv", "kvpress-ada-snapkv")
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16                                  # bench/e2e.py's TINY


def usage_error(script: str, argv: list[str]) -> str:
    """The stderr of ``script`` run with ``argv``, which must stop at its parser (exit status 2)."""
    proc = subprocess.run([sys.executable, script, *argv], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stderr


def parser_error(main, argv: list[str]) -> str:
    """``usage_error`` in this process, for a script whose module imports cheaply: the stderr of
    ``main(argv)``, which must stop at its parser (exit status 2)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2, err.getvalue()[-2000:]
    return err.getvalue()


def import_e2e():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import e2e
    finally:
        sys.path.pop(0)
    return e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "e2e.json"
    png = out.with_suffix(".png")
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--device", "cpu", "--contexts", "200,300",
                           "--batches", "1,2", "--budgets", f"{SMALL},{LARGE}", "--steps", str(STEPS),
                           "--warmup", str(WARMUP), "--repeats", str(REPEATS), "--no-progress", "--out", str(out),
                           "--plot", str(png), "--methods", ",".join(METHODS + KVPRESS)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f), proc.stdout, png


def methods_of(doc):
    """The methods the run had: kvpress's where it imported (the JSON says its version)."""
    return METHODS + (KVPRESS if doc["kvpress"] else ())


def rows_of(doc, context, batch):
    return {(r["method"], r["budget"]): r for r in doc["rows"] if (r["context"], r["batch"]) == (context, batch)}


def test_every_method_runs_and_the_json_says_what_ran(run):
    doc, stdout, png = run
    assert "| context | batch | method |" in stdout and png.is_file()
    for key in ("device", "date", "commit", "dirty", "torch", "model", "dtype", "steps", "warmup_steps",
                "repeats", "largest_fit", "rows"):
        assert key in doc, key
    methods = methods_of(doc)
    assert len(doc["rows"]) == 2 * 2 * (1 + (len(methods) - 1) * 2)
    for r in doc["rows"]:
        assert r["status"] == "ok" and r["method"] in methods
        assert len(r["tokens"]) == r["batch"] and all(len(t) == DECODED + 1 for t in r["tokens"])
        assert r["prefill_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["x_full"] > 0
        # The median of the interleaved runs, over the timed steps only.
        runs = r["decode_s_runs"]
        assert len(runs) == REPEATS and min(runs) <= r["decode_s"] <= max(runs)
        assert r["decode_tokens_per_s"] == r["batch"] * STEPS / r["decode_s"]
        assert 0 < r["host_s_per_step"] <= r["synced_step_s"]
        if r["method"].endswith("-graph"):   # the CPU has no graphs: every step eager, as the plain method
            assert r["graph"]["captures"] == r["graph"]["replays"] == 0 and r["graph"]["failed"] is None
            assert r["graph"]["eager_steps"] == 1 + DECODED and r["tokens_as_eager"] and r["x_eager"] > 0
    assert "snapkv-graph at 200 x 1:" in stdout and "captured 0, replayed 0" in stdout
    assert doc["largest_fit"]["full"] == {"batch": 2, "context": 300}


@pytest.mark.parametrize("context", [200, 300])
@pytest.mark.parametrize("batch", [1, 2])
def test_same_kept_tokens_decode_the_same(run, context, batch):
    rows = rows_of(run[0], context, batch)
    full = rows[("full", None)]["tokens"]
    assert rows[("masked-ada-snapkv", SMALL)]["tokens"] == rows[("ada-snapkv", SMALL)]["tokens"]
    for method in methods_of(run[0])[1:]:
        assert rows[(method, LARGE)]["tokens"] == full, method


@pytest.mark.parametrize("context", [200, 300])
@pytest.mark.parametrize("batch", [1, 2])
def test_tokens_held_and_bytes(run, context, batch):
    rows = rows_of(run[0], context, batch)
    layers, kv_heads = LAYERS, KV_HEADS
    full = rows[("full", None)]
    assert full["kv_tokens"] == layers * batch * kv_heads * (context + DECODED)
    assert rows[("masked-ada-snapkv", SMALL)]["kv_tokens"] == full["kv_tokens"]
    assert rows[("masked-ada-snapkv", SMALL)]["kv_bytes"] > full["kv_bytes"]   # plus the mask
    # One-shot: the budget per head on average, then one token per decode step.
    for method in ("snapkv", "ada-snapkv"):
        assert rows[(method, SMALL)]["kv_tokens"] == layers * batch * kv_heads * (SMALL + DECODED), method
        assert rows[(method, SMALL)]["kv_bytes"] < full["kv_bytes"], method
    # Per-step eviction holds the cache at its budget, and its bytes do not grow with the context
    # (the store's capacity is budget + prefill block + headroom: at this tiny head_dim of 16 the
    # score channels and headroom outweigh K and V, so no comparison with the full cache here).
    longest = rows_of(run[0], 300, batch)
    for method in ("h2o-step", "caote-step", "h2o-step-graph"):
        assert rows[(method, SMALL)]["kv_tokens"] == layers * batch * kv_heads * SMALL, method
        assert rows[(method, SMALL)]["kv_bytes"] == longest[(method, SMALL)]["kv_bytes"], method


def test_kvpress_is_skipped_with_a_reason_where_it_does_not_import(run):
    doc, stdout, _ = run
    if importlib.util.find_spec("kvpress") is None:
        assert doc["kvpress"] is None
        assert "skipped kvpress-snapkv, kvpress-ada-snapkv: kvpress cannot be imported" in stdout
        assert 'pip install ".[bench]"' in stdout
    elif doc["kvpress"] is None:
        assert "skipped kvpress-snapkv" in stdout


@pytest.mark.parametrize("context", [200, 300])
@pytest.mark.parametrize("batch", [1, 2])
def test_kvpress_keeps_our_budget(run, context, batch):
    """kvpress's SnapKV holds exactly the tokens ours holds at the same budget (its window counts
    in its budget as ours does), its bytes are K+V of those tokens; AdaKVPress holds every token,
    plus 3 int64 indices per pruned (token, head); the summary's ratios are those of the rows."""
    doc = run[0]
    if not doc["kvpress"]:
        pytest.skip('kvpress does not import in this python (pip install ".[bench]", transformers<5.3)')
    rows = rows_of(doc, context, batch)
    kept = LAYERS * batch * KV_HEADS * (SMALL + DECODED)
    snap, kvp, ada = rows[("snapkv", SMALL)], rows[("kvpress-snapkv", SMALL)], rows[("kvpress-ada-snapkv", SMALL)]
    assert kvp["kv_tokens"] == snap["kv_tokens"] == kept
    assert kvp["kv_bytes"] == kept * 2 * HEAD_DIM * 4                  # K and V, fp32
    full = rows[("full", None)]
    assert ada["kv_tokens"] == full["kv_tokens"]
    assert ada["kv_bytes"] == full["kv_bytes"] + 3 * 8 * LAYERS * batch * KV_HEADS * (context - SMALL)
    assert rows[("kvpress-snapkv", LARGE)]["kv_tokens"] == full["kv_tokens"]   # B >= context: no pruning
    ratio = next(q for q in doc["kvpress_ratios"] if (q["context"], q["batch"], q["budget"]) == (context, batch, SMALL))
    assert ratio["snapkv_over_kvpress_bytes"] == snap["kv_bytes"] / kvp["kv_bytes"]
    assert ratio["ada_over_snapkv_bytes"] == rows[("ada-snapkv", SMALL)]["kv_bytes"] / snap["kv_bytes"]
    assert ratio["snapkv_over_kvpress_decode"] == snap["decode_tokens_per_s"] / kvp["decode_tokens_per_s"]
    assert "| ours snapkv / kvpress snapkv, KV bytes |" in doc["table"]


def test_kvpress_ratio_keeps_exactly_the_budget():
    """kvpress keeps int(context * (1 - ratio)) tokens; 1 - B / context would often give B - 1.
    In a child process: importing kvpress wraps transformers' attention functions."""
    pytest.importorskip("kvpress", reason='kvpress is not installed (pip install ".[bench]")')
    code = ("import e2e\nfrom kvpress.utils import compute_n_kept\n"
            "bad = [(n, b, m) for n in range(33, 9000, 7) for b in (1, 32, 48, 100, 128, 256, 1000, 1024, 4096)\n"
            "       for m in e2e.KVPRESS if b < n\n"
            "       if compute_n_kept(n, e2e.kvpress_press(m, b, n).compression_ratio) != b]\n"
            "assert not bad, bad[:5]\n"
            "assert e2e.kvpress_press('kvpress-snapkv', 300, 200).compression_ratio == 0\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "bench"), env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_keep_is_a_fraction_of_each_context():
    import argparse
    e2e = import_e2e()
    assert e2e.budgets_of(argparse.Namespace(budgets=None, keep=[0.125, 0.5]), 2048) == [256, 1024]
    assert e2e.budgets_of(argparse.Namespace(budgets=[64], keep=None), 2048) == [64]


def test_eviction_share_is_derived_for_the_step_methods(run):
    for r in run[0]["rows"]:
        assert ("eviction_share" in r) == (r["method"] in ("h2o-step", "caote-step", "h2o-step-graph"))
        if "eviction_share" in r:
            assert r["eviction_share"] < 1


def test_chunked_mlps_give_the_same_logits():
    """--mlp-chunk splits the prefill's MLPs over tokens; an MLP is per token, so nothing changes."""
    import torch
    e2e = import_e2e()
    model, _ = e2e.build_model("tiny", "cpu", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        e2e.chunk_mlps(model, 64)                 # 300 tokens: chunks of 64, 64, 64, 64, 44
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want, torch.zeros_like(want))


def test_report_reprints_runs_and_refuses_a_case_from_two_runs(run, tmp_path):
    doc, stdout, _ = run
    path = tmp_path / "one.json"
    path.write_text(json.dumps(doc))
    table = subprocess.run([sys.executable, SCRIPT, "--report", str(path)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0 and table.stdout.strip() == doc["table"]
    twice = subprocess.run([sys.executable, SCRIPT, "--report", str(path), str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert twice.returncode != 0 and "ratios must come from one run" in twice.stderr


@pytest.mark.parametrize("argv,message", [
    (["--contexts", "2048,0"], "argument --contexts: must be positive integers, got 0 in '2048,0'"),
    (["--batches", "1,x"], "argument --batches: expected comma-separated positive integers, got 'x'"),
    (["--keep", "0.125,1.5"], "argument --keep: must be fractions in (0, 1], got 1.5 in '0.125,1.5'")])
def test_bad_lists_are_refused_at_the_parser(argv, message):
    assert message in usage_error(SCRIPT, argv)


def test_host_model_has_the_8b_layers_and_heads_at_tiny_widths():
    """--model host: Llama-3.1-8B's layer and head counts (what a patched model's host work
    scales with) at the tiny model's widths."""
    import torch
    e2e = import_e2e()
    model, _ = e2e.build_model("host", "cpu", torch.float32)
    config, big = model.config, e2e.LLAMA_8B
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(config, name) == big[name], name
    assert config.hidden_size == e2e.TINY["hidden_size"] and config.head_dim == e2e.TINY["head_dim"]


def test_tiny_widths_take_a_head_dim_the_cuda_kernel_supports_on_cuda():
    """On CUDA --model host (and tiny) get head_dim 64, the smallest the CUDA attention kernel
    takes (16 was refused on an H100), every other width as on the CPU, where 16 stays."""
    from kvcache_ext.kernels.attention import CUDA_HEAD_DIMS
    e2e = import_e2e()
    for name in ("host", "tiny"):
        cpu, cuda = e2e.model_config(name, "cpu"), e2e.model_config(name, "cuda:0")
        assert cpu == e2e.MODELS[name] and cpu["head_dim"] == 16
        assert cuda == dict(cpu, head_dim=64) and min(CUDA_HEAD_DIMS) == 64
    assert e2e.model_config("llama8b", "cuda") == e2e.LLAMA_8B
