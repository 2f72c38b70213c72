"""``kvcache-ext serve``: transformers' OpenAI-compatible server (``transformers serve
--continuous-batching``) over a model patched with a policy.

transformers' ``Serve`` builds its ``ModelManager`` by name inside its constructor and loads
models through ``ModelManager._load_model``. While ``Serve`` is built, this module puts a subclass
there (``patching_model_manager``: every model it loads is patched with the policy), and wraps
its ``build_server`` (``build_server_checked``); the server's continuous batching handler
then calls the patched model's ``init_continuous_batching`` (``kvcache_ext.serving.manager``).
The routes, protocol, streaming and the engine's scheduler are transformers' own. Added: every
request checked before it runs (``validation``), sampled with its own settings (``sampling``)
and cancelled when its client leaves, streamed or not (``disconnect``); ``GET /v1/kvcache``
(the KV budget, what live requests reserve and hold, what is kept for reuse, the shared
prefixes: ``kv_stats``); every error in OpenAI's shape; and a shared system prompt
(``shared_system``: compressed once when the model loads, read by every request that starts
with it).
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os

from kvcache_ext.policies import Policy
from kvcache_ext.serving.admission import NEEDS_SHARED_PREFIX, TOO_LARGE
from kvcache_ext.serving.disconnect import KeepReceive, unless_client_leaves
from kvcache_ext.serving.sampling import serve_per_request
from kvcache_ext.serving.validation import InvalidRequest, check_request, error_body

SERVING_EXTRA = "pip install 'transformers[serving]'"
STATS_ROUTE = "/v1/kvcache"
ENDPOINTS = ("chat", "completion", "response")     # the generating routes' handlers, checked


def require_serving() -> None:
    """Raises ImportError naming the install command when transformers' server cannot run here."""
    missing = [name for name in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"kvcache-ext serve runs transformers' server, which needs {', '.join(missing)}: "
                          f"{SERVING_EXTRA}")


def patching_model_manager(policy: Policy | None, page_size: int = 16, shared_system: str | None = None,
                           kv_dtype: str | None = None) -> type:
    """transformers' ``ModelManager`` whose models are patched with ``policy`` as they load
    (None: left as they are, HF's paged cache), with the model's tokenizer (a scorer that
    prompts the model, KVzip, needs it). ``shared_system``: a system message whose tokens, as
    the model's chat template renders it, are compressed once then and shared
    (``shared_system_ids``, ``handle.share_prefix``). ``kv_dtype``: what the caches' pages hold
    (``patch``'s)."""
    from transformers.cli.serving.model_manager import ModelManager

    from kvcache_ext.hf.patching import is_patched, patch

    class PatchingModelManager(ModelManager):
        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            local_gguf = gguf_file is not None and os.path.isfile(os.path.join(model_id_and_revision, gguf_file))
            if local_gguf:   # a GGUF file's config names no architecture, which transformers serve needs
                return load_local_gguf(os.path.join(model_id_and_revision, gguf_file), self.dtype, self.device)
            return super()._load_model(model_id_and_revision, tqdm_class, progress_callback, gguf_file)

        def load_model_and_processor(self, *args, **kwargs):
            model, processor = super().load_model_and_processor(*args, **kwargs)
            if policy is not None and not is_patched(model):   # loaded now (else: as it was)
                handle = patch(model, policy, page_size=page_size, tokenizer=processor, kv_dtype=kv_dtype)
                if shared_system is not None:
                    handle.share_prefix(shared_system_ids(processor, shared_system))
            return model, processor

    return PatchingModelManager


def shared_system_ids(tokenizer, text: str) -> list[int]:
    """The token ids that open every chat whose first message is the system message ``text``:
    the chat template's rendering of that message alone, without a generation prompt."""
    ids = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=True,
                                        add_generation_prompt=False, return_dict=False)
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def load_local_gguf(path: str, dtype, device):
    """A local GGUF file as kvcache_ext loads it (``kvcache_ext.hf.models.load_model``): dense
    weights of ``dtype`` ("auto": float32), on ``device`` ("auto": the GPU when there is one)."""
    import torch

    from kvcache_ext.hf.models import load_model

    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_model(path, dtype=dtype, device=device)[0]


