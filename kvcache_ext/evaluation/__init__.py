"""The evaluation harness behind ``kvcache-ext eval``: retrieval (passkey, needle), perplexity
under block-wise eviction, and fidelity of the next-token distributions against the full cache;
and ``kvcache-ext check``'s kernels against the reference on one device (``device_check``)."""
from kvcache_ext.evaluation.named_policies import make_policy, policy_names, register_policy, unregister_policy
from kvcache_ext.evaluation.shared_prefill import (
    RecordedPrefill,
    compressed_cache,
    record_prefill,
)

__all__ = ["RecordedPrefill", "compressed_cache", "make_policy", "policy_names", "record_prefill",
           "register_policy", "unregister_policy"]
