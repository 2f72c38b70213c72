"""RULER-style tasks (kvcache_ext.tasks.ruler): the prompts, built with the default model's real
tokenizer, against what each task promises; RULER's metric; ``kvcache-ext eval --task ruler``;
kvpress's presses in the harness (with a stand-in kvpress, so that the plumbing is tested where
kvpress is not installed)."""
from __future__ import annotations

import json
import re
import sys
import types
from collections import Counter

import pytest
import torch

from kvcache_ext.tasks.ruler import TASKS, make_ruler_prompt, string_match_all
from kvcache_ext.tasks.ruler.niah import VARIANTS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


def _before_question(tokenizer, p) -> str:
    return tokenizer.decode(p.input_ids[:p.haystack_end])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("n_tokens", [700, 1500])
def test_prompt_fits_the_length_and_holds_its_answers_before_the_question(tokenizer, task, n_tokens):
    p = make_ruler_prompt(tokenizer, task, n_tokens, seed=3)
    assert p.task == task and p.length == p.input_ids.numel() <= n_tokens
    assert p.length >= n_tokens - 80   # filled up to the length (to one filler unit: a UUID needle is ~70 tokens)
    assert p.input_ids.tolist() == tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
    before, after = _before_question(tokenizer, p), tokenizer.decode(p.input_ids[p.haystack_end:])
    assert re.match(r"\s*(What|Question)", after), after[:80]
    assert 0 < p.haystack_end < p.length
    for answer in p.answers:   # every answer is in the context, none only in the question
        assert answer in before
    assert p.max_new_tokens == {"vt": 30, "cwe": 120, "fwe": 50}.get(task, 128)
    again = make_ruler_prompt(tokenizer, task, n_tokens, seed=3)
    assert torch.equal(again.input_ids, p.input_ids) and again.answers == p.answers
    other = make_ruler_prompt(tokenizer, task, n_tokens, seed=4)
    assert other.answers != p.answers


@pytest.mark.parametrize("task", list(VARIANTS))
def test_needle_variants_plant_what_their_configuration_says(tokenizer, task):
    spec = VARIANTS[task]
    p = make_ruler_prompt(tokenizer, task, 1200, seed=1)
    kind = spec.value
    needles = re.findall(rf"One of the special magic {kind} for (\S+) is: (\S+)\.", p.prompt)
    by_key = {}
    for key, value in needles:
        by_key.setdefault(key, []).append(value)
    question = re.search(rf"What are all the special magic {kind} for (.+) mentioned", p.prompt).group(1)
    asked = re.split(r", and |, ", question)
    assert len(asked) == spec.queries
    assert sorted(p.answers) == sorted(v for k in asked for v in by_key[k])
    assert all(len(by_key[k]) == spec.values for k in asked)
    value_form = r"\d{7}" if spec.value == "numbers" else r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    key_form = r"[a-z]+-[a-z]+" if spec.key == "words" else value_form
    assert all(re.fullmatch(value_form, v) for v in p.answers)
    assert all(re.fullmatch(key_form, k) for k in by_key)
    if spec.haystack == "needle":   # a haystack of needles: many keys, one asked
        assert len(by_key) > 10
    else:
        assert len(by_key) == spec.keys
    if spec.haystack == "noise":
        assert p.prompt.count("The grass is green.") > 5
    assert p.prompt.count(" " + p.answers[0]) == 1


def test_variable_tracking_chain_in_order(tokenizer):
    p = make_ruler_prompt(tokenizer, "vt", 900, seed=2)
    value = re.search(r"assigned the value (\d+) in the text", p.prompt).group(1)
    links = re.findall(r"VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|\d+)\.", p.prompt)
    assert len(links) == 5 and links[0][1] == value
    for (name, _, _), (_, _, source) in zip(links, links[1:]):
        assert source == name   # each link assigns the previous variable
    assert p.answers == [name for name, _, _ in links]


def test_common_words_answer_is_the_ten_most_common_list_entries(tokenizer):
    for n in (800, 3000):
        p = make_ruler_prompt(tokenizer, "cwe", n, seed=5)
        body = _before_question(tokenizer, p)
        counts = Counter(re.findall(r"^\d+\. ([a-z]+)$", body, flags=re.M))
        ten = counts.most_common(11)
        assert sorted(p.answers) == sorted(w for w, _ in ten[:10])
        assert ten[9][1] > ten[10][1]   # the common ones stand above every other word


