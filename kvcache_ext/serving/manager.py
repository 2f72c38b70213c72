"""RaggedBatchingManager: transformers' continuous batching manager for a patched model.

``kvcache_ext.patch`` gives the model an ``init_continuous_batching`` of its own (this module's),
which ``generate_batch`` and ``continuous_batching_context_manager`` call (as would the serving
handler of ``transformers serve``, given a patched model): it builds this manager, transformers' ``ContinuousBatchingManager`` with

- the patched attention kept (the stock manager accepts only its own implementations);
- the engine's cache turned into ``RaggedPagedCache`` (each request in its own ragged cache);
- what reads or writes the engine's pages directly turned off: CUDA graphs, the decode fast
  path (the flash kernel reads the pages itself), asynchronous batching and prefix sharing.
"""
from __future__ import annotations

import copy
import dataclasses

import transformers

try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
except ImportError as error:   # transformers before ContinuousBatchingConfig (5.2 has none)
    raise ImportError(f"kvcache_ext serves continuous batching on transformers' engine as 5.24 has it "
                      f"(ContinuousBatchingConfig, ContinuousBatchingManager); transformers "
                      f"{transformers.__version__} lacks it: upgrade transformers, or use generate") from error

from kvcache_ext.serving.cache import RaggedPagedCache  # noqa: E402

PATCHED_PREFIX = "kvcache_ext_"


class RaggedBatchingManager(ContinuousBatchingManager):
    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None, *, handle):
        self.handle = handle
        config = dataclasses.replace(continuous_batching_config, use_cuda_graph=False, use_async_batching=False,
                                     max_blocks_per_request=0, allow_block_sharing=False,
                                     auto_switch_to_flash=False)
        super().__init__(model, generation_config, config, workload_hints)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        if not str(model.config._attn_implementation).startswith(PATCHED_PREFIX):
            super().switch_to_cb_friendly_attn(model, auto_switch_to_flash)

    def _create_batch_processor(self):
        processor = super()._create_batch_processor()
        if not isinstance(processor.cache, RaggedPagedCache):
            RaggedPagedCache.adopt(processor.cache, self.handle, processor.scheduler)
        return processor


def init_continuous_batching(model, handle, generation_config=None, continuous_batching_config=None,
                             workload_hints=None) -> RaggedBatchingManager:
    """``model.init_continuous_batching`` of a patched model (see the module's docstring): the
    stock method's defaults, and a ``RaggedBatchingManager``."""
    if handle.policy.scorer.reconstructs:
        raise ValueError(f"{type(handle.policy.scorer).__name__} scores a prompt by re-running the model over it "
                         "(reconstruction passes), which the continuous batching engine does not run: serve it "
                         "with generate, one request at a time")
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, RaggedBatchingManager) and cached.handle is handle:
        return cached
    gen_config = generation_config if generation_config is not None else model.generation_config
    if gen_config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if gen_config.eos_token_id is None:   # as the stock method: no end of sequence (on a copy here)
        gen_config = copy.deepcopy(gen_config)
        gen_config.update(eos_token_id=-1)
    if continuous_batching_config is None:
        continuous_batching_config = ContinuousBatchingConfig()
    return RaggedBatchingManager(model, gen_config, continuous_batching_config, workload_hints, handle=handle)
