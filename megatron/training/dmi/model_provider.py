"""The GPT model the training entry builds from Megatron's arguments.

The layer spec is chosen as upstream Megatron-LM core_v0.17.1's GPT entry chooses it (its
``gpt_builders.py`` and ``model_provider.py``), so the same command line builds the same modules
with the same parameters. Flags this entry cannot honour are refused before any set-up by
:mod:`megatron.training.dmi.model_flags`; docs/parity.md maps every path to its test.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_inference_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
from megatron.core.transformer.spec_utils import import_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.yaml_arguments import core_transformer_config_from_yaml

from megatron.training import get_args, print_rank_0

# alloc/free events kept for --record-memory-history's snapshots (as upstream's entry keeps)
MEMORY_HISTORY_EVENTS = 100_000


def uses_transformer_engine(args) -> bool:
    """Whether the layer specs are Transformer Engine's (``--transformer-impl transformer_engine``)."""
    return args.transformer_impl == "transformer_engine"


def transformer_config(args) -> TransformerConfig:
    """The transformer config of the arguments, or of the ``language_model`` section of ``--yaml-cfg``."""
    if args.yaml_cfg is not None:
        return core_transformer_config_from_yaml(args, "language_model")
    return core_transformer_config_from_args(args)


def uniform_layer_spec(config: TransformerConfig, use_te: bool):
    """The one layer spec every decoder layer shares, for the backend of ``--transformer-impl``.

    Each backend's spec function gets the options upstream gives it: the Transformer Engine spec
    also takes q/k L2 norm, TE's activation function and MLA's fused down-projection; the local
    spec takes the normalization but, as upstream, not ``--qk-l2-norm``.
    """
    kitchen = {
        "use_kitchen": config.use_kitchen,
        "use_kitchen_attention": config.use_kitchen_attention,
        "kitchen_attention_backend": config.kitchen_attention_backend,
    }
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
            qk_l2_norm=config.qk_l2_norm,
            use_te_activation_func=config.use_te_activation_func,
            mla_down_proj_fusion=getattr(config, "mla_down_proj_fusion", False),  # an MLA config field
            **kitchen,
        )
    if config.transformer_impl == "inference_optimized":
        return get_gpt_layer_with_inference_spec(
            config.qk_layernorm, config.multi_latent_attention, qk_l2_norm=config.qk_l2_norm
        )
    return get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization,
        **kitchen,
    )


def decoder_spec(args, config: TransformerConfig, vp_stage: int | None = None):
    """The decoder's spec, by the first of these that applies: ``--spec MODULE NAME``, an
    ``--experimental-attention-variant`` block, the MoE block (its ``--moe-layer-freq`` pattern of
    expert and dense layers), ``--heterogeneous-layers-config-path``'s per-layer specs, else one
    layer spec for all layers."""
    if args.spec is not None:
        return import_module(args.spec)
    use_te = uses_transformer_engine(args)
    if args.experimental_attention_variant is not None:
        return get_transformer_block_with_experimental_attention_variant_spec(config=config, vp_stage=vp_stage)
    if args.num_experts:
        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
    if args.heterogeneous_layers_config_path is not None:
        return get_gpt_heterogeneous_layer_spec(config, use_te)
    return uniform_layer_spec(config, use_te)


def mtp_block_spec(args, config: TransformerConfig, decoder, vp_stage: int | None = None):
    """The multi-token prediction block (``--mtp-num-layers``), or None without MTP.

    Its transformer layer is the spec of the model's last decoder layer. A pipeline stage whose block
    spec holds no decoder layer (MoE, MTP alone on the last stage) takes the uniform layer spec.
    """
    if args.mtp_num_layers is None:
        return None
    use_te = uses_transformer_engine(args)
    if getattr(decoder, "layer_specs", None) == []:
        layer = uniform_layer_spec(config, use_te)
    else:
        layer = get_gpt_decoder_layer_specs(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )[-1]
    return get_gpt_mtp_block_spec(config, layer, use_transformer_engine=use_te, vp_stage=vp_stage)


def build_gpt_model(args, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """This pipeline stage's GPT model from Megatron's arguments (``config`` overrides theirs)."""
    print_rank_0("building GPT model ...")
    if config is None:
        config = transformer_config(args)
    decoder = decoder_spec(args, config, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        # upstream's builder gives no factor: scaled RoPE always uses GPTModel's default (model_flags warns)
        rope_scaling=args.use_rope_scaling,
        mtp_block_spec=mtp_block_spec(args, config, decoder, vp_stage),
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def record_cuda_memory_history(snapshot_path: str) -> None:
    """Record CUDA allocations for ``--record-memory-history`` (megatron.training dumps the snapshot
    to ``--memory-snapshot-path`` at each log interval); on an out-of-memory error, dump one at once
    to ``oom_rank-<rank>_<snapshot path>``."""
    torch.cuda.memory._record_memory_history(
        True, trace_alloc_max_entries=MEMORY_HISTORY_EVENTS, trace_alloc_record_context=True
    )

    def dump_on_oom(device, alloc, device_alloc, device_free):
        print("saving allocated state during OOM", flush=True)
        torch.cuda.memory._dump_snapshot(f"oom_rank-{torch.distributed.get_rank()}_{snapshot_path}")

    torch._C._cuda_attach_out_of_memory_observer(dump_on_oom)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build this pipeline stage's GPT model, as ``pretrain`` asks for it."""
    args = get_args()
    if args.record_memory_history:
        record_cuda_memory_history(args.memory_snapshot_path)
    return build_gpt_model(args, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)


def get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The pipeline ranks that hold a word embedding: the first stage, the last one when the output
    layer shares it, and the stages that hold MTP layers (they embed the shifted tokens)."""
    if len(pp_ranks) == 1:
        return list(pp_ranks)
    args = get_args()
    ranks = {pp_ranks[0], *get_mtp_ranks(pp_ranks, transformer_config(args))}
    if not args.untie_embeddings_and_output_weights:
        ranks.add(pp_ranks[-1])
    return sorted(ranks)