def test_frequent_words_answer_is_the_three_most_frequent_coded_words(tokenizer):
    p = make_ruler_prompt(tokenizer, "fwe", 1500, seed=6)
    body = _before_question(tokenizer, p).split("coded words.")[-1]
    counts = Counter(w for w in body.split() if re.fullmatch(r"[a-z]{6}", w)).most_common(4)
    assert p.answers == [w for w, _ in counts[:3]] and counts[2][1] > counts[3][1]
    assert body.count("....") > counts[0][1]   # the dots are the most frequent "word"


def test_string_match_all_is_the_share_of_answers_found():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert string_match_all("Answer: FOO, bar", ["foo", "BAR", "baz", "qux"]) == 0.5
    assert string_match_all("33.", ["3336625"]) == 0.0


def test_bad_requests_are_refused(tokenizer):
    with pytest.raises(ValueError, match="task must be one of niah_single_1"):
        make_ruler_prompt(tokenizer, "qa_1", 1000)
    with pytest.raises(ValueError, match="n_tokens must be a positive integer; got 0"):
        make_ruler_prompt(tokenizer, "vt", 0)
    with pytest.raises(ValueError, match=r"n_tokens=60 is shorter than the niah_single_1 prompt without filler"):
        make_ruler_prompt(tokenizer, "niah_single_1", 60)


def _use_session_model(monkeypatch, default_model):
    from kvcache_ext.hf import models
    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: default_model)


def test_eval_ruler_smoke(default_model, monkeypatch, tmp_path, capsys):
    """Two RULER tasks, both prompt modes: per-task rows, RULER's mean, scores from the outputs."""
    from kvcache_ext import cli
    _use_session_model(monkeypatch, default_model)
    out, png = tmp_path / "ruler.json", tmp_path / "ruler.png"
    assert cli.main(["eval", "--task", "ruler", "--ruler-tasks", "niah_single_1,niah_multivalue",
                     "--policy", "full,snapkv", "--keep", "0.5", "--lengths", "500", "--max-new-tokens", "24",
                     "--json", str(out), "--plot", str(png), "--no-progress"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "niah_single_1 (aware): RULER score" in printed and "ruler (agnostic): RULER score, mean" in printed
    doc = json.loads(out.read_text())
    records = doc["records"]
    assert len(records) == 2 * 2 * 2   # tasks x modes x policies
    for r in records:
        answers = r["answer"].split(", ")
        assert r["score"] == string_match_all(r["output"], answers) and r["correct"] == (r["score"] == 1.0)
    rows = {(r["task"], r["mode"], r["policy"]): r for r in doc["rows"]}
    for mode in ("aware", "agnostic"):
        for policy in ("full", "snapkv"):
            tasks = [rows[(t, mode, policy)]["score"] for t in ("niah_single_1", "niah_multivalue")]
            assert rows[("ruler", mode, policy)]["score"] == pytest.approx(sum(tasks) / 2)
    assert rows[("niah_single_1", "aware", "full")]["score"] == 100.0   # the full cache finds it at 500 tokens
    assert rows[("niah_single_1", "aware", "snapkv")]["kv_fraction"] < 0.6


def test_eval_ruler_bad_arguments(default_model, monkeypatch, capsys):
    from kvcache_ext import cli
    _use_session_model(monkeypatch, default_model)
    assert cli.main(["eval", "--task", "ruler", "--ruler-tasks", "qa_1", "--no-progress"]) == 2
    assert "unknown RULER task(s) qa_1; accepted: niah_single_1" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "passkey", "--ruler-tasks", "vt", "--no-progress"]) == 2
    assert "--ruler-tasks applies to --task ruler, not passkey" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "ruler", "--lengths", "60", "--budget", "16", "--policy", "full",
                     "--no-progress"]) == 2
    assert "--lengths 60: niah_single_1: n_tokens=60 is shorter" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "ppl", "--policy", "kvpress-snapkv", "--budget", "64", "--no-progress"]) == 2
    assert "kvpress's presses run on passkey, needle and ruler, not ppl" in capsys.readouterr().err


# --- kvpress in the harness, with a stand-in ---------------------------------------------------
class _KeepLast:
    """A stand-in scorer press, built as kvpress builds its scorer presses: a forward hook on each
    attention module hands the layer's cache to ``compress`` during the prefill, and ``compress``
    keeps the tokens that ``score`` rates highest (here the last ones: a pruned cache)."""

    def __init__(self, compression_ratio):
        self.compression_ratio = compression_ratio

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return torch.arange(keys.shape[2], dtype=keys.dtype).expand(keys.shape[:3]).clone()

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = int(keys.shape[2] * (1 - self.compression_ratio))
        index = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values[..., None].expand(-1, -1, -1, keys.shape[3])
        return keys.gather(2, index), values.gather(2, index)

    def forward_hook(self, module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))   # the cache's name in transformers 5.2 / 5.24
        layer = cache.layers[module.layer_idx]
        if hidden.shape[1] == layer.keys.shape[2]:   # the prefill
            layer.keys, layer.values = self.compress(module, hidden, layer.keys, layer.values, output[1], kwargs)
        return output

    def __call__(self, model):
        import contextlib

        @contextlib.contextmanager
        def pressing():
            hooks = [layer.self_attn.register_forward_hook(self.forward_hook, with_kwargs=True)
                     for layer in model.model.layers]
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()
        return pressing()


