"""Decode steps in a CUDA graph (kvcache_ext.hf.decode_graph, ``patch(..., cuda_graph=True)``).

On the CPU the graphs are played by tests/graph_emulator.py, which replays what a capture
recorded with CUDA graphs' semantics (same memory, host values frozen, no Python run again):
a step that leaned on the host would differ from the eager steps here, as it would on a GPU.
The CUDA twin at the end runs real CUDA graphs (bench/tools/gpu_verify.sh's test stage)."""
import inspect

import pytest
import torch

import kvcache_ext
from kvcache_ext import RaggedKVStore
from kvcache_ext.engine import forward
from kvcache_ext.hf import decode_graph
from kvcache_ext.cache_argument import with_cache
from kvcache_ext import reference
from kvcache_ext.policies import (H2O, AdaKV, BlockwisePrefill, EveryNSteps, EveryStep, KVzip, Policy, Protection,
                                  SnapKV, StreamingLLM, TOVA)
from graph_emulator import EmulatedGraphs
from tiny_models import VOCAB, tiny_model

# KVzip's instructions as token ids: the tiny models have no tokenizer (tests/test_kvzip.py)
KVZIP = KVzip(prompt=(5, 6, 7), continue_prompt=(8, 9), suffix=(10,), skip_prefix=None)
ONE_SHOT = [Policy(SnapKV(window=4), budget=16, allocation=AdaKV()),
            Policy(SnapKV(window=4, kernel=3), ratio=0.5)]
# Policies that evict while decoding by a slot rule (in the storage's call), with the counts of a
# generate of 8 tokens (the prompt and 7 decode steps): (warmups, captures, replays, eager).
# Every step evicts, or every third (two graphs: one per kind of step), or never after a
# block-wise prefill (the mass still accumulates); a budget above a row's prompt (28 > 27),
# protected sinks and recent tokens, a ratio.
EVICTING = [
    (Policy(H2O(), budget=16, schedule=EveryStep()), (1, 1, 5, 1)),
    (Policy(H2O(), budget=16, schedule=EveryNSteps(3)), (2, 2, 3, 1)),
    (Policy(H2O(), budget=12, schedule=BlockwisePrefill(8)), (1, 1, 5, 1)),
    (Policy(StreamingLLM(sinks=2), budget=12, schedule=EveryStep()), (1, 1, 5, 1)),
    (Policy(H2O(), budget=16, schedule=EveryStep(), protection=Protection(sinks=1, recent=4)), (1, 1, 5, 1)),
    (Policy(H2O(), budget=28, schedule=EveryStep()), (1, 1, 5, 1)),
    (Policy(H2O(), ratio=0.5, schedule=EveryStep()), (1, 1, 5, 1)),
]


@pytest.fixture
def cpu_graphs(monkeypatch):
    monkeypatch.setitem(decode_graph.BACKENDS, "cpu", EmulatedGraphs)


def prompt(batch=2, length=30, pad=(3, 0), device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, p in enumerate(pad):
        mask[row, :p] = 0
    return ids.to(device), mask.to(device)


def generate(model, policy, cuda_graph, new_tokens=8, device="cpu", **patch_kwargs):
    """Greedy tokens, each step's logits, the kept positions of every layer, the cache's graph,
    the tokens each layer's pages hold per head."""
    ids, mask = prompt(device=device)
    with kvcache_ext.patch(model, policy, cuda_graph=cuda_graph, **patch_kwargs) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        cache = handle.last_cache
    kept = []
    for i in range(len(cache.layers)):
        view = cache.layer_kv(i).view(None, False)
        kept.append(view["pos"].masked_fill(~view["mask"], -1).cpu())
    caps = [cache.layer_kv(i).store.caps for i in range(len(cache.layers))]
    return out.sequences, torch.stack(out.logits), kept, cache._decode_graph, caps


def assert_same_generation(a, b, atol=0.0):
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], atol=atol, rtol=atol)
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", ONE_SHOT, ids=["ada-snapkv", "snapkv"])
def test_graph_steps_give_the_eager_tokens_logits_and_cache(cpu_graphs, arch, policy):
    model = tiny_model(arch, heads=4, kv_heads=2, layers=3)
    eager = generate(model, policy, cuda_graph=False)
    graphed = generate(model, policy, cuda_graph=True)
    assert_same_generation(eager, graphed)
    graph = graphed[3]
    # the prompt eagerly, then one step warms up, one is captured (and replayed), 5 replayed
    assert (graph.warmups, graph.captures, graph.replays, graph.eager_steps) == (1, 1, 5, 1)
    assert eager[3] is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy,counts", EVICTING, ids=lambda p: repr(p).replace(" ", "")[:90])
