"""The token ids of a patched model's call, noted into its cache: what ``patch``'s forward
pre-hook does when its policy reads token ids (``Capabilities.needs_token_ids``: ``Spanned``).

The ids go to the positions where the engine places the same tokens: the call's
``position_ids`` when it has them (generate's, left padding aware), else the cache's length
onwards (the model's own default); padding (``attention_mask`` 0) is not noted. A call without
``input_ids`` (``inputs_embeds`` only) notes nothing, and a scorer that needs the ids of its
tokens then says so.
"""
from __future__ import annotations

import inspect

import torch

from kvcache_ext.hf.cache import RaggedCache


def call_arguments(module, args, kwargs) -> dict:
    """The arguments of a call of ``module`` by name (its forward's signature)."""
    try:
        return inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:   # a signature that does not bind: the keywords only
        return dict(kwargs)


def note_call_token_ids(module, args, kwargs) -> None:
    """Notes the ``input_ids`` of a call of a patched model (or of its decoder) into the
    RaggedCache it is given, before the call runs."""
    arguments = call_arguments(module, args, kwargs)
    flat = dict(arguments.pop("kwargs", {}) or {}, **arguments)
    cache = next((v for v in flat.values() if isinstance(v, RaggedCache)), None)
    ids = flat.get("input_ids")
    if cache is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    cache.note_token_ids(ids, flat.get("attention_mask"), flat.get("position_ids"))