class _MasksFirst:
    """A stand-in for kvpress's KVzip: after the prefill (inside the press) its passes rate the
    context (here the first tokens highest, ``score_val`` [L, 1, H, n]), then ``compress_post``
    masks the lowest on the attention modules (``masked_key_indices``, which kvpress's attention
    reads and this stand-in's model does not) and counts each call."""
    posts = []

    def __init__(self, compression_ratio):
        self.compression_ratio = compression_ratio
        self.score_val = None

    def compress_post(self, model):
        _MasksFirst.posts.append(self.compression_ratio)
        layers, _, heads, n = self.score_val.shape
        for layer in model.model.layers:
            pruned = int(heads * n * self.compression_ratio)
            flat = (-self.score_val[layer.self_attn.layer_idx]).reshape(1, -1).topk(pruned, dim=1).indices.flatten()
            layer.self_attn.masked_key_indices = (torch.zeros_like(flat), flat // n, flat % n)

    def __call__(self, model):
        import contextlib

        @contextlib.contextmanager
        def pressing():
            seen = []
            hook = model.model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"]),
                                                         with_kwargs=True)
            try:
                yield
            finally:
                hook.remove()
            config = model.config
            n = seen[0].shape[1]
            self.score_val = (-torch.arange(n, dtype=torch.float32)).expand(
                config.num_hidden_layers, 1, config.num_key_value_heads, n).clone()
            if self.compression_ratio > 0:
                self.compress_post(model)
            self.score_val = None
        return pressing()


@pytest.fixture
def stand_in_kvpress(monkeypatch):
    module = types.ModuleType("kvpress")
    for name in ("SnapKVPress", "ExpectedAttentionPress", "TOVAPress", "StreamingLLMPress", "KnormPress"):
        setattr(module, name, _KeepLast)
    module.KVzipPress = _MasksFirst
    presses = types.ModuleType("kvpress.presses")
    presses.kvzip_press = types.SimpleNamespace(AutoTokenizer=None)   # what kvzip_tokenizer swaps
    monkeypatch.setitem(sys.modules, "kvpress.presses", presses)
    monkeypatch.setitem(sys.modules, "kvpress.presses.kvzip_press", presses.kvzip_press)
    module.AdaKVPress = lambda press: press
    monkeypatch.setitem(sys.modules, "kvpress", module)
    return module


@pytest.mark.parametrize("installed, refused", [("5.24.0", True), ("5.2.0", False)])
def test_kvpress_is_refused_outside_the_transformers_it_declares(stand_in_kvpress, monkeypatch, installed, refused):
    # kvpress 0.5.5 imports with transformers 5.24, then fails in its hook on the first forward.
    from importlib import metadata

    from kvcache_ext.evaluation.kvpress_runs import kvpress_missing
    declared = {"kvpress": ["torch", "transformers<5.3,>=5.2", "datasets>=2.21; extra == 'eval'"]}
    versions = {"kvpress": "0.5.5", "transformers": installed}
    monkeypatch.setattr(metadata, "requires", lambda name: declared[name])
    monkeypatch.setattr(metadata, "version", lambda name: versions[name])
    why = kvpress_missing()
    if refused:
        assert why.startswith("kvpress 0.5.5 requires transformers<5.3,>=5.2, but transformers 5.24.0 is installed")
        assert 'pip install ".[bench]"' in why
    else:
        assert why is None


def test_a_kvpress_without_package_metadata_is_taken_as_it_imports(stand_in_kvpress, monkeypatch):
    from importlib import metadata

    from kvcache_ext.evaluation.kvpress_runs import kvpress_missing

    def not_found(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "requires", not_found)
    assert kvpress_missing() is None


