"""Shared by the model parity tests: Megatron's arguments parsed and validated as the entry parses
them, the entry's model and the model upstream's builder gives (from megatron-core's own spec
functions), and a layer spec for ``--spec tests.unit_tests.dmi.training.parity_models QK_LAYERNORM_LAYER``
(the local spec with q/k layernorm, which the default spec of the same flags does not have)."""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training.arguments import parse_args, validate_args

from megatron.training import global_vars
from megatron.training.dmi import entry, model_flags
from megatron.training.dmi.model_provider import model_provider, transformer_config
from tests.functional_tests.launch import tiny_moe_args
from tests.unit_tests.dmi.megatron_cpu import megatron_on_cpu

QK_LAYERNORM_LAYER = get_gpt_layer_local_spec(qk_layernorm=True)

MOE_ONLY = {"--num-experts": 1, "--moe-router-topk": 1, "--moe-token-dispatcher-type": 1}


def dense_args() -> list[str]:
    """The tiny MoE model of the other entry tests without its experts."""
    args, out = tiny_moe_args(), []
    skip = 0
    for a in args:
        if skip:
            skip -= 1
        elif a in MOE_ONLY:
            skip = MOE_ONLY[a]
        else:
            out.append(a)
    return out


DENSE = dense_args()
MOE = tiny_moe_args()


def parse(argv: list[str]):
    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv, "--cpu-dev-mode"]):
        return parse_args(entry.extra_args_provider(model_flags.add_modelopt_args))


@contextlib.contextmanager
def megatron_args(argv: list[str]):
    """Megatron's validated arguments for ``argv`` as the global args, in a one-process CPU world."""
    args = parse(argv)
    assert model_flags.check_model_flags(args, cpu=True) == []
    # --deterministic-mode's check wants an NCCL algorithm (gloo ignores it), as the CPU mode sets
    with megatron_on_cpu(), mock.patch.dict(os.environ, {"NCCL_ALGO": "Ring"}):
        validate_args(args, {})
        build_tokenizer(args)  # sets args.padded_vocab_size, as Megatron's initialisation does
        global_vars.set_args(args)
        try:
            yield args
        finally:
            global_vars.set_args(None)


def entry_model(argv: list[str]) -> tuple[GPTModel, object]:
    """The model the entry's provider builds for ``argv``, and the transformer config it used."""
    with megatron_args(argv) as args:
        torch.manual_seed(0)
        return model_provider(), transformer_config(args)


def upstream_model(argv: list[str], spec_of, mtp_of=None) -> GPTModel:
    """The model upstream's builder gives: the GPTModel arguments it passes, with the spec
    ``spec_of(args, config)`` (and MTP block ``mtp_of(args, config)``) from megatron-core's spec functions."""
    with megatron_args(argv) as args:
        config = transformer_config(args)
        return GPTModel(
            config=config,
            transformer_layer_spec=spec_of(args, config),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,
            mtp_block_spec=mtp_of(args, config) if mtp_of else None,
        )


def structure(model: torch.nn.Module) -> tuple[list[tuple[str, str]], int]:
    """Every module by name and type, and the parameter count."""
    return [(n, type(m).__name__) for n, m in model.named_modules()], sum(p.numel() for p in model.parameters())


def assert_same_model(argv: list[str], spec_of, mtp_of=None) -> GPTModel:
    ours, _ = entry_model(argv)
    expected = upstream_model(argv, spec_of, mtp_of)
    assert structure(ours) == structure(expected)
    return ours


def moe_block(args, config):
    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm
    )


def local_layer(args, config):
    return get_gpt_layer_local_spec(
        config.num_moe_experts,
        config.moe_grouped_gemm,
        config.qk_layernorm,
        config.multi_latent_attention,
        normalization=config.normalization,
    )


def mtp_block(args, config):
    last = get_gpt_decoder_layer_specs(
        config, use_transformer_engine=False, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm
    )[-1]
    return get_gpt_mtp_block_spec(config, last, use_transformer_engine=False)