def test_graph_steps_that_evict_give_the_eager_tokens_logits_and_cache(cpu_graphs, arch, policy, counts):
    """H2O and StreamingLLM evicting while decoding: their channel update, top-k by the slot
    rule and compaction replayed from the graph give the eager steps' logits bit for bit and
    the same kept tokens, in a left-padded batch whose short row may sit below its budget."""
    model = tiny_model(arch, heads=4, kv_heads=2, layers=3)
    eager = generate(model, policy, cuda_graph=False)
    graphed = generate(model, policy, cuda_graph=True)
    assert_same_generation(eager, graphed)
    graph = graphed[3]
    assert (graph.warmups, graph.captures, graph.replays, graph.eager_steps) == counts
    assert graph.failed is None


@pytest.mark.parametrize("policy", [ONE_SHOT[0], EVICTING[0][0]], ids=["ada-snapkv", "h2o-every-step"])
def test_graph_steps_under_the_models_eager_attention(cpu_graphs, policy):
    """A model whose dense attention is HF's eager one gets a mask tensor at every step (SDPA's
    gets none without padding): the graph's steps do not read it (it checked the mask on the
    host before the step), so they are captured and give the eager steps' results."""
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2, attn="eager")
    eager = generate(model, policy, cuda_graph=False)
    graphed = generate(model, policy, cuda_graph=True)
    assert_same_generation(eager, graphed)
    graph = graphed[3]
    assert graph.failed is None and (graph.warmups, graph.captures, graph.replays) == (1, 1, 5)


def test_an_evicting_graph_reserves_pages_for_the_steps_between_evictions(cpu_graphs):
    """Without generate's reservation, heads that grow to their budget find no room: the step
    reserves what the shortest head may still grow plus the steps between two evictions
    (``reserve_ahead``), and the graph is captured again; once every head is at its budget
    the pages held stay, and no head holds pages for more than its budget, the steps between
    evictions and the page the reservation rounds up to."""
    model = tiny_model("llama", layers=2)
    policy = Policy(H2O(), budget=40, schedule=EveryNSteps(2))
    eager = generate(model, policy, cuda_graph=False, new_tokens=20, reserve_new_tokens=False)
    graphed = generate(model, policy, cuda_graph=True, new_tokens=20, reserve_new_tokens=False)
    assert_same_generation(eager, graphed)
    graph = graphed[3]
    # both kinds of step (evicting or not) warmed up again for the new pages: 2 + 2
    assert graph.failed is None and graph.warmups >= 4 and graph.captures >= 2 and graph.replays >= 10
    assert max(int(caps.max()) for caps in graphed[4]) <= 40 + 2 + 16


def test_reserve_ahead_is_the_growth_to_the_budget_plus_the_steps_between_evictions():
    class Layer:
        def __init__(self, every, budget, lens):
            self.policy = Policy(H2O(), budget=budget, schedule=EveryNSteps(every) if every else BlockwisePrefill(8))
            self.decode_budget_host = torch.tensor([budget])
            self.kv = type("KV", (), {"lens": torch.tensor([lens])})()
    assert decode_graph.reserve_ahead([Layer(3, 64, [64, 64])]) == 3
    assert decode_graph.reserve_ahead([Layer(3, 64, [64, 60]), Layer(3, 64, [50, 64])]) == 3 + 14
    assert decode_graph.reserve_ahead([Layer(1, 4096, [10, 64])]) == 1 + decode_graph.RESERVE_AHEAD
    assert decode_graph.reserve_ahead([Layer(None, 64, [64, 64])]) == decode_graph.RESERVE_AHEAD


