"""The compiled kernels' Python side: the torch ops (``ops``), the store that owns their state
(``store.RaggedKVStore``), and the attention and selection over it (``attention``, ``select``).
Everything here reaches a kernel through its ``torch.ops.kvcache_ext`` op; the compiled
``_C.PageAllocator`` is the store's host-side page allocator."""
