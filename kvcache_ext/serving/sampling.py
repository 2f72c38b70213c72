"""Sampling per request in a shared batch: temperature, top_p and top_k of each request.

transformers' continuous batching engine samples every request of a batch with one generation
config (its server builds the engine from the first request's), but it can apply temperature,
top-k and top-p per request (``per_request_processors``) when its config creates those
processors and each request passes its values to ``add_request``. So the engine is built once
to sample with all three (``engine_generation_config``), and every request passes its own
(``engine_kwargs``): a greedy request is top-k 1, whose one token multinomial sampling draws
for certain.
"""
from __future__ import annotations

import copy
import dataclasses

from kvcache_ext.serving.validation import Sampling

GREEDY = {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
# Below this a temperature is greedy (its limit): dividing the logits by less could overflow them.
LEAST_TEMPERATURE = 1e-4
NO_TOP_K = 2**31 - 1     # above any vocabulary: the engine keeps every token


def engine_generation_config(config):
    """A copy of ``config`` that makes the engine create its temperature, top-k and top-p
    processors (each request's own values replace these)."""
    config = copy.deepcopy(config)
    config.update(do_sample=True, temperature=0.5, top_k=1, top_p=0.5)
    return config


def engine_kwargs(sampling: Sampling, model_config) -> dict:
    """The engine's per-request values for a request's sampling fields. A field not given takes
    the model's generation config when it samples (as ``generate`` would), else OpenAI's default
    (temperature 1, no top-p or top-k cut); temperature 0 (or below ``LEAST_TEMPERATURE``), or
    none given for a model that decodes greedily with no top_p or top_k given, is greedy."""
    model_samples = bool(getattr(model_config, "do_sample", False))
    if sampling.temperature is not None:
        samples = sampling.temperature >= LEAST_TEMPERATURE
    else:
        samples = model_samples or sampling.top_p is not None or sampling.top_k is not None
    if not samples:
        return dict(GREEDY)

    def given(value, name, default):
        if value is not None:
            return value
        model_value = getattr(model_config, name, None) if model_samples else None
        return default if model_value is None else model_value
    top_k = given(sampling.top_k, "top_k", NO_TOP_K)
    return {"temperature": float(given(sampling.temperature, "temperature", 1.0)),
            "top_k": int(top_k) if top_k > 0 else NO_TOP_K,
            "top_p": float(given(sampling.top_p, "top_p", 1.0))}


def serve_per_request(generation_state, pending: dict) -> None:
    """Makes the continuous batching managers of transformers' serving state (``GenerationState``)
    sample per request: the engine built with ``engine_generation_config`` and per-request
    processors, and each request added with the values of the ``Sampling`` that ``pending``
    holds under its id (``engine_kwargs``; none: the model's defaults)."""
    from transformers import ContinuousBatchingConfig

    # The state builds its engine manager from this config (a private attribute: no accessor).
    generation_state._cb_config = dataclasses.replace(generation_state._cb_config or ContinuousBatchingConfig(),
                                                      per_request_processors=True)
    get_manager = generation_state.get_manager

    def manager_for(model_id: str, use_cb: bool = False):
        manager = get_manager(model_id, use_cb=use_cb)
        if use_cb and "init_cb" not in vars(manager):
            init_cb = manager.init_cb

            def init(model, gen_config):
                if manager._cb is not None:
                    return
                init_cb(model, engine_generation_config(gen_config))
                add_request = manager._cb.add_request

                def add(input_ids, request_id=None, **kwargs):
                    sampling = engine_kwargs(pending.pop(request_id, Sampling()), model.generation_config)
                    return add_request(input_ids, request_id=request_id, **kwargs, **sampling)
                manager._cb.add_request = add
            manager.init_cb = init
        return manager

    generation_state.get_manager = manager_for
