"""Small literal helpers shared by the formula tests (written for clarity, not speed)."""
import torch


def literal_pool(x: torch.Tensor, kernel: int, kind: str, live=None) -> torch.Tensor:
    """Stride-1, same-length pooling along the last axis over the tokens that take part
    (``live``, a list of bools, default all): a live token gets the max, or the mean, of the
    live tokens within kernel // 2 places of it that exist; a token that does not take part
    keeps its own value."""
    r, m = kernel // 2, x.shape[-1]
    live = [True] * m if live is None else [bool(t) for t in live]
    out = x.clone()
    for j in range(m):
        if not live[j]:
            continue
        near = [i for i in range(max(0, j - r), min(m, j + r + 1)) if live[i]]
        vals = torch.stack([x[..., i] for i in near], dim=-1)
        out[..., j] = vals.amax(dim=-1) if kind == "max" else vals.sum(dim=-1) / len(near)
    return out


def outside_window(positions, window: int) -> list:
    """For a row's real tokens' positions (a list, any order), whether each is outside the
    ``window`` newest positions (the tokens that pooling reads)."""
    last = max(positions) if len(positions) else 0
    return [p <= last - window for p in positions]


def held_layout(hold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hold [B, H, span] bool (which positions each head holds) -> the padded cache layout
    (pos [B, H, L] in order, mask [B, H, L]) that CacheView uses."""
    B, H, _ = hold.shape
    lens = hold.sum(dim=-1)
    L = int(lens.max())
    pos = torch.zeros(B, H, L, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            pos[b, h, :lens[b, h]] = torch.nonzero(hold[b, h]).flatten()
    return pos, torch.arange(L) < lens[..., None]
