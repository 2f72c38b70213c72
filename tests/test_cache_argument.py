"""kvcache_ext.cache_argument: the cache goes in under the name the installed transformers takes
(``cache`` from 5.24, ``past_key_values`` before), so the library's own model calls warn on no
version and survive the old name's removal (5.40)."""
import gc
import warnings
import weakref

import torch
from tiny_models import VOCAB, tiny_model

import kvcache_ext
from kvcache_ext.cache_argument import cache_argument, with_cache
from kvcache_ext.evaluation.decoding import greedy_continue
from kvcache_ext.policies import H2O, Policy


class NewStyle(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, past_key_values=None, **kwargs):
        return cache


class OldStyle(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return past_key_values


def test_the_name_follows_the_forward_and_holds_no_model():
    assert kvcache_ext.with_cache is with_cache   # the package exports it (README)
    assert cache_argument(NewStyle.forward) == "cache"
    assert cache_argument(OldStyle.forward) == "past_key_values"
    for cls in (NewStyle, OldStyle):
        model, marker = cls(), object()
        assert model(**with_cache(model, marker)) is marker
        alive = weakref.ref(model)
        del model
        gc.collect()
        assert alive() is None, "with_cache kept the model alive"


def test_the_harness_decodes_without_a_deprecation_warning():
    """On transformers 5.24 (CI's newest) model(past_key_values=...) warns FutureWarning: the
    harness's prefill and greedy decoding must not. On older versions the names agree."""
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with kvcache_ext.patch(model, Policy(H2O(), budget=8)) as handle, warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        cache = handle.new_cache()
        with torch.no_grad():
            logits = model(ids, **with_cache(model, cache), use_cache=True).logits[:, -1]
        new, _ = greedy_continue(model, cache, logits, 4, None)
    assert len(new) == 4 and cache.get_seq_length() == 24 + 3
