"""RaggedBatchingManager: transformers' continuous batching manager for a patched model.

``kvcache_ext.patch`` gives the model an ``init_continuous_batching`` of its own (this module's),
which ``generate_batch`` and ``continuous_batching_context_manager`` call (as would the serving
handler of ``transformers serve``, given a patched model): it builds this manager, transformers' ``ContinuousBatchingManager`` with

- the patched attention kept (the stock manager accepts only its own implementations);
- the engine's cache turned into ``RaggedPagedCache`` (each request in its own ragged cache),
  its own pages built as small as the engine allows, and admission by our pages against the KV
  budget the engine would have given its pages: ``num_blocks`` blocks of ``page_size`` tokens
  of every layer when the configuration gives it, else what the engine infers from free memory;
- its scheduler refusing, when it arrives, a request that could never be admitted (its peak
  above the whole budget; a fork), with a clear error for that request only;
- what reads or writes the engine's pages directly turned off: CUDA graphs, the decode fast
  path (the flash kernel reads the pages itself), asynchronous batching and its block sharing
  (shared prefixes come through its prefix hook instead: ``kvcache_ext.serving.cache``); and
  the scheduler's safety margin (0 unless given: an admitted request reserves its peak, so it
  never waits for memory).
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import transformers

try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator)
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
except ImportError as error:   # transformers before ContinuousBatchingConfig (5.2 has none)
    raise ImportError(f"kvcache_ext serves continuous batching on transformers' engine as 5.24 has it "
                      f"(ContinuousBatchingConfig, ContinuousBatchingManager); transformers "
                      f"{transformers.__version__} lacks it: upgrade transformers, or use generate") from error

from kvcache_ext.serving.cache import RaggedPagedCache  # noqa: E402

PATCHED_PREFIX = "kvcache_ext_"


@functools.cache
def admitting(scheduler_class: type) -> type:
    """The engine's scheduler class, refusing when it arrives a request that could never be
    admitted (the engine delivers the error to that request alone), not in the middle of a step."""

    def add_waiting_request(self, state):
        self.cache.check_admissible(state)
        scheduler_class.add_waiting_request(self, state)

    return type(f"Admitting{scheduler_class.__name__}", (scheduler_class,),
                {"add_waiting_request": add_waiting_request, "__module__": __name__})


class RaggedBatchingManager(ContinuousBatchingManager):
    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None, *, handle):
        self.handle = handle
        margin = continuous_batching_config.safety_margin
        config = dataclasses.replace(continuous_batching_config, use_cuda_graph=False, use_async_batching=False,
                                     max_blocks_per_request=0, allow_block_sharing=False,
                                     auto_switch_to_flash=False, safety_margin=0.0 if margin is None else margin)
        self.kv_budget_bytes: int | None = None    # set when the batch processor is made
        super().__init__(model, generation_config, config, workload_hints)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        if not str(model.config._attn_implementation).startswith(PATCHED_PREFIX):
            super().switch_to_cb_friendly_attn(model, auto_switch_to_flash)

    def _create_batch_processor(self):
        if getattr(self, "batch_processor", None) is not None:     # the engine resets and reuses it
            return super()._create_batch_processor()
        config = self.continuous_batching_config
        wanted_blocks = config.num_blocks
        config.num_blocks = 1     # the engine's own pages: as few as it allows (nothing is stored there)
        processor = super()._create_batch_processor()
        cache = processor.cache
        block_bytes = self.block_bytes(cache)
        if wanted_blocks is not None:
            budget = wanted_blocks * block_bytes
        else:   # what the engine would have given its pages, from the memory it finds free
            config.num_blocks = None
            supports = getattr(self.model, "_supports_logits_to_keep", None)
            _, sectors = PagedAttentionMemoryHandler(
                config=self.model.config.get_text_config(), cb_config=config, dtype=self.model.dtype,
                bytes_per_sector=cache.bytes_per_sector, tokens_per_sector=cache.tokens_per_sector,
                bytes_per_block=block_bytes, attn_types=list(cache.cache_allocators),
                model_supports_logits_to_keep=callable(supports) and supports(),
            ).infer_max_batch_tokens_and_num_sectors()
            budget = sectors * cache.bytes_per_sector
        config.num_blocks = budget // block_bytes    # the budget in the engine's blocks, as it reports them
        self.kv_budget_bytes = budget
        RaggedPagedCache.adopt(cache, self.handle, processor.scheduler, budget)
        processor.scheduler.__class__ = admitting(type(processor.scheduler))
        return processor

    def block_bytes(self, cache) -> int:
        """Bytes of one of the engine's blocks: ``page_size`` tokens of K and V of every layer."""
        shape = self.handle.shape
        return shape.num_layers * FullAttentionCacheAllocator.get_bytes_per_page(
            shape.kv_heads, shape.head_dim, cache.dtype, self.continuous_batching_config.page_size)


def init_continuous_batching(model, handle, generation_config=None, continuous_batching_config=None,
                             workload_hints=None) -> RaggedBatchingManager:
    """``model.init_continuous_batching`` of a patched model (see the module's docstring): the
    stock method's defaults, and a ``RaggedBatchingManager``."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, RaggedBatchingManager) and cached.handle is handle:
        return cached
    gen_config = generation_config if generation_config is not None else model.generation_config
    if gen_config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if gen_config.eos_token_id is None:   # as the stock method: no end of sequence (on a copy here)
        gen_config = copy.deepcopy(gen_config)
        gen_config.update(eos_token_id=-1)
    if (gen_config.num_return_sequences or 1) > 1:
        raise ValueError(f"generation_config.num_return_sequences = {gen_config.num_return_sequences}: several "
                         "sequences per request fork the request's cache, which kvcache_ext's serving does not "
                         "do; send the request once per sequence")
    if continuous_batching_config is None:
        continuous_batching_config = ContinuousBatchingConfig()
    return RaggedBatchingManager(model, gen_config, continuous_batching_config, workload_hints, handle=handle)
