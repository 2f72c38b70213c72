"""Small literal helpers shared by the formula tests (written for clarity, not speed)."""
import torch


def literal_pool(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """Stride-1, same-length pooling along the last axis: the max of the neighbours that exist,
    or their sum divided by the kernel (zero padding, PyTorch's avg_pool1d as SnapKV uses it)."""
    r, m = kernel // 2, x.shape[-1]
    out = torch.empty_like(x)
    for j in range(m):
        near = x[..., max(0, j - r):min(m, j + r + 1)]
        out[..., j] = near.amax(dim=-1) if kind == "max" else near.sum(dim=-1) / kernel
    return out


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
