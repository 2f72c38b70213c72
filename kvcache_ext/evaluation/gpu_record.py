"""Which CUDA paths last ran on a GPU, and which were written since without one: what
``kvcache-ext check`` prints, and what docs/gpu.md ("The current GPU result", "The next GPU run")
says (tests/test_check.py holds them equal). Update both after a GPU run."""
from __future__ import annotations

# The GPU of the last run, as torch names it, and the commit it ran.
LAST_GPU = "NVIDIA H100 80GB HBM3"
LAST_GPU_COMMIT = "51104c0"

# The CUDA paths written since that run and not run on a GPU yet: the labels of the bullets of
# docs/gpu.md "The next GPU run", in its order (each bullet says what must be checked).
NOT_RUN_ON_A_GPU = (
    "Decode steps in a CUDA graph",
    "The decode step as one op",
    "The tensor-core decode",
    "int8 pages",
    "Shared prefixes and serving",
    "Layers on two devices",
    "The tensor-core prefill on shared code",
)


def describe() -> list[str]:
    """The record as lines of text."""
    return [f"The CUDA paths last ran on a GPU at commit {LAST_GPU_COMMIT}, on an {LAST_GPU} (docs/gpu.md, "
            "\"The current GPU result\").",
            "Written since and not run on a GPU yet (docs/gpu.md, \"The next GPU run\"): "
            + "; ".join(label[0].lower() + label[1:] for label in NOT_RUN_ON_A_GPU) + "."]