def test_spans_on_the_default_model_note_every_token_id_through_graph_steps(cpu_graphs, default_model):
    """A policy that reads token ids (snapkv-spans): the model's hook notes each call's ids
    outside the step, so the cache's ids by position are the eager run's."""
    from kvcache_ext.policies import Spanned
    model, tokenizer = default_model
    enc = tokenizer(["The code is 4821. Remember it, then say it back.",
                     "A longer second prompt, about the colour of the sky at noon, in words."],
                    return_tensors="pt", padding=True)
    runs = []
    for graph in (False, True):
        with kvcache_ext.patch(model, Policy(Spanned(SnapKV(window=4)), budget=12), tokenizer=tokenizer,
                               cuda_graph=graph) as handle:
            out = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            cache = handle.last_cache
            runs.append((out.sequences, torch.stack(out.logits), cache.token_ids.ids.clone(), cache._decode_graph))
    (seq, logits, ids, _), (g_seq, g_logits, g_ids, graph) = runs
    assert torch.equal(seq, g_seq) and torch.equal(ids, g_ids)
    torch.testing.assert_close(logits, g_logits, atol=0.0, rtol=0.0)
    assert (graph.captures, graph.replays) == (1, 3)


def test_graph_is_captured_again_when_the_pages_run_out(cpu_graphs, monkeypatch):
    """Without generate's reservation the pages fill up: the step reserves RESERVE_AHEAD more
    (8 here, so that it happens several times), which makes new state, and the graph is warmed
    up and captured again."""
    monkeypatch.setattr(decode_graph, "RESERVE_AHEAD", 8)
    model = tiny_model("llama", layers=2)
    policy = ONE_SHOT[0]
    eager = generate(model, policy, cuda_graph=False, new_tokens=24, reserve_new_tokens=False)
    graphed = generate(model, policy, cuda_graph=True, new_tokens=24, reserve_new_tokens=False)
    assert_same_generation(eager, graphed)
    graph = graphed[3]
    assert graph.captures >= 2 and graph.warmups >= graph.captures
    assert graph.warmups + graph.captures + graph.replays + graph.eager_steps == 24


def test_steps_called_by_hand_with_the_tokens_by_position(cpu_graphs):
    """model(ids, cache=..., position_ids=...) step by step, as bench/e2e.py decodes: the same
    logits as eager steps, every step after the first two replayed."""
    model = tiny_model("llama", layers=2)
    ids, _ = prompt(pad=())
    results = []
    for graph in (False, True):
        with kvcache_ext.patch(model, ONE_SHOT[1], cuda_graph=graph) as handle:
            cache = handle.new_cache(max_cache_len=ids.shape[1] + 6)
            with torch.no_grad():
                out = model(ids, **with_cache(model, cache), use_cache=True)
                logits = [out.logits[:, -1]]
                for step in range(6):
                    token = logits[-1].argmax(dim=-1, keepdim=True)
                    position = torch.full_like(token, ids.shape[1] + step)
                    out = model(token, **with_cache(model, cache), use_cache=True, position_ids=position)
                    logits.append(out.logits[:, -1])
        results.append((torch.stack(logits), cache._decode_graph))
    assert torch.equal(results[0][0], results[1][0])
    graph = results[1][1]
    assert (graph.warmups, graph.captures, graph.replays, graph.eager_steps) == (1, 1, 4, 1)


@pytest.mark.parametrize("policy,why", [
    (Policy(H2O(), budget=16, schedule=EveryStep(), allocation=AdaKV()), "evicts on a padded view"),
    (Policy(TOVA(), budget=16, schedule=EveryStep()), "evicts on a padded view"),
], ids=["ada-h2o", "tova"])
def test_steps_a_graph_cannot_serve_run_eagerly(cpu_graphs, policy, why):
    model = tiny_model("llama", layers=2)
    eager = generate(model, policy, cuda_graph=False)
    graphed = generate(model, policy, cuda_graph=True)
    assert_same_generation(eager, graphed)
    graph = graphed[3]
    assert (graph.captures, graph.replays, graph.eager_steps) == (0, 0, 8)
    assert why in graph.declined


