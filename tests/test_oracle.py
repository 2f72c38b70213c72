"""The evaluation's oracle (``kvcache_ext.evaluation.oracle``): its scores are the attention that
the full cache's answer gives each prompt token, as eager attention computes it; the tokens it
keeps are the top ones per head (uniform) or by Ada-KV's split (the default ``oracle``); at keep
1.0 it answers as the full cache does, in both prompt modes; and it is refused wherever it could
be mistaken for a policy to serve with, and on input it cannot rate."""
import re
from types import SimpleNamespace

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import kvcache_ext
from kvcache_ext import cli
from kvcache_ext.cli.eval import check_arguments, resolved
from kvcache_ext.evaluation import compressed_cache, make_policy, record_prefill, register_policy
from kvcache_ext.evaluation.named_policies import parse_policies, policy_names
from kvcache_ext.evaluation.oracle import AnswerOracle, answer_scores, oracle_policy
from kvcache_ext.evaluation.retrieval import run_prompt
from kvcache_ext.policies import AdaKV, Policy, Schedule, Uniform

pytestmark = pytest.mark.usefixtures("one_thread")

N, M = 40, 6      # prompt and answer tokens
HEADS, KV_HEADS, LAYERS = 4, 2, 2


def _ids(length, seed):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", heads=HEADS, kv_heads=KV_HEADS, layers=LAYERS, attn="eager")


def eager_answer_scores(model, prompt, answer):
    """Per layer [1, H, n]: the unpatched model's eager attention probabilities of the answer's
    rows over the prompt's columns, summed over those rows and the query heads of each KV head."""
    n = prompt.shape[1]
    with torch.no_grad():
        out = model(torch.cat([prompt, answer], dim=1), output_attentions=True)
    G = HEADS // KV_HEADS
    return [a[:, :, n:, :n].sum(dim=2).unflatten(1, (KV_HEADS, G)).sum(dim=2) for a in out.attentions]


def kept(model, policy, prompt):
    """Per layer, per KV head, the set of positions the compressed cache holds."""
    recorded = record_prefill(model, prompt)
    with kvcache_ext.patch(model, policy) as handle:
        cache = compressed_cache(policy, recorded, handle.model_parts)
    out = []
    for layer in range(LAYERS):
        view = cache.layer_kv(layer).view({}, True)
        out.append([set(view["pos"][0, h][view["mask"][0, h]].tolist()) for h in range(KV_HEADS)])
    return out


def ada_counts(scores, budget, alpha=0.5):
    """Ada-KV's head budgets in plain PyTorch: the H * B best scores of the layer, head i's share
    B*_i of them, then alpha * B*_i + (1 - alpha) * B, rounded by largest remainder (ties to the
    lower head)."""
    H, n = scores.shape
    total = H * budget
    best = torch.topk(scores.flatten(), total).indices // n
    chosen = torch.bincount(best, minlength=H).double()
    mixed = alpha * chosen + (1 - alpha) * budget
    base = mixed.floor()
    rem = mixed - base
    order = sorted(range(H), key=lambda h: (-rem[h].item(), h))
    counts = base.long()
    for h in order[:total - int(base.sum())]:
        counts[h] += 1
    return counts.tolist()


