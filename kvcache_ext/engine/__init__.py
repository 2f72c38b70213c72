"""The eviction engine: one layer's attention call with its policy (``forward``), split into its
kinds: a decode step (``decode``), several tokens over the cache (``blocks``), a fresh prompt
compressed (``prompt``), a scorer's reconstruction passes (``reconstruction``); eviction over
the cache (``eviction``), allocations across tensor-parallel ranks (``across_ranks``); what a
layer of a cache knows (``state.LayerState``), on any layer storage (``storage.LayerStorage``:
the ragged store, ``ragged_storage``, or the reference's masked dense cache)."""