def test_press_runs_keep_the_budget_and_number_the_tokens_after_the_pruned_ones(default_model, stand_in_kvpress):
    from transformers import DynamicCache

    from kvcache_ext.evaluation.decoding import cache_bytes, greedy_continue
    from kvcache_ext.evaluation.kvpress_runs import compression_ratio, run_press
    from kvcache_ext.cache_argument import with_cache
    model, tokenizer = default_model
    p = make_ruler_prompt(tokenizer, "niah_single_2", 400, seed=0)
    context, question = p.input_ids[None, :p.haystack_end], p.input_ids[None, p.haystack_end:]
    # Keeping everything: the tokens of the full cache, and its bytes.
    new, _, held, prefill_s = run_press(model, tokenizer, "kvpress-snapkv", 1.0, context, question, 6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context, **with_cache(model, cache), use_cache=True)
        logits = model(question, **with_cache(model, cache), use_cache=True).logits[:, -1]
    expected, _ = greedy_continue(model, cache, logits, 6, tokenizer.eos_token_id)
    assert new == expected and held == cache_bytes(cache) and prefill_s > 0
    # Keeping the last 100 tokens: the question and the new tokens are numbered after the whole context.
    seen = []
    forward = model.forward
    model.forward = lambda *a, **k: (seen.append(k.get("position_ids")), forward(*a, **k))[1]
    try:
        new, _, held, _ = run_press(model, tokenizer, "kvpress-ada-snapkv", 100, context, question, 3)
    finally:
        del model.forward
    n, m = context.shape[1], question.shape[1]
    assert seen[0] is None and seen[1].tolist() == [list(range(n, n + m))]
    assert [int(s) for s in seen[2:]] == list(range(n + m, n + m + len(new) - 1))
    assert int(n * (1 - compression_ratio(100, n))) == 100
    per_token = cache_bytes(cache) / cache.layers[0].keys.shape[2]
    assert held == per_token * (100 + m + len(new) - 1)


@pytest.mark.parametrize("name", ["kvpress-snapkv", "kvpress-kvzip", "kvpress-streamingllm"])
def test_a_press_scored_once_gives_what_its_pipeline_gives_at_each_budget(default_model, stand_in_kvpress, name):
    """run_press_budgets (one prefill, the press's own selection per budget) against run_press
    (kvpress's pipeline) per budget: the same tokens and bytes at every budget, KVzip's passes
    run once and its selection once per budget, no mask left behind."""
    from kvcache_ext.evaluation.kvpress_runs import compression_ratio, run_press, run_press_budgets
    model, tokenizer = default_model
    p = make_ruler_prompt(tokenizer, "niah_single_2", 400, seed=1)
    context, question = p.input_ids[None, :p.haystack_end], p.input_ids[None, p.haystack_end:]
    budgets = [1.0, 0.5, 100, 0.125]
    _MasksFirst.posts.clear()
    together = run_press_budgets(model, tokenizer, name, budgets, context, question, 5)
    if name == "kvpress-kvzip":
        assert _MasksFirst.posts == [compression_ratio(b, context.shape[1]) for b in budgets]
    alone = [run_press(model, tokenizer, name, b, context, question, 5) for b in budgets]
    assert [(new, held) for new, _, held, _ in together] == [(new, held) for new, _, held, _ in alone]
    assert len({held for _, _, held, _ in together}) == len(budgets)   # each budget pruned its own
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in model.model.layers)


@pytest.mark.parametrize("name", ["kvpress-snapkv", "kvpress-ada-snapkv"])
def test_kvpress_compresses_only_gemma3s_global_layers(stand_in_kvpress, monkeypatch, name):
    """kvpress's rule for Gemma 3 (the sliding-window layers left as they are), which kvpress
    itself applies to Gemma3ForConditionalGeneration only, holds for Gemma3ForCausalLM in both
    of the harness's runs: the press's hook and its compression see the global layer only, and
    each budget still prunes it."""
    from tiny_models import tiny_model

    from kvcache_ext.evaluation.kvpress_runs import run_press, run_press_budgets
    model = tiny_model("gemma3_text", heads=4, kv_heads=1, layers=2, sliding_window=16)
    assert [layer.self_attn.is_sliding for layer in model.model.layers] == [True, False]
    hooked, compressed = [], []
    hook, compress = _KeepLast.forward_hook, _KeepLast.compress
    monkeypatch.setattr(_KeepLast, "forward_hook", lambda self, module, *a: (
        hooked.append(module.layer_idx), hook(self, module, *a))[1])
    monkeypatch.setattr(_KeepLast, "compress", lambda self, module, *a: (
        compressed.append(module.layer_idx), compress(self, module, *a))[1])
    tokens = torch.randint(0, 101, (1, 66), generator=torch.Generator().manual_seed(0))
    context, question = tokens[:, :60], tokens[:, 60:]
    tokenizer = types.SimpleNamespace(eos_token_id=None)
    alone = [run_press(model, tokenizer, name, keep, context, question, 4) for keep in (0.5, 0.25)]
    assert set(hooked) == {1} and set(compressed) == {1}
    hooked.clear(), compressed.clear()
    together = run_press_budgets(model, tokenizer, name, [0.5, 0.25], context, question, 4)
    assert set(hooked) == {1} and compressed == [1, 1]
    assert [(new, held) for new, _, held, _ in together] == [(new, held) for new, _, held, _ in alone]
    assert alone[0][2] > alone[1][2]