def test_scores_are_the_answer_attention_of_eager_attention(model):
    prompt, answer = _ids(N, 1), _ids(M, 2)
    got = answer_scores(model, prompt, answer)
    want = eager_answer_scores(model, prompt, answer)
    assert len(got) == LAYERS
    for g, w in zip(got, want):
        assert g.shape == (1, KV_HEADS, N)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    # Only the first `scored` columns: the question of agnostic mode is read, not rated.
    part = answer_scores(model, prompt, answer.flatten().tolist(), scored=N - 5)
    for p, w in zip(part, want):
        torch.testing.assert_close(p, w[..., :N - 5], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("budget", [5, 12])
def test_uniform_oracle_keeps_each_heads_top_tokens(model, budget):
    prompt, answer = _ids(N, 3), _ids(M, 4)
    policy = oracle_policy("oracle-uniform", budget, answer_scores(model, prompt, answer))
    assert isinstance(policy.allocation, Uniform) and policy.protection.size == 0
    want = eager_answer_scores(model, prompt, answer)
    got = kept(model, policy, prompt)
    for layer in range(LAYERS):
        for h in range(KV_HEADS):
            top = set(torch.topk(want[layer][0, h], budget).indices.tolist())
            assert got[layer][h] == top, (layer, h)


@pytest.mark.parametrize("seed", [9, 13])   # prompts whose heads get unequal budgets in both layers
def test_oracle_splits_the_budget_by_ada_kv(model, seed):
    prompt, answer = _ids(N, seed), _ids(M, seed + 1)
    budget = 8
    policy = oracle_policy("oracle", budget, answer_scores(model, prompt, answer))
    assert isinstance(policy.allocation, AdaKV) and policy.allocation.alpha == 0.5
    want = eager_answer_scores(model, prompt, answer)
    got = kept(model, policy, prompt)
    for layer in range(LAYERS):
        counts = ada_counts(want[layer][0], budget)
        assert len(set(counts)) > 1, "equal budgets: the check would not tell Ada-KV from uniform"
        for h in range(KV_HEADS):
            top = set(torch.topk(want[layer][0, h], counts[h]).indices.tolist())
            assert got[layer][h] == top, (layer, h, counts)


def _prompt(n, seed):
    ids = _ids(n, seed)[0]
    return SimpleNamespace(input_ids=ids, haystack_end=n - 6, length=n, depth=0.5, seed=seed, answer="?",
                           max_new_tokens=6, score=lambda text: 0.0)


TOKENIZER = SimpleNamespace(eos_token_id=None, encode=lambda text, add_special_tokens=False: [],
                            decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


@pytest.mark.parametrize("mode", ["aware", "agnostic"])
def test_keep_one_answers_as_the_full_cache(model, mode):
    records = run_prompt(model, TOKENIZER, _prompt(N, 7), "passkey", mode, ["full", "oracle", "oracle-uniform"],
                         [1.0, 0.25], max_new_tokens=6)
    by = {(r.policy, r.budget): r for r in records}
    assert set(by) == {("full", None), ("oracle", 1.0), ("oracle", 0.25), ("oracle-uniform", 1.0),
                       ("oracle-uniform", 0.25)}
    full = by["full", None]
    assert len(full.output.split()) == 6
    for name in ("oracle", "oracle-uniform"):
        assert by[name, 1.0].output == full.output, name
        assert by[name, 1.0].budget_tokens == (N if mode == "aware" else N - 6)
        assert by[name, 0.25].kv_bytes < by[name, 1.0].kv_bytes


def test_the_oracle_is_no_policy_to_serve_with(capsys):
    assert "oracle" not in policy_names() and "oracle" not in parse_policies("all")
    assert parse_policies("full,Oracle,oracle-uniform") == ["full", "oracle", "oracle-uniform"]
    with pytest.raises(ValueError, match="oracle.*full cache's answer.*kvcache-ext eval"):
        make_policy("oracle", 64)
    with pytest.raises(ValueError, match="reserved"):
        register_policy("oracle-uniform", scorer=lambda b: None)
    # kvcache-ext serve refuses it before loading anything.
    assert cli.main(["serve", "--policy", "oracle", "--budget", "64"]) == 2
    assert "is the evaluation's oracle" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--task", "ppl", "--policy", "full,oracle", "--budget", "64"], "--policy oracle.*not ppl"),
    (["--task", "multi", "--policy", "oracle-uniform", "--budget", "64"], "--policy oracle-uniform.*not multi"),
    (["--task", "ruler", "--policy", "oracle", "--keep", "0.25", "--prefill-block", "16"], "one-shot"),
    (["--task", "passkey", "--policy", "oracle", "--budget", "64", "--decode-every", "4"], "one-shot"),
])
def test_eval_refuses_the_oracle_where_it_cannot_run(argv, says):
    args = resolved(cli.build_parser().parse_args(["eval", *argv]))
    problem = check_arguments(args)
    assert problem is not None and re.search(says, problem), problem


def test_eval_takes_the_oracle_on_retrieval():
    for task in ("passkey", "needle", "ruler"):
        args = resolved(cli.build_parser().parse_args(["eval", "--task", task, "--policy", "full,oracle,ada-snapkv",
                                                       "--keep", "0.25"]))
        assert check_arguments(args) is None


def test_bad_input_is_refused_by_name(model):
    prompt = _ids(N, 8)
    with pytest.raises(ValueError, match="answer_ids"):
        answer_scores(model, prompt, [])
    with pytest.raises(ValueError, match="answer_ids"):
        answer_scores(model, prompt, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(TypeError, match="answer_ids"):
        answer_scores(model, prompt, None)
    with pytest.raises(ValueError, match="answer_ids"):
        answer_scores(model, prompt, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="prompt_ids"):
        answer_scores(model, [], [1, 2])
    with pytest.raises(ValueError, match="scored"):
        answer_scores(model, prompt, [1, 2], scored=N + 1)
    with pytest.raises(ValueError, match="unknown oracle"):
        oracle_policy("snapkv", 8, answer_scores(model, prompt, [1, 2]))
    with pytest.raises(ValueError, match="AnswerOracle scores"):
        AnswerOracle([])
    scores = answer_scores(model, prompt, [1, 2])
    with pytest.raises(ValueError, match="one-shot"):
        Policy(AnswerOracle(scores), budget=8, schedule=Schedule(prefill_block=8))
    # Scores of another prompt (another length) are refused when the prefill asks for them.
    policy = oracle_policy("oracle-uniform", 8, scores)
    recorded = record_prefill(model, _ids(N + 3, 9))
    with kvcache_ext.patch(model, policy) as handle:
        with pytest.raises(ValueError, match="another prompt"):
            compressed_cache(policy, recorded, handle.model_parts)
    # Scores for another model's shape are refused by patch.
    other = tiny_model("llama", heads=HEADS, kv_heads=KV_HEADS, layers=LAYERS + 1)
    with pytest.raises(ValueError, match="AnswerOracle scores are for 2 layers"):
        kvcache_ext.patch(other, policy)
