"""A tiny real megatron-core GPT (local spec, MoE) and a capture wired to a CPU torch ring."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.dmi.capture import Capture
from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.transport.torch_ring import TorchRingTransport

SEQ, BATCH, VOCAB, EXPERTS, TOPK = 16, 2, 64, 4, 2


def tiny_gpt(
    num_experts: int = EXPERTS,
    capacity_factor: float | None = None,
    num_query_groups: int | None = None,
    recompute: dict | None = None,
    shared_expert_size: int | None = None,
    dispatcher: str = "allgather",
) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=num_query_groups,
        use_cpu_initialization=True,
        num_moe_experts=num_experts,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher,
        moe_expert_capacity_factor=capacity_factor,
        moe_token_drop_policy="probs",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_shared_expert_intermediate_size=shared_expert_size,
        **(recompute or {}),
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return ids, pos


def capture_for(hooks: str, ring_mb: float = 8, **config) -> Capture:
    cfg = DMIConfig(hooks=parse_hooks(hooks), ring_mb=ring_mb, **config)
    return Capture(
        cfg,
        TorchRingTransport(cfg.ring_bytes, cfg.on_full, torch.device("cpu"), block_timeout=cfg.block_timeout),
        "test-run",
        0,
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit patterns, for bitwise comparisons (NaN-safe, -0 distinct from 0)."""
    return t.contiguous().view(torch.int32)