def test_eval_runs_kvpress_names_beside_ours(default_model, monkeypatch, stand_in_kvpress, tmp_path):
    from kvcache_ext import cli
    _use_session_model(monkeypatch, default_model)
    out = tmp_path / "ruler.json"
    assert cli.main(["eval", "--task", "ruler", "--ruler-tasks", "niah_single_1", "--policy",
                     "snapkv,kvpress-snapkv", "--keep", "0.5", "--lengths", "400", "--mode", "agnostic",
                     "--max-new-tokens", "4", "--json", str(out), "--no-progress"]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["policy"] for r in records] == ["snapkv", "kvpress-snapkv"]
    press = records[1]
    assert press["budget"] == 0.5 and press["kv_bytes"] < 0.6 * press["full_bytes"] and press["prefill_s"] > 0


def test_seeds_give_distinct_prompts_per_task_and_length(tokenizer):
    from kvcache_ext.evaluation.retrieval import make_prompts
    prompts = make_prompts(tokenizer, "ruler", [450, 600], [], 3, TASKS)
    assert len(prompts) == len(TASKS) * 2 * 3
    for task in TASKS:
        for n in (450, 600):
            these = [p for p in prompts if p.task == task and p.n_tokens == n]
            assert [p.seed for p in these] == [0, 1, 2]
            assert len({tuple(p.input_ids.tolist()) for p in these}) == 3
            assert len({tuple(p.answers) for p in these}) == 3


def test_first_seed_gives_the_prompts_held_out_from_a_run_of_the_seeds_before_it(tokenizer):
    """--first-seed 2 --seeds 2: the prompts of seeds 2 and 3, as a run of seeds 0-3 makes them."""
    from kvcache_ext.evaluation.retrieval import make_prompts
    tasks = TASKS[:2]
    later = make_prompts(tokenizer, "ruler", [450], [], 2, tasks, first_seed=2)
    every = make_prompts(tokenizer, "ruler", [450], [], 4, tasks)
    assert [(p.task, p.seed) for p in later] == [(t, s) for t in tasks for s in (2, 3)]
    assert [p.input_ids.tolist() for p in later] == [p.input_ids.tolist() for p in every if p.seed >= 2]
    needles = make_prompts(tokenizer, "passkey", [300], [0.1, 0.9], 2, first_seed=4)
    assert [p.seed for p in needles] == [4, 5, 6, 7]


def test_eval_ruler_kvpress_protocol_reports_each_mean_with_its_spread(default_model, monkeypatch, tmp_path, capsys):
    """--protocol kvpress with a shorter prompt and two seeds: kvpress's four keeps, a score per
    prompt, its standard error in the rows and the table, and the frontier plot."""
    from kvcache_ext import cli
    from kvcache_ext.evaluation.spread import standard_error
    _use_session_model(monkeypatch, default_model)
    out, png = tmp_path / "ruler.json", tmp_path / "frontier.png"
    assert cli.main(["eval", "--protocol", "kvpress", "--lengths", "400", "--seeds", "2", "--ruler-tasks",
                     "niah_single_1", "--policy", "full,snapkv", "--mode", "agnostic", "--max-new-tokens", "8",
                     "--json", str(out), "--frontier", str(png), "--no-progress"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(out.read_text())
    args = doc["meta"]["args"]
    assert (args["task"], args["keep"], args["lengths"], args["seeds"]) == ("ruler", [0.75, 0.5, 0.25, 0.125], [400], 2)
    records = doc["records"]
    assert len(records) == 2 * (1 + 4)   # seeds x (full + snapkv at each keep)
    assert len({r["answer"] for r in records if r["policy"] == "full"}) == 2
    printed = capsys.readouterr().out
    for row in doc["rows"]:
        assert [p["seed"] for p in row["prompt_scores"]] == [0, 1]
        scores = [p["score"] for p in row["prompt_scores"]]
        assert row["score"] == pytest.approx(sum(scores) / 2) and row["sem"] == pytest.approx(standard_error(scores))
        assert f"{row['score']:.1f} ± {row['sem']:.1f} ({row['kv_fraction']:.2f})" in printed
    assert {row["budget"] for row in doc["rows"]} == {None, 0.75, 0.5, 0.25, 0.125}
