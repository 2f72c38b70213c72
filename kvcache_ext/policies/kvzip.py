"""KVzip (Kim et al., 2025, arXiv 2505.23416): query-agnostic scores from context reconstruction.

After the prompt (the context) is prefilled, the model is asked to repeat it: the context is
fed again, a chunk at a time, after a short instruction ("Repeat the previous context
exactly."), over the cache that holds the whole context. A cached token's score is the
largest attention probability that any reconstruction query of any query head of its group
pays it. Tokens the model needs to rebuild its context are the ones a later, unknown question
is likely to need too, so the scores do not depend on the question.

The passes run the model, so this scorer has no per-layer ``prompt_scores``: it is a
``ReconstructionScorer``; the patched model defers the compression of a fresh prompt,
``kvcache_ext.hf.reconstruction`` runs the passes (``patch(..., tokenizer=...)`` tokenizes
the instructions) and then every layer keeps its budget by these scores. Compression is
therefore one-shot only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.scorer import ReconstructionScorer

SOFTMAX_KEYS = ("chunk", "context")
PromptText = str | tuple[int, ...]


def _check_text(name: str, value) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, tuple) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return
    raise ValueError(f"KVzip {name} must be a string or a tuple of token ids (ints >= 0), got {value!r}")


@dataclass
class KVzip(ReconstructionScorer):
    """Parameters (defaults: the KVzip paper's code as kvpress 0.5.5 runs it, unless noted):

    - ``chunk``: context tokens reconstructed per pass (1024; KVzip's code and kvpress use 2048).
      A pass holds one chunk's activations besides the cache, so this bounds the extra memory;
      a smaller chunk also makes the passes cheaper (each pass's own causal attention and its
      scores' product grow with the chunk). On the default model 1024 answers as often as
      2048 and costs less (docs/results.md, "KVzip's defaults, measured", has the figures).
    - ``prompt`` / ``continue_prompt``: the instruction before the first chunk and before the
      later ones, text (tokenized with the tokenizer given to ``patch``) or token ids.
    - ``overlap``: the last tokens of the previous chunk, fed after ``continue_prompt`` so that
      the model knows where to go on (8).
    - ``suffix``: what follows the instruction and opens the model's answer: ``"chat"`` takes
      it from the tokenizer's chat template (the end of a user turn and the start of an
      assistant turn; a newline without a template), or text / token ids.
    - ``softmax``: which keys the scoring softmax runs over. ``"chunk"``: the first ``sinks``
      tokens, the chunk being rebuilt and the reconstruction tokens, as KVzip's code computes it
      (the model's own attention still sees the whole cache); ``"context"``: the probabilities
      the model itself computes over the whole context. The paper states neither in words;
      docs/results.md measures both.
    - ``gqa``: how the G query heads of a KV head combine ("max", KVzip's; or "mean").
    - ``sinks``: the first tokens, kept always (KVzip's 4).
    - ``skip_prefix``: tokens a context may open with that the passes do not rebuild and the
      scores leave out (kept only where they are sinks), kvpress's reading of the chat
      template's prefix: ``"chat"`` (the default: the template's text before a user's message,
      nothing without a template) or text / token ids; ``None``: the whole context is rebuilt
      and scored. A row that does not open with them is rebuilt whole. docs/results.md
      measures both readings ("chat" answers more at small keep fractions).
    """

    chunk: int = 1024
    prompt: PromptText = "\n\nRepeat the previous context exactly."
    continue_prompt: PromptText = "\n\nRepeat the part of the previous context exactly, starting with"
    overlap: int = 8
    suffix: PromptText = "chat"
    softmax: str = "chunk"
    gqa: str = "max"
    sinks: int = 4
    skip_prefix: PromptText | None = "chat"

    def __post_init__(self):
        for name in ("chunk", "overlap", "sinks"):
            value = getattr(self, name)
            low = 1 if name == "chunk" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"KVzip {name} must be an integer >= {low}, got {value!r}")
        for name in ("prompt", "continue_prompt", "suffix"):
            _check_text(name, getattr(self, name))
        if self.skip_prefix is not None:
            _check_text("skip_prefix", self.skip_prefix)
        if self.softmax not in SOFTMAX_KEYS:
            raise ValueError(f"KVzip softmax must be one of {SOFTMAX_KEYS}, got {self.softmax!r}")
        if self.gqa not in ("max", "mean"):
            raise ValueError(f"KVzip gqa must be 'max' or 'mean', got {self.gqa!r}")

    @property
    def needs_tokenizer(self) -> bool:
        return any(isinstance(t, str) for t in (self.prompt, self.continue_prompt, self.suffix, self.skip_prefix))

    def default_protection(self) -> Protection:
        return Protection(sinks=self.sinks)

    # --- the reconstruction passes (ReconstructionScorer) ------------------------------------
    def rebuilt(self, ids: torch.Tensor, valid: torch.Tensor, tokens) -> torch.Tensor:
        """[B, n] bool: the context tokens the passes rebuild and the scores rate: ``valid``,
        less the ``skip_prefix`` tokens of each row whose real tokens open with them."""
        if self.skip_prefix is None:
            return valid
        prefix = self._ids("chat_prefix" if self.skip_prefix == "chat" else self.skip_prefix, tokens)
        out = valid.clone()
        for b in range(ids.shape[0]):
            columns = valid[b].nonzero().flatten()
            if 0 < len(prefix) < len(columns) and ids[b, columns[:len(prefix)]].tolist() == prefix:
                out[b, columns[:len(prefix)]] = False
        return out

    def passes(self, ids: torch.Tensor, valid: torch.Tensor, tokens, start: int = 0) -> list:
        """The reconstruction inputs of a context ``ids`` [B, n] (``valid``: the tokens to
        rebuild, False on padding and a skipped prefix): a list of ``(inputs [B, r], real [B, r],
        lo, hi)``, one per chunk of context indices ``lo .. hi`` from column ``start`` on (after
        a skipped prefix, as kvpress chunks), each row's instruction, suffix and chunk tokens,
        left-padded. ``tokens(text) -> list[int]`` tokenizes; ``tokens("chat")`` gives the chat
        suffix."""
        n = ids.shape[1]
        prompt, again, suffix = (self._ids(x, tokens) for x in (self.prompt, self.continue_prompt, self.suffix))
        out = []
        for lo in range(start, n, self.chunk):
            hi = min(lo + self.chunk, n)
            rows = []
            for b in range(ids.shape[0]):
                chunk = ids[b, lo:hi][valid[b, lo:hi]].tolist()
                before = ids[b, :lo][valid[b, :lo]].tolist()
                head = prompt if not before else again + (before[-self.overlap:] if self.overlap else [])
                rows.append(head + suffix + chunk)
            r = max(len(x) for x in rows)
            inputs = torch.zeros(len(rows), r, dtype=ids.dtype)
            real = torch.zeros(len(rows), r, dtype=torch.bool)
            for b, row in enumerate(rows):
                inputs[b, r - len(row):] = torch.tensor(row, dtype=ids.dtype)
                real[b, r - len(row):] = True
            out.append((inputs.to(ids.device), real.to(ids.device), lo, hi))
        return out

    @staticmethod
    def _ids(value: PromptText, tokens) -> list[int]:
        return list(value) if isinstance(value, tuple) else tokens(value)

    def pass_scores(self, probs: torch.Tensor, groups: int) -> torch.Tensor:
        """[B, Hq, c, n] probabilities of c reconstruction queries over the context ->
        [B, H, n]: the largest (or mean over heads of the largest) over queries and heads."""
        B, Hq, c, n = probs.shape
        per_head = probs.amax(dim=2).view(B, Hq // groups, groups, n)
        return per_head.amax(dim=2) if self.gqa == "max" else per_head.mean(dim=2)
