"""The scorer interface: how a policy rates cached tokens (higher = keep)."""
from __future__ import annotations

import torch

from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.views import CacheView, PromptView

GQA_MODES = ("mean", "max")


class Scorer:
    """Base class of the scorers. A scorer is a small dataclass of its paper's parameters.

    - ``capabilities``: what it needs of the engine and what it offers, one frozen value
      (``policies.capabilities.Capabilities``): its per-token channels and the statistics
      accumulated into them, the statistics and view parts its scores read, and whether the
      store can score a token by its rule (``slot_rule``). The engine reads nothing else of a
      scorer's needs.
    - ``prompt_scores``: scores of a fresh prompt's tokens from the dense prompt (one-shot
      prefill), and the initial values of the scorer's per-token channels.
    - ``update_view`` (``capabilities.updates_from_view``): the new channels from a padded view,
      after every attention over the cache while the schedule will evict again.
    - ``cache_scores``: scores of the cached tokens at an eviction step.

    State between calls: the per-token channels (``capabilities.channels`` of them, kept by the
    storage beside each token: ``view.channels``), and two dicts that the cache owns and
    empties when it is reset: ``view.layer_state``, this layer's (AhaKV's prompt length), and
    ``view.cache_state``, one that every layer of the cache shares, for state carried from
    layer to layer (K-VEC's coverage counts). Keys are the scorer's to choose (prefixed by its
    name: a wrapper and its base see the same dicts). Nothing else of a view outlives the call.

    A scorer whose prompt scores come from running the whole model again over the prompt
    rather than from one layer's attention subclasses ``ReconstructionScorer``.
    """

    capabilities: Capabilities = Capabilities()

    def default_protection(self) -> Protection:
        return Protection()

    def check(self, schedule) -> None:
        """Raises ValueError for a schedule this scorer cannot serve."""

    def check_policy(self, policy) -> None:
        """Raises ValueError for a policy (allocation, protection, schedule) this scorer cannot
        serve; ``Policy`` calls it. By default only the schedule is checked."""
        self.check(policy.schedule)

    def observing(self, extra: int) -> "Scorer | None":
        """This scorer with an observation window ``extra`` queries longer (a deferred
        compression, ``Schedule(lookahead=...)``, widens it over the queries since the prompt);
        None: it scores from no window of newest queries (the default)."""
        return None

    def check_model(self, model) -> None:
        """Raises ValueError for a model this scorer cannot serve; ``patch`` calls it with the
        model's ``ModelShape`` (layers, query and KV heads, head dim, ``groups`` = G, and
        whether one rotary embedding turns every layer's whole head: ``one_rope``)."""

    def prompt_scores(self, p: PromptView) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def update_view(self, view: CacheView) -> torch.Tensor:
        """With ``capabilities.updates_from_view``: the new channels [B, H, L, C] of the cached
        tokens, from a padded view (for state the kernel's statistics cannot give)."""
        raise NotImplementedError

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        raise NotImplementedError

    # --- per-query-head scores: what CAOTE's per-head readings (gqa="group_l2", ...) wrap ------
    # A scorer that rates tokens per query head before it combines the G heads of a KV head
    # exposes those scores here; CAOTE wraps any scorer through these methods alone.
    def with_query_head_state(self, max_groups: int) -> "Scorer":
        """The scorer to run when per-query-head scores will be asked for (a scorer whose
        per-head scores need state of their own returns a copy that keeps it, in at most
        ``max_groups`` more channels); by default itself."""
        return self

    def prompt_head_scores(self, p: PromptView) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(scores [B, H, G, n] per query head, channels)`` of a fresh prompt, the channels
        being what ``prompt_scores`` would return (it is not called as well), or None when the
        scorer has no per-head reading."""
        return None

    def cache_head_scores(self, view: CacheView) -> torch.Tensor | None:
        """[B, H, G, L] scores of the cached tokens per query head, or None."""
        return None


class ReconstructionScorer(Scorer):
    """A query-agnostic scorer that rates a prompt's tokens by how much the model attends to
    them while it reconstructs the prompt (KVzip's context reconstruction), over several
    forward passes of the whole model; it has no per-layer ``prompt_scores``.

    The engine keeps each layer's dense prompt aside after a one-shot prefill
    (``kvcache_ext.engine.reconstruction``), marks the tokens to rebuild (``rebuilt``), feeds
    the inputs of ``passes`` through the model (``kvcache_ext.hf.reconstruction``), and folds
    each pass's attention probabilities over the prompt into one score per KV head and token
    with ``pass_scores`` (the largest so far is kept); then every layer keeps its budget by
    those scores. What it asks of the scorer:

    - ``softmax``: the keys a pass's scoring softmax runs over: ``"context"``, every key the
      query sees (the model's own probabilities); ``"chunk"``, the first ``sinks`` tokens, the
      pass's rebuilt window of the prompt and the pass's own tokens;
    - ``sinks``: the first positions, rated (and, under ``"chunk"``, scored against) always;
    - ``needs_tokenizer``: whether ``passes`` and ``rebuilt`` need text tokenized (``patch``
      then requires the model's tokenizer);
    - ``rebuilt`` and ``passes``: which tokens the passes rebuild and rate, and the passes'
      inputs; ``tokens(text) -> list[int]`` tokenizes (``"chat"`` / ``"chat_prefix"``: the parts
      of the tokenizer's chat template after and before a user's text);
    - ``pass_scores``: the probabilities of a pass's queries per query head -> scores per KV head.

    Such a scorer needs the one-shot schedule (its scores come once, after the prompt).
    """

    capabilities = Capabilities(reconstructs=True)
    softmax: str = "context"                 # "context" or "chunk" (above)
    sinks: int = 0                           # the first positions, always rated

    @property
    def needs_tokenizer(self) -> bool:
        return False

    def check(self, schedule) -> None:
        if schedule.prefill_block is not None or schedule.evicts_over_cache:
            raise ValueError(f"{type(self).__name__} scores a prefilled context by reconstructing it, once: "
                             f"it needs the one-shot schedule (OneShot()), got {schedule}")

    def rebuilt(self, ids: torch.Tensor, valid: torch.Tensor, tokens) -> torch.Tensor:
        """[B, n] bool: the tokens of the prompt ``ids`` [B, n] (``valid``: False on padding)
        that the passes rebuild and the scores rate; by default every valid one."""
        return valid

    def passes(self, ids: torch.Tensor, rebuilt: torch.Tensor, tokens, start: int = 0) -> list:
        """The passes over a prompt ``ids`` [B, n] whose tokens ``rebuilt`` are to be rebuilt,
        from column ``start`` on (the first rebuilt column): a list of ``(inputs [B, r], real
        [B, r], lo, hi)``, each pass's token ids (left-padded: ``real`` False on padding) and
        the window ``lo .. hi`` of prompt columns it rebuilds."""
        raise NotImplementedError

    def pass_scores(self, probs: torch.Tensor, groups: int) -> torch.Tensor:
        """[B, Hq, c, n] probabilities of c pass queries over n prompt keys -> [B, H, n] (H =
        Hq / ``groups``): what the pass says of each token, per KV head."""
        raise NotImplementedError

    @property
    def reconstruction(self) -> "ReconstructionScorer":
        """The scorer whose passes give the raw scores (itself; a wrapper: its base's): two
        scorers with the same one give the same raw scores, so a harness that reuses them keys
        them by it."""
        return self

    def held_scores(self, scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, last_pos: torch.Tensor,
                    model, token_ids) -> torch.Tensor:
        """The scores [B, H, n] a layer keeps its budget by, from its passes' raw scores [B, H,
        n] (``pos`` [B, n] positions, ``valid`` [B, n] False on padding, ``last_pos``
        [B], ``model``: the ``ModelParts``, ``token_ids``: the cache's ``TokenIds``); by
        default the raw scores (``Spanned`` shares them by span)."""
        return scores

    def budget_scores(self, scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, last_pos: torch.Tensor,
                      model, token_ids) -> torch.Tensor | None:
        """The scores [B, H, n] that split the budget over layers and heads, from the same raw
        scores and arguments as ``held_scores``; None (the default): the held scores themselves.
        (``Spanned(budgets="tokens")`` splits by the tokens' own scores and keeps by its spans'.)"""
        return None

    def prompt_scores(self, p: PromptView):
        raise RuntimeError(f"{type(self).__name__} scores come from reconstruction passes of the whole model; "
                           "the patched model runs them (kvcache_ext.hf.reconstruction)")

    def cache_scores(self, view: CacheView) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} evicts once, after the prompt (one-shot schedule only)")


def group_reduce(x: torch.Tensor, groups: int, mode: str = "mean") -> torch.Tensor:
    """[B, Hq, ...] per query head -> [B, H, ...] per KV head (query head h*G + g reads h)."""
    x = x.unflatten(1, (x.shape[1] // groups, groups))
    if mode == "mean":
        return x.mean(dim=2)
    if mode == "max":
        return x.amax(dim=2)
    if mode == "sum":
        return x.sum(dim=2)
    raise ValueError(f"unknown GQA aggregation {mode!r}; choose from {GQA_MODES}")
