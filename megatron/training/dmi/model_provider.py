"""The GPT model the training entry builds from Megatron's arguments: layer spec and model provider."""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.training.arguments import core_transformer_config_from_args

from megatron.training import get_args, print_rank_0


def layer_spec(args, config, vp_stage):
    """The transformer layer (or decoder block) spec Megatron's arguments select."""
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts and args.moe_layer_freq != 1:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention
        )
    return get_gpt_layer_local_spec(
        args.num_experts,
        args.moe_grouped_gemm,
        args.qk_layernorm,
        args.multi_latent_attention,
        normalization=args.normalization,
    )


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build this pipeline stage's GPT model, as ``pretrain`` asks for it."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = config or core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config, vp_stage),
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
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