def build_server_checked(build_server):
    """transformers' ``build_server``, and on its app: every request to the chat, completions
    and responses routes checked first (``kvcache_ext.serving.validation``), sampled with its own
    settings (``kvcache_ext.serving.sampling``) and, not streamed, cancelled when its client
    leaves (``kvcache_ext.serving.disconnect``); ``GET /v1/kvcache`` (``kv_stats``); and every
    error answered in OpenAI's shape (``error_handlers``)."""
    from fastapi.responses import JSONResponse

    def build(*args, **kwargs):
        app = build_server(*args, **kwargs)
        named = inspect.signature(build_server).bind(*args, **kwargs).arguments
        model_manager, state = named["model_manager"], named["generation_state"]
        pending = {}       # request id -> its Sampling, until the engine takes the request
        serve_per_request(state, pending)
        for endpoint in ENDPOINTS:
            handler = named[f"{endpoint}_handler"]
            handler.handle_request = checked(handler.handle_request, endpoint, model_manager, state, pending)
        app.add_api_route(STATS_ROUTE, lambda: JSONResponse(kv_stats(model_manager, state)), methods=["GET"])
        for error, answer in error_handlers().items():
            app.add_exception_handler(error, answer)
        app.add_middleware(KeepReceive)
        return app

    return build


def checked(handle_request, endpoint: str, model_manager, generation_state, pending: dict):
    """``handle_request`` of transformers' handler for ``endpoint``, behind the request's checks
    (``InvalidRequest``: HTTP 400, or 404 for a model the server does not serve), with the
    request's sampling settings in ``pending`` for the engine, and a non-streamed request
    cancelled in the engine when its client leaves."""
    async def handle(body, request_id: str):
        sampling = check_request(endpoint, body)
        served = model_manager.force_model
        if body.get("model") is not None and served is not None and body["model"] != served:
            raise InvalidRequest("model", f"model is {body['model']!r}: this server serves {served!r}",
                                 "model_not_found", 404)
        body.pop("top_k", None)     # transformers' handlers do not take it: the engine gets it from pending
        pending[request_id] = sampling
        try:
            work = handle_request(body, request_id)
            if body.get("stream", endpoint == "response"):    # transformers' defaults
                return await work
            return await unless_client_leaves(work, lambda: cancel_in_engine(generation_state, request_id))
        finally:
            pending.pop(request_id, None)
    return handle


def cancel_in_engine(generation_state, request_id: str) -> None:
    """Cancels a request in the engine, which frees its pages at its next step (the engine of
    transformers' serving state: ``_cb_manager._cb``, no public accessor)."""
    engine = getattr(getattr(generation_state, "_cb_manager", None), "_cb", None)
    if engine is not None:
        engine.cancel_request(request_id)