def test_without_a_backend_every_step_runs_eagerly():
    """The CPU has no graphs: cuda_graph=True changes nothing there."""
    model = tiny_model("llama", layers=2)
    eager = generate(model, ONE_SHOT[0], cuda_graph=False)
    graphed = generate(model, ONE_SHOT[0], cuda_graph=True)
    assert_same_generation(eager, graphed)
    assert graphed[3].eager_steps == 8 and graphed[3].declined == "no graphs on cpu"


def test_a_step_that_reads_the_device_falls_back_to_eager(cpu_graphs, monkeypatch):
    """A host read inside the step fails the capture (as on CUDA): a warning, and every later
    step of that cache runs eagerly, with the same result."""
    plain = forward.decode

    def reads_the_device(state, q, k, v, pos, valid, scale, plan=None):
        if plan is not None:   # a graph's step
            int(pos.sum())
        return plain(state, q, k, v, pos, valid, scale, plan)

    model = tiny_model("llama", layers=2)
    eager = generate(model, ONE_SHOT[0], cuda_graph=False)
    monkeypatch.setattr(forward, "decode", reads_the_device)
    with pytest.warns(RuntimeWarning, match="without a CUDA graph .*reads a device value"):
        graphed = generate(model, ONE_SHOT[0], cuda_graph=True)
    assert_same_generation(eager, graphed)
    graph = graphed[3]
    assert graph.captures == 0 and graph.eager_steps == 7 and "capture failed" in graph.failed


def test_the_emulator_catches_a_host_value_frozen_into_the_step(cpu_graphs, monkeypatch):
    """The check above can fail: positions taken from the host's count of tokens seen (not from
    the graph's buffer) are frozen at the capture, and the replayed steps store wrong ones."""
    plain = forward.decode

    def positions_from_the_host(state, q, k, v, pos, valid, scale, plan=None):
        if plan is not None:   # a graph's step
            pos = torch.full_like(pos, state.seen)
        return plain(state, q, k, v, pos, valid, scale, plan)

    model = tiny_model("llama", layers=2)
    eager = generate(model, ONE_SHOT[1], cuda_graph=False)
    monkeypatch.setattr(forward, "decode", positions_from_the_host)
    graphed = generate(model, ONE_SHOT[1], cuda_graph=True)
    assert not all(torch.equal(x, y) for x, y in zip(eager[2], graphed[2]))


def test_patched_forwards_keep_the_model_signature():
    """generate reads the forward's signature to pass position_ids and the mask: a wrapper
    without it loses them (a left-padded row's positions then count its padding)."""
    model = tiny_model("llama", layers=2)
    want = inspect.signature(model.forward)
    for policy, graph in ((ONE_SHOT[0], True), (Policy(KVZIP, ratio=0.5), False)):
        with kvcache_ext.patch(model, policy, cuda_graph=graph):
            assert inspect.signature(model.forward) == want
        assert "forward" not in vars(model)


def test_kvzip_gives_a_left_padded_row_its_own_positions_in_generate():
    """The regression the signature caused: KVzip's wrapped forward hid position_ids from
    generate, so a left-padded row's positions counted its padding (RoPE is blind to the
    shift, but what reads positions is not: KVzip's sinks, a protection's)."""
    model = tiny_model("llama", layers=2)
    ids, mask = prompt()                                       # row 0: 3 padding tokens
    with kvcache_ext.patch(model, Policy(KVZIP, ratio=1.0)) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)   # holds the cache
        view = handle.last_cache.layer_kv(0).view(None, False)
    del out
    real = int(mask[0].sum())
    assert view["pos"][0, 0, :real + 3].tolist() == list(range(real + 3))   # the prompt and 3 fed tokens


def test_patch_refuses_a_cuda_graph_that_is_not_a_bool():
    model = tiny_model("llama", layers=2)
    with pytest.raises(TypeError, match="cuda_graph"):
        kvcache_ext.patch(model, ONE_SHOT[0], cuda_graph="yes")


