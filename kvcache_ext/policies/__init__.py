"""Eviction policies: a scorer, an allocation, a schedule and a protection, with a budget.

Any scorer combines with any allocation::

    from kvcache_ext.policies import Policy, SnapKV, AdaKV, Pyramid, EveryStep, H2O
    Policy(SnapKV(), budget=256)                                   # SnapKV
    Policy(SnapKV(), budget=256, allocation=AdaKV())               # Ada-SnapKV
    Policy(SnapKV(), budget=256, allocation=AdaKV(layers=Pyramid()))  # Ada-Pyramid
    Policy(H2O(), budget=256, schedule=EveryStep())                # H2O held at its budget
"""
from kvcache_ext.policies.across_layers import AcrossLayers
from kvcache_ext.policies.adakv import AdaKV
from kvcache_ext.policies.ahakv import AhaKV
from kvcache_ext.policies.allocation import Allocation
from kvcache_ext.policies.capabilities import Capabilities
from kvcache_ext.policies.caote import CAOTE, FastCAOTE, caote_policy
from kvcache_ext.policies.expected_attention import ExpectedAttention
from kvcache_ext.policies.h2o import H2O
from kvcache_ext.policies.kvec import KVEC
from kvcache_ext.policies.kvzip import KVzip
from kvcache_ext.policies.policy import ModelShape, Policy
from kvcache_ext.policies.pooled import Pooled
from kvcache_ext.policies.pooling import Pooling
from kvcache_ext.policies.protection import Protection
from kvcache_ext.policies.pyramid import Pyramid
from kvcache_ext.policies.random_eviction import Random
from kvcache_ext.policies.roco import RoCo
from kvcache_ext.policies.schedule import BlockwisePrefill, EveryNSteps, EveryStep, Lookahead, OneShot, Schedule
from kvcache_ext.policies.scissorhands import ScissorHands
from kvcache_ext.policies.scorer import ReconstructionScorer, Scorer
from kvcache_ext.policies.snapkv import SnapKV
from kvcache_ext.policies.spanned import Spanned
from kvcache_ext.policies.spans import Spans
from kvcache_ext.policies.streaming_llm import StreamingLLM
from kvcache_ext.policies.tova import TOVA
from kvcache_ext.policies.uniform import Uniform
from kvcache_ext.policies.views import CacheView, ModelParts, PromptView

__all__ = ["Policy", "ModelShape", "Scorer", "Capabilities", "ReconstructionScorer", "Allocation", "Schedule",
           "Protection",
           "StreamingLLM", "H2O", "TOVA", "SnapKV", "Random", "RoCo", "ScissorHands",
           "AhaKV", "KVEC", "KVzip", "ExpectedAttention", "CAOTE", "FastCAOTE", "caote_policy",
           "Pooling", "Pooled", "Spans", "Spanned", "Uniform", "Pyramid", "AdaKV", "AcrossLayers",
           "OneShot", "BlockwisePrefill", "EveryStep", "EveryNSteps", "Lookahead",
           "PromptView", "CacheView", "ModelParts"]
