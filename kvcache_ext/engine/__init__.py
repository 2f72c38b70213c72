"""The eviction engine: one layer's attention call with its policy, on any layer storage
(``storage.LayerStorage``: the ragged store, or the reference's masked dense cache)."""
