"""Reference attention over a padded cache, with the per-slot statistics, in float64."""
from __future__ import annotations

import torch


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     mask: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None):
    """Dense masked attention: q [B, Hq, n, D]; k, v [B, H, L, D]; pos, mask [B, H, L].

    Returns ``(out [B, Hq, n, D] in q's dtype, stats)`` with stats a dict of padded tensors:
    Computed in float64; the statistics are returned as float32:
    mass [B, H, L], last [B, H, L, G], sum_sq [B, H, L] (f32) and count [B, H, L] (int32),
    defined as in ``kvcache_ext.AttentionStats``; zero where mask is False.
    """
    B, Hq, n, D = q.shape
    H, L = k.shape[1], k.shape[2]
    G = Hq // H
    # Query head h*G + g reads KV head h (HF's repeat_kv).
    k_rep = k.double().repeat_interleave(G, dim=1)
    v_rep = v.double().repeat_interleave(G, dim=1)
    logits = torch.einsum("bqid,bqld->bqil", q.double(), k_rep) * scale  # [B, Hq, n, L]
    visible = mask[:, :, None, :].expand(B, H, n, L)
    if q_pos is not None:
        q_pos = torch.as_tensor(q_pos).to(pos.device).expand(B, n)
        visible = visible & (pos[:, :, None, :].long() <= q_pos[:, None, :, None].long())
    visible_rep = visible.repeat_interleave(G, dim=1)
    logits = logits.masked_fill(~visible_rep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.where(visible_rep, probs, torch.zeros_like(probs))  # rows that see nothing: 0
    out = torch.einsum("bqil,bqld->bqid", probs, v_rep).to(q.dtype)

    grouped = probs.view(B, H, G, n, L)
    stats = {
        "mass": grouped.sum(dim=(2, 3)).float(),
        "last": grouped[:, :, :, n - 1, :].permute(0, 1, 3, 2).float().contiguous() if n else
        grouped.new_zeros(B, H, L, G, dtype=torch.float32),
        "sum_sq": grouped.mean(dim=2).square().sum(dim=2).float(),
        "count": visible.sum(dim=2).to(torch.int32),
    }
    return out, stats