def test_store_appends_into_held_pages_and_counts_them_apart():
    store = RaggedKVStore(2, 2, 8, dtype=torch.float32, score_channels=0, page_size=4)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(2))
    store.append(k, v, torch.arange(5).expand(2, 5))
    store.reserve(2)                                     # pages for 7 tokens per segment: 8
    twin = RaggedKVStore(2, 2, 8, dtype=torch.float32, score_channels=0, page_size=4)
    twin.append(k, v, torch.arange(5).expand(2, 5))
    plan = store.attention_plan_of_pages(2)
    q = torch.randn(2, 4, 1, 8, generator=gen)
    for step in range(3):
        k1, v1 = (torch.randn(2, 2, 1, 8, generator=gen) for _ in range(2))
        pos = torch.full((2, 1), 5 + step)
        assert store.has_room(1)
        store.append_in_pages(k1, v1, pos)
        store.note_appended(1)
        twin.append(k1, v1, pos)
        got, _ = kvcache_ext.ragged_attention(q, store, plan=plan)
        want, _ = kvcache_ext.ragged_attention(q, twin)
        assert torch.equal(got, want)
        assert torch.equal(store.lens, twin.lens) and torch.equal(store.to_dense().pos, twin.to_dense().pos)
    assert not store.has_room(1)
    with pytest.raises(ValueError, match="segment 0 holds 8 tokens in pages for 8: no room for 1 more"):
        store.note_appended(1)
    assert store.lens.tolist() == [[8, 8], [8, 8]]