def error_handlers() -> dict:
    """Exception class -> the app's answer, every one in OpenAI's error shape: a refused request
    (``InvalidRequest``, a body that is not a JSON object, transformers' own HTTP errors), a
    request that fails in the engine (RuntimeError: HTTP 413 for one that exceeds the KV budget,
    the client's to change; 400 under KVzip without the shared prefix; else 500), and anything
    else (500 with its message, never a bare one)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def refused(_request, error: InvalidRequest):
        return JSONResponse(error.body(), status_code=error.status)

    async def not_an_object(_request, error: RequestValidationError):
        problems = "; ".join(str(e.get("msg", e)) for e in error.errors())
        return JSONResponse(error_body(f"the body must be a JSON object ({problems})", "invalid_request_error",
                                       None, "invalid_body"), status_code=400)

    async def http_error(_request, error: HTTPException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    async def failed(_request, error: RuntimeError):
        message = str(error)
        status, code = (413, "kv_budget_exceeded") if TOO_LARGE in message else \
            (400, "needs_shared_prefix") if NEEDS_SHARED_PREFIX in message else (500, None)
        kind = "server_error" if status == 500 else "invalid_request_error"
        return JSONResponse(error_body(message, kind, None, code), status_code=status)

    async def crashed(_request, error: Exception):
        return JSONResponse(error_body(f"{type(error).__name__}: {error}", "server_error"), status_code=500)

    return {InvalidRequest: refused, RequestValidationError: not_an_object, HTTPException: http_error,
            RuntimeError: failed, Exception: crashed}


@contextlib.contextmanager
def serve_hooks(policy: Policy | None, page_size: int = 16, shared_system: str | None = None,
                kv_dtype: str | None = None):
    """While inside, ``transformers serve`` patches the models it loads (its model manager is
    ``patching_model_manager``'s) and builds its app with ``build_server_checked``."""
    from transformers.cli.serving import model_manager, server

    originals = model_manager.ModelManager, server.build_server
    model_manager.ModelManager = patching_model_manager(policy, page_size, shared_system, kv_dtype)
    server.build_server = build_server_checked(server.build_server)
    try:
        yield
    finally:
        model_manager.ModelManager, server.build_server = originals


def kv_stats(model_manager, generation_state) -> dict:
    """What ``GET /v1/kvcache`` answers: per loaded model, its policy (None: HF's paged cache),
    the KV budget in bytes, the bytes reserved, the bytes live requests hold, the bytes kept for
    reuse once no request holds them (HF's cached blocks; the shared prefixes), and how many
    requests run and wait. A patched model's engine is the one its handle made last; an
    unpatched model's, the one transformers' serving state holds (``_cb_manager``: it has no
    public accessor)."""
    from kvcache_ext.hf.patching import handle_of

    models = {}
    for key, timed in list(model_manager.loaded_models.items()):
        handle = handle_of(timed.model)
        entry = {"policy": repr(handle.policy) if handle is not None else None}
        if handle is not None:
            engine = handle.last_batching
        else:
            engine = getattr(getattr(generation_state, "_cb_manager", None), "_cb", None)
        processor = getattr(engine, "batch_processor", None)
        cache = getattr(processor, "cache", None)
        if cache is not None:
            scheduler = processor.scheduler
            if hasattr(cache, "admission"):     # ours: what the requests reserve and hold
                budget, reserved, held = cache.admission.budget_bytes, cache.admission.reserved_bytes, cache.nbytes
                kept = cache.prefix_bytes
            else:                                # HF's: its pages, allocated as the requests grow
                budget = cache.num_sectors * cache.bytes_per_sector
                kept = sum(len(a.ledger.cached_blocks) * a.bytes_per_block for a in cache.cache_allocators.values())
                reserved = held = budget - int(cache.compute_free_capacity(relative=False)) - kept
            entry.update(budget_bytes=budget, reserved_bytes=reserved, held_bytes=held, kept_for_reuse_bytes=kept,
                         running=len(scheduler.active_requests), waiting=len(scheduler.waiting_requests))
        if handle is not None:   # each shared prefix: its tokens, bytes, and the requests served over it so far
            served = getattr(cache, "served_over", None)
            entry["shared_prefixes"] = [{"tokens": len(p), "nbytes": p.nbytes,
                                         "requests": served.get(cache.prefix_key(p), 0) if served is not None else 0}
                                        for p in handle.prefixes]
        models[key] = entry
    return {"models": models}


def start(model: str, policy: Policy | None, *, page_size: int = 16, host: str = "localhost", port: int = 8000,
          device: str = "auto", dtype: str = "auto", num_blocks: int | None = None,
          max_batch_tokens: int | None = None, log_level: str = "warning", shared_system: str | None = None,
          blocking: bool = True, kv_dtype: str | None = None):
    """Runs ``transformers serve --continuous-batching`` on ``model`` (an HF id, a folder, or
    ``folder:file.gguf``), patched with ``policy`` (None: HF's paged cache); the KV budget is ``num_blocks`` of the
    engine's blocks, or what the engine would give its paged cache. ``shared_system``: a system
    message compressed once and shared by the requests that open with it (needs a policy).
    ``blocking=False`` returns transformers' ``Serve`` object with the server running in a
    thread (``stop`` stops it). ``kv_dtype``: what the caches' pages hold (None: the model's dtype;
    "int8": quantized), which admission counts."""
    require_serving()
    from transformers.cli.serve import Serve

    if shared_system is not None and policy is None:
        raise ValueError("a shared system message is compressed by a policy: HF's paged cache (no policy) has none")
    if kv_dtype is not None and policy is None:
        raise ValueError(f"kv_dtype={kv_dtype!r} is what kvcache_ext's pages hold: HF's paged cache (no policy) has none")
    with serve_hooks(policy, page_size, shared_system, kv_dtype):
        serve = Serve(force_model=model, continuous_batching=True, device=device, dtype=dtype,
                      cb_num_blocks=num_blocks, cb_max_batch_tokens=max_batch_tokens, host=host, port=port,
                      log_level=log_level, non_blocking=True)
    if not blocking:
        return serve
    try:
        serve._thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        stop(serve)
    return serve


def stop(serve, timeout: float = 30.0) -> None:
    """Stops a server that ``start`` runs: the engine, the models, then the HTTP server, without
    waiting for clients that keep their connections open (uvicorn's forced exit)."""
    serve.server.force_exit = True
    serve.kill_server()
    serve._thread.join(timeout)
