"""Head-wise eviction under transformers' tensor parallelism (``tp_plan="auto"``), on CPU.

Two ranks (``torch.multiprocessing.spawn``, gloo) load a tiny random-weight Llama of 4 KV
heads with ``from_pretrained(..., tp_plan="auto")``: each rank's attention sees 2 of them,
and its cache holds those 2. For each policy the tokens generated (greedy) equal one
process's, the per-head token counts of the two ranks side by side equal one process's, in a batch of two rows, one left-padded
(Ada-KV's exact split across ranks and KVzip's global top-k included), and each rank holds
about half of one process's bytes. One spawn runs every policy, so the run pays the ranks'
imports once.
"""
import os
import tempfile

import pytest
import torch

import kvcache_ext
from kvcache_ext.hf.cache import RaggedCache
from kvcache_ext.hf.tensor_parallel import tp_plan_auto
from kvcache_ext.policies import (H2O, KVEC, TOVA, AcrossLayers, AdaKV, EveryStep, KVzip, Policy, Random,
                                  SnapKV)
from child import free_port
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, NEW, BUDGET = 128, 8, 40
# KVzip's instructions as token ids: the tiny model has no tokenizer.
KVZIP_IDS = dict(prompt=(5, 6, 7), continue_prompt=(8, 9), suffix=(10,), skip_prefix=None)


def policies() -> dict:
    return {
        "snapkv": Policy(SnapKV(), budget=BUDGET),
        "ada-snapkv": Policy(SnapKV(), budget=BUDGET, allocation=AdaKV()),
        "ada-snapkv-per-rank": Policy(SnapKV(), budget=BUDGET, allocation=AdaKV(across_ranks="per_rank")),
        "h2o-step": Policy(H2O(), budget=BUDGET, schedule=EveryStep()),
        "ada-h2o-step": Policy(H2O(), budget=BUDGET, schedule=EveryStep(), allocation=AdaKV()),
        "kvzip-global": Policy(KVzip(**KVZIP_IDS), budget=BUDGET, allocation=AdaKV(alpha=1.0, layers=AcrossLayers())),
        # a score that reads every head of the layer (TOVA's mean), at the prompt and while decoding
        "tova-step": Policy(TOVA(), budget=BUDGET, schedule=EveryStep()),
        # a score by the model's head index (each rank's heads are the model's heads from rank * H on)
        "random": Policy(Random(seed=3), budget=BUDGET),
        # each rank's heads on int8 pages (KV_DTYPES)
        "snapkv-int8": Policy(SnapKV(), budget=BUDGET),
    }


KV_DTYPES = {"snapkv-int8": "int8"}   # what the pages hold, where not the model's dtype


PAD = 17   # the second row is left-padded: rows are split independently on every rank


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    return ids, mask


def run_policies(model) -> dict:
    """Per policy: the generated tokens, the per-layer [B, H] tokens held, the bytes held."""
    out = {}
    for name, policy in policies().items():
        with kvcache_ext.patch(model, policy, kv_dtype=KV_DTYPES.get(name)) as handle:
            ids, mask = prompt()
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 min_new_tokens=NEW, return_dict_in_generate=True, pad_token_id=0)
            cache = gen.past_key_values
            out[name] = (gen.sequences[:, PROMPT:].tolist(), [k.clone() for k in cache.kept_tokens()], cache.nbytes)
    return out


