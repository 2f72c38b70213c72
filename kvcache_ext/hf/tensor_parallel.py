"""A model under transformers' tensor parallelism: which ranks its heads are split over, and
the shape each rank's attention calls see.

``from_pretrained(..., tp_plan="auto")`` under torchrun shards each attention's projections
over the ranks of the model's ``tp`` mesh: with the plan's ``"colwise"`` style on the key
projection (Llama's, Qwen's, Mistral's, Gemma's plans), a rank computes and attends with its
own contiguous slice of the heads, and the config still names every head. The shape a cache
is checked against is therefore read from the sharded key projection, not from the config.
A plan that gathers the projection's output (Phi-3's fused ``qkv_proj``,
``"colwise_gather_output"``) leaves every head on every rank: each rank then runs the whole
cache, as one process would.
"""
from __future__ import annotations

import fnmatch

from kvcache_ext.policies.policy import ModelShape
from kvcache_ext.policies.ranks import Ranks

# The plan's style for a projection whose weight rows are sharded and whose output stays
# sharded (transformers' ColwiseParallel with its default layouts): each rank its own heads.
SPLITS_HEADS = ("colwise",)
KEY_PROJECTIONS = ("k_proj", "qkv_proj")


def _key_projection(model):
    """(name, module) of the first attention's key projection, or None."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in KEY_PROJECTIONS and hasattr(module, "weight"):
            return name, module
    return None


def _style(model, name: str) -> str | None:
    """The tensor-parallel plan's style for the module ``name`` (None: the plan names none)."""
    plan = getattr(model, "tp_plan", None) or {}
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return style
    return None


def ranks_of(model) -> Ranks | None:
    """The ranks a tensor-parallel model's heads are split over (None: every rank, or the one
    process, sees every head). Read from the key projection's sharded weight (a DTensor on the
    model's ``tp`` mesh)."""
    if (getattr(model, "tp_size", None) or 1) <= 1:
        return None
    found = _key_projection(model)
    if found is None or _style(model, found[0]) not in SPLITS_HEADS:
        return None
    weight = found[1].weight
    # transformers 5.24 shards the weight as a DTensor on the mesh; 5.2 keeps a plain local
    # shard and the mesh on the model.
    mesh = getattr(weight, "device_mesh", None) or getattr(model, "_device_mesh", None)
    if mesh is None:   # the plan was not applied
        return None
    return Ranks(group=mesh.get_group(), rank=mesh.get_local_rank(), size=mesh.size())


def model_shape(model) -> ModelShape:
    """The shape of ``model`` as each process's attention calls see it: the config's, or under
    tensor parallelism each rank's share of the heads (checked against the sharded weight)."""
    shape = ModelShape.of(model)
    ranks = ranks_of(model)
    if ranks is None:
        return shape
    for what, count in (("num_key_value_heads", shape.kv_heads), ("num_attention_heads", shape.heads)):
        if count % ranks.size:
            raise ValueError(f"kvcache_ext.patch: tp_size {ranks.size} does not divide the model's {what} "
                             f"({count}); tensor parallelism with kvcache_ext needs every rank to hold whole "
                             f"heads: a tp_size that divides {shape.kv_heads} (KV heads) and {shape.heads}")
    local = shape.per_rank(ranks.size)
    name, module = _key_projection(model)
    weight = module.weight
    rows = (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]
    if name.endswith("k_proj") and rows != local.kv_heads * local.head_dim:
        raise ValueError(f"kvcache_ext.patch: {name} holds {rows} output rows on rank {ranks.rank}, not "
                         f"{local.kv_heads} KV heads of {local.head_dim} ({shape.kv_heads} heads over "
                         f"tp_size {ranks.size}): a sharding kvcache_ext does not know")
    return local


def tp_plan_auto() -> dict:
    """``from_pretrained``'s keyword arguments for the model's own tensor-parallel plan:
    ``distributed_config=DistributedConfig(tp_plan="auto")`` where transformers has it (5.3 on,
    where ``tp_plan=`` is deprecated), ``tp_plan="auto"`` before (5.2)."""
    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}
