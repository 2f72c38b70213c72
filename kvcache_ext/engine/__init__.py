"""The eviction engine: one layer's attention call with its policy (``eviction``), the steps that
compress a fresh prompt (``prompt``), the reconstruction passes of a scorer that rebuilds the
prompt (``reconstruction``), what a layer of a cache knows (``state.LayerState``), on any layer
storage (``storage.LayerStorage``: the ragged store, or the reference's masked dense cache)."""
