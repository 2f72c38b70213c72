"""A policy = scorer + allocation + schedule + protection, with a budget."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache_ext.checks import INT32_MAX, Instance, Int, Optional, Real, check_fields, revalidate
from kvcache_ext.policies.allocation import Allocation
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.schedule import Schedule
from kvcache_ext.policies.scorer import Scorer
from kvcache_ext.policies.uniform import Uniform


@dataclass(frozen=True)
class ModelShape:
    """The layout of a model that a policy and a cache are checked against: what one process's
    attention calls see. Under tensor parallelism (``ranks`` > 1) the heads are each rank's
    own (``per_rank``), not the config's."""

    num_layers: int
    heads: int          # query heads per layer (of this rank)
    kv_heads: int       # KV heads per layer (of this rank)
    head_dim: int
    ranks: int = 1      # tensor-parallel ranks the model's heads are split over
    # One rotary embedding (the model's ``rotary_emb``) turns the whole of every layer's head:
    # False for a RoPE per layer type (Gemma 3) or a partial rotary factor.
    one_rope: bool = True

    @property
    def groups(self) -> int:
        """G: query heads per KV head."""
        return self.heads // self.kv_heads

    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of an HF model, from its (text) config."""
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        one_rope = config.model_type != "gemma3_text" and partial == 1.0
        return cls(config.num_hidden_layers, heads, kv_heads, head_dim, one_rope=one_rope)

    def per_rank(self, ranks: int) -> "ModelShape":
        """The shape each of ``ranks`` tensor-parallel ranks sees, when the model's heads are
        split evenly over them (``hf.tensor_parallel`` checks that they are)."""
        return ModelShape(self.num_layers, self.heads // ranks, self.kv_heads // ranks, self.head_dim, ranks,
                          self.one_rope)


@dataclass
class Policy:
    """How a patched model evicts.

    ``budget``: tokens kept per KV head (the average over heads and layers when the allocation
    is adaptive or pyramidal), or ``ratio``: that budget as a fraction of each prompt's length
    (rounded up). Exactly one of the two. ``protection`` defaults to the scorer's own
    (StreamingLLM's sinks, SnapKV's window, H2O's recent window).
    """

    scorer: Scorer
    budget: int | None = None
    ratio: float | None = None
    allocation: Allocation = field(default_factory=Uniform)
    schedule: Schedule = field(default_factory=Schedule)
    protection: Protection | None = None

    def __post_init__(self):
        check_fields(self, "Policy", scorer=Instance(Scorer, "a kvcache_ext.policies scorer"),
                     budget=Optional(Int(1, what="a positive integer up to 2^31 - 1 (tokens per KV head)")),
                     ratio=Optional(Real(0.0, 1.0, low_open=True, what="a number in (0, 1] (of the prompt)")),
                     allocation=Instance(Allocation, "a kvcache_ext.policies allocation (Uniform(), "
                                         "Pyramid(), AdaKV())"),
                     schedule=Instance(Schedule, "a kvcache_ext.policies.Schedule (OneShot(), "
                                       "BlockwisePrefill(), EveryStep(), EveryNSteps())"),
                     protection=Optional(Instance(Protection, "a kvcache_ext.policies.Protection")))
        if (self.budget is None) == (self.ratio is None):
            raise ValueError("Policy: give exactly one of budget= (tokens per KV head) or ratio= (of the "
                             f"prompt); got budget={self.budget!r}, ratio={self.ratio!r}")
        if self.protection is None:
            self.protection = self.scorer.default_protection()
        if self.budget is not None and self.budget <= self.protection.size:
            raise ValueError(f"Policy budget {self.budget} leaves no room beyond the {self.protection.size} "
                             f"protected tokens ({self.protection}); raise the budget")
        target = self.schedule.decode_target
        if target is not None and target <= self.protection.size:
            raise ValueError(f"Policy schedule's decode_target {target} must exceed the "
                             f"{self.protection.size} protected tokens ({self.protection})")
        if self.protection.size >= INT32_MAX:
            raise ValueError(f"Policy protection {self.protection} protects 2^31 - 1 tokens or more")
        self.scorer.check_policy(self)
        lookahead = self.schedule.lookahead
        if lookahead and self.scorer.observing(lookahead) is None:
            raise ValueError(f"Policy schedule lookahead={lookahead} widens the scorer's observation window over "
                             f"the decoded tokens' queries; {type(self.scorer).__name__} scores from no such "
                             "window. Use SnapKV (or a wrapper of it, such as Spanned(SnapKV())), or lookahead=0")
        if self.allocation.whole_model and not self.scorer.capabilities.reconstructs:
            raise ValueError(f"{self.allocation} splits the budget by every layer's scores at once, which "
                             f"only a scorer that reconstructs the prompt (KVzip) has; {type(self.scorer).__name__} "
                             "scores one layer at a time")

    def check(self, model: "ModelShape | None" = None) -> "Policy":
        """Checks the policy again (its parts may have been changed since it was built), and
        against ``model`` when given: what ``patch`` calls. Returns the policy."""
        for part in (self.scorer, self.allocation, self.schedule, self.protection):
            revalidate(part)
        self.__post_init__()
        if model is not None:
            self.scorer.check_model(model)
            self.allocation.check_model(model)
        return self

    def budget_for(self, prompt_len: torch.Tensor) -> torch.Tensor:
        """[B] tokens per KV head for prompts of prompt_len [B] tokens."""
        if self.budget is not None:
            return torch.full_like(prompt_len, int(self.budget))
        return torch.ceil(prompt_len.double() * self.ratio).long().clamp_min(self.protection.size + 1)

    def __repr__(self) -> str:
        size = f"budget={self.budget}" if self.budget is not None else f"ratio={self.ratio}"
        return (f"Policy({self.scorer}, {size}, allocation={self.allocation}, "
                f"schedule={self.schedule}, protection={self.protection})")