def _rank(rank: int, world: int, path: str, port: int, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **tp_plan_auto()).eval()
        with kvcache_ext.patch(model, policies()["ada-snapkv"]) as handle:
            shape = handle.shape
            try:   # a cache made without the model's parts cannot split across ranks: refused
                model(prompt()[0], past_key_values=RaggedCache(handle.policy, shape.num_layers))
                refused = None
            except ValueError as err:
                refused = str(err)
        try:   # continuous batching counts every head's pages in one process: refused
            with kvcache_ext.patch(model, policies()["snapkv"]):
                model.init_continuous_batching()
            batching = None
        except NotImplementedError as err:
            batching = str(err)
        try:   # K-VEC reads every head of a layer in ways not split over ranks: refused at patch
            kvcache_ext.patch(model, Policy(KVEC(), budget=BUDGET))
            kvec = None
        except ValueError as err:
            kvec = str(err)
        torch.save({"shape": shape, "refused": refused, "kvec": kvec, "batching": batching, "runs": run_policies(model)},
                   os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    """(one process's runs, each rank's) over the same saved model."""
    import torch.multiprocessing as mp
    model = tiny_model("llama", heads=8, kv_heads=4, head_dim=16, layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        path, results = os.path.join(tmp, "model"), os.path.join(tmp, "results")
        os.makedirs(results)
        model.save_pretrained(path)
        mp.spawn(_rank, args=(2, path, free_port(), results), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(results, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    return run_policies(model), ranks


def test_each_rank_sees_its_own_heads(runs):
    _, ranks = runs
    for r, got in enumerate(ranks):
        shape = got["shape"]
        assert (shape.heads, shape.kv_heads, shape.ranks) == (4, 2, 2), (r, shape)


def test_a_cache_without_the_models_ranks_is_refused(runs):
    _, ranks = runs
    for got in ranks:
        assert got["refused"] is not None and "handle.new_cache()" in got["refused"], got["refused"]


def test_kvec_and_continuous_batching_are_refused_under_tensor_parallelism(runs):
    _, ranks = runs
    for got in ranks:
        assert got["kvec"] is not None and "tensor-parallel" in got["kvec"], got["kvec"]
        assert got["batching"] is not None and "tensor-parallel" in got["batching"], got["batching"]


# ---------------------------------------------------------------- the shape, without processes
class _Mesh:
    def get_group(self):
        return "group"

    def get_local_rank(self):
        return 1

    def size(self):
        return 2


class _Sharded:
    """A DTensor weight as the shape reads it: its mesh and its local rows."""

    def __init__(self, rows):
        self.device_mesh, self.rows = _Mesh(), rows

    def to_local(self):
        return torch.empty(self.rows, 1)


def _fake_tp_model(heads=8, kv_heads=4, head_dim=16, style="colwise", local_rows=None):
    """What model_shape reads of a tensor-parallel model: config, tp_size, tp_plan, the key
    projection's sharded weight."""
    from types import SimpleNamespace
    from transformers import LlamaConfig
    config = LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         hidden_size=heads * head_dim, num_hidden_layers=2)
    rows = kv_heads // 2 * head_dim if local_rows is None else local_rows
    k_proj = SimpleNamespace(weight=_Sharded(rows))
    return SimpleNamespace(config=config, tp_size=2, tp_plan={"model.layers.*.self_attn.k_proj": style},
                           named_modules=lambda: iter([("model.layers.0.self_attn.k_proj", k_proj)]))


def test_shape_is_each_ranks_share_of_the_heads():
    from kvcache_ext.hf.tensor_parallel import model_shape, ranks_of
    shape = model_shape(_fake_tp_model())
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.ranks) == (4, 2, 16, 2)
    ranks = ranks_of(_fake_tp_model())
    assert (ranks.rank, ranks.size) == (1, 2)
    # a plan that gathers the projection's output leaves every head on every rank
    gathered = model_shape(_fake_tp_model(style="colwise_gather_output"))
    assert (gathered.heads, gathered.kv_heads, gathered.ranks) == (8, 4, 1)


def test_shape_refuses_heads_a_rank_cannot_hold_whole():
    from kvcache_ext.hf.tensor_parallel import model_shape
    with pytest.raises(ValueError, match=r"tp_size 2 does not divide the model's num_key_value_heads \(3\)"):
        model_shape(_fake_tp_model(heads=6, kv_heads=3))
    with pytest.raises(ValueError, match="holds 8 output rows on rank 1, not 2 KV heads of 16"):
        model_shape(_fake_tp_model(local_rows=8))


@pytest.mark.parametrize("name", [n for n in policies() if n != "ada-snapkv-per-rank"])
def test_tokens_and_heads_equal_one_process(runs, name):
    one, ranks = runs
    tokens, kept, nbytes = one[name]
    for r, got in enumerate(ranks):
        assert got["runs"][name][0] == tokens, (name, r)
    for layer, held in enumerate(kept):
        side_by_side = torch.cat([got["runs"][name][1][layer] for got in ranks], dim=1)
        assert torch.equal(side_by_side, held), (name, layer, side_by_side, held)
    # Each rank holds its own heads: about half the bytes (pages are per head; tables aside).
    for got in ranks:
        assert 0.35 * nbytes < got["runs"][name][2] < 0.65 * nbytes, (name, got["runs"][name][2], nbytes)


def test_ada_per_rank_shares_each_ranks_budget(runs):
    """AdaKV(across_ranks="per_rank"): each rank's heads hold its part of the budget (its 2 heads
    times the per-head budget) in every layer, however the row's best scores fall over ranks."""
    _, ranks = runs
    share = 2 * (BUDGET + NEW - 1)   # the prompt's budget, then the decoded tokens appended
    for got in ranks:
        for held in got["runs"]["ada-snapkv-per-rank"][1]:
            assert held.sum(dim=1).tolist() == [share, share], held
    # The exact split moves budget between ranks somewhere (else this test could not tell them apart).
    exact = [total for got in ranks for held in got["runs"]["ada-snapkv"][1] for total in held.sum(dim=1).tolist()]
    assert any(total != share for total in exact), exact
