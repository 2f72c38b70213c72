"""Reference selection: a full sort by (NaN last, score descending, position, slot order)."""
from __future__ import annotations

import math

import torch


def keep_order(scores: list[float], pos: list[int]) -> list[int]:
    """Indices of the candidates, best first: higher score, NaN below everything, then lower
    position, then the earlier candidate (-0.0 and +0.0 are equal)."""
    return sorted(range(len(scores)),
                  key=lambda i: (math.isnan(scores[i]),
                                 0.0 if math.isnan(scores[i]) else -scores[i], pos[i], i))


def segmented_topk(scores: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, k) -> torch.Tensor:
    """scores, pos [S, L] padded; lens [S]; k int or [S]. Returns keep [S, L] bool."""
    S, L = scores.shape
    k = torch.as_tensor(k).expand(S)
    keep = torch.zeros(S, L, dtype=torch.bool)
    for s in range(S):
        n = int(lens[s])
        order = keep_order(scores[s, :n].tolist(), pos[s, :n].tolist())
        keep[s, order[: int(k[s])]] = True
    return keep


def grouped_topk(scores: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, group_size: int,
                 k) -> tuple[torch.Tensor, torch.Tensor]:
    """As segmented_topk, but the k[g] best over the group_size consecutive segments of group g.
    Returns (keep [S, L], counts [S])."""
    S, L = scores.shape
    groups = S // group_size
    k = torch.as_tensor(k).expand(groups)
    keep = torch.zeros(S, L, dtype=torch.bool)
    for g in range(groups):
        cands = [(s, j) for s in range(g * group_size, (g + 1) * group_size) for j in range(int(lens[s]))]
        order = keep_order([float(scores[c]) for c in cands], [int(pos[c]) for c in cands])
        for i in order[: int(k[g])]:
            keep[cands[i]] = True
    return keep, keep.sum(1).to(torch.int32)