@pytest.mark.parametrize("rule", ["mass", "position"])
@pytest.mark.parametrize("sinks,recent", [(0, 0), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_evicts_in_held_pages_by_a_rule_as_the_reference_selects(rule, sinks, recent, dtype):
    """evict_by_rule without ``kept`` (a captured step's: the store_topk op by a slot rule, then
    store_compact, no host step) keeps what the
    reference top-k keeps of the rule's scores (channel 0 or the position; +inf where
    protected), and note_kept_in_pages gives min(len, k) with every page still held. Empty
    and one-token segments, GQA-shaped rows (3 heads), batch 2, a budget of 0."""
    gen = torch.Generator().manual_seed(3)
    B, H, D = 2, 3, 8
    store = RaggedKVStore(B, H, D, dtype=dtype, score_channels=2, page_size=4)
    n = 11
    k_new, v_new = (torch.randn(B, H, n, D, generator=gen).to(dtype) for _ in range(2))
    pos = torch.stack([torch.arange(n), torch.arange(n) + 5])                 # row 1 from position 5
    valid = torch.rand(B, H, n, generator=gen) < 0.6
    valid[0, 0] = False                                                       # an empty segment
    valid[0, 1] = torch.arange(n) == 4                                        # one token
    store.append(k_new, v_new, pos, valid=valid)
    store.add_to_scores(0, torch.randn(store.capacity, generator=gen))
    store.add_to_scores(1, torch.randn(store.capacity, generator=gen))
    before = store.to_dense()
    pages, caps = store.num_pages, store.caps.clone()
    budget = torch.tensor([[3, 0, 2], [4, 1, 20]], dtype=torch.int32)
    last_pos = torch.tensor([10, 15])
    score = before.scores[..., 0] if rule == "mass" else before.pos.float()
    protected = (before.pos < sinks) | ((before.pos > last_pos[:, None, None] - recent) & (recent > 0))
    score = score.masked_fill(protected, float("inf"))
    lens = before.lens.reshape(-1)
    keep = reference.segmented_topk(score.reshape(B * H, -1), before.pos.reshape(B * H, -1), lens,
                                    budget.reshape(-1)).view(B, H, -1)
    store.evict_by_rule(budget.reshape(-1), rule=rule, sinks=sinks, recent=recent,
                        last_pos=last_pos if recent else None)
    store.note_kept_in_pages(budget.reshape(-1).long())
    assert store.lens.tolist() == torch.minimum(before.lens, budget.long()).tolist()
    assert store.num_pages == pages and torch.equal(store.caps, caps)        # no page given back
    after = store.to_dense()
    for b in range(B):
        for h in range(H):
            kept = keep[b, h]
            m = int(kept.sum())
            # The same tokens; unordered (one moved per evicted place): compared by position.
            mine, theirs = after.pos[b, h, :m].argsort(), before.pos[b, h][kept].argsort()
            for name in ("k", "v", "pos", "scores"):
                assert torch.equal(getattr(after, name)[b, h, :m][mine], getattr(before, name)[b, h][kept][theirs]), \
                    (b, h, name)
    store.validate()


def test_store_eviction_by_rule_refuses_bad_input():
    store = RaggedKVStore(2, 2, 8, dtype=torch.float32, score_channels=1, page_size=4)
    store.append(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), torch.arange(5))
    k = torch.full((4,), 2, dtype=torch.int32)
    bad = [
        (lambda: store.evict_by_rule(k, rule="tova"), "rule must be 'mass'"),
        (lambda: store.evict_by_rule(k, rule="mass", recent=2), "recent > 0 needs last_pos"),
        (lambda: store.evict_by_rule(k, rule="mass", recent=2, last_pos=torch.tensor([1, 2, 3])),
         r"last_pos must be \[B\] \(one per row, B dividing the 4 segments\), got shape \[3\]"),
        (lambda: store.evict_by_rule(k, rule="mass", sinks=-1), "sinks and recent must be >= 0"),
        (lambda: store.select(k.view(2, 2), torch.zeros(store.capacity), rule="mass"), "scores or a rule"),
        (lambda: store.select(k.view(2, 2), sinks=2), "sinks, recent and last_pos protect tokens under a rule"),
        (lambda: store.note_kept_in_pages(torch.tensor([2, 2, 2])), "note_kept_in_pages takes the budgets as 4"),
        (lambda: store.note_kept_in_pages(torch.tensor([2, 2, 2, -1])), "budgets >= 0, got -1 for segment 3"),
        (lambda: store.add_to_scores(1, torch.zeros(store.capacity)), r"channel must be in \[0, 1\)"),
        (lambda: store.add_to_scores(0, torch.zeros(3)), rf"values must be a \[capacity\] = \[{store.capacity}\]"),
        (lambda: store.add_to_scores(0, torch.zeros(store.capacity, dtype=torch.float64)), "values must have dtype"),
    ]
    for call, message in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            call()
        assert store.lens.tolist() == [[5, 5], [5, 5]]
    no_channels = RaggedKVStore(2, 2, 8, dtype=torch.float32, score_channels=0, page_size=4)
    with pytest.raises(ValueError, match="rule 'mass' accumulates in score channel 0"):
        no_channels.evict_by_rule(k, rule="mass")


@pytest.mark.skipif(not (torch.cuda.is_available() and kvcache_ext.build_info()["cuda"]),
                    reason="needs a CUDA GPU and a CUDA build of kvcache_ext")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_steps_give_the_eager_tokens_on_cuda(dtype):
    """Real CUDA graphs. The replayed steps attend with the plan of the pages held, the eager
    ones with a plan of their lengths: other splits, so float32 agrees to rounding (the same
    tokens), bfloat16 to its own (the first replayed step's logits; a later greedy token may
    differ where two logits are within bfloat16's rounding)."""
    model = tiny_model("llama", heads=8, kv_heads=2, head_dim=64, layers=3, dtype=dtype).cuda()
    for policy in ONE_SHOT + [EVICTING[0][0], EVICTING[3][0]]:
        eager = generate(model, policy, cuda_graph=False, new_tokens=12, device="cuda")
        graphed = generate(model, policy, cuda_graph=True, new_tokens=12, device="cuda")
        graph = graphed[3]
        assert graph.failed is None and (graph.warmups, graph.captures, graph.replays) == (1, 1, 9), policy
        if dtype == torch.float32:
            assert_same_generation(eager, graphed, atol=1e-4)
        else:   # the prompt's, the warm step's and the captured step's logits
            torch.testing.assert_close(graphed[1][:3].float(), eager[1][:3].float(), atol=5e-2, rtol=5e-2)
