"""The tensor-parallel ranks that a model's KV heads are split over, and the two collectives
the engine runs over them.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under
torchrun) each rank holds a contiguous slice of every layer's heads: rank r the KV heads
``r * H .. (r + 1) * H - 1`` of H per rank, and the attention function sees only those. A
rank's cache holds its own heads; what crosses ranks is only what an allocation over a row's
heads (Ada-KV exact) or over every layer (KVzip's global top-k) needs: the scores.
``hf.tensor_parallel`` finds the ranks of a model; ``ModelParts.ranks`` carries them to the
engine (``engine.across_ranks``) and to the scorers whose score of a head reads every head of
the layer (TOVA's mean over heads: ``Capabilities.reads_every_head``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Ranks:
    """``group``: the process group of the model's tensor-parallel mesh; ``rank``: this
    process's place in it (which slice of the heads it holds); ``size``: the ranks."""

    group: object
    rank: int
    size: int

    def gather_heads(self, x: torch.Tensor, fill) -> torch.Tensor:
        """Every rank's ``x`` [B, H, L, ...] side by side on dim 1 (rank 0's heads first: the
        model's head order), each padded on dim 2 to the longest L with ``fill``. Every rank
        must call it (a collective), with the same B and H."""
        import torch.distributed as dist
        length = torch.tensor([x.shape[2]], dtype=torch.long, device=x.device)   # NCCL: on the device
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=self.group)
        longest = int(length)
        if x.shape[2] < longest:
            pad = x.new_full((x.shape[0], x.shape[1], longest - x.shape[2], *x.shape[3:]), fill)
            x = torch.cat([x, pad], dim=2)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=1)

    def own_heads(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tensor over every rank's heads (dim 1)."""
        per = x.shape[1] // self.size
        return x[:, self.rank * per:(self.rank + 1) * per]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (the same shape on every rank; a collective)."""
        import torch.distributed as dist
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def max(self, n: int, device) -> int:
        """The largest ``n`` over ranks (a collective)."""
        import torch.distributed as dist
        t = torch.tensor([int(n)], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def any(self, flag: bool, device) -> bool:
        """Whether ``flag`` holds on some rank (a collective: every rank must call it; ``device``:
        where the group's backend takes tensors, the model's)."""
        import torch.distributed as dist
        t = torch.tensor([int(bool(flag))], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t)
