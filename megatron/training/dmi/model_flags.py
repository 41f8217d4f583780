"""Model flags of upstream's GPT entry that this entry cannot build as upstream does: refused at
start-up with one line naming the flag, or (where upstream accepts them and builds the plain model)
accepted with one line saying they have no effect. ModelOpt's flags are parsed here, as upstream's
entry parses them, because the megatron-core wheel does not ship them."""

from __future__ import annotations

import argparse
import importlib.util
import os

from megatron.training.dmi.arguments import refuse

# GPTModel's RoPE scaling factor, which upstream's GPT builder never overrides
BUILDER_ROPE_SCALING_FACTOR = 8.0

# ModelOpt's command-line flags as upstream's entry adds them (megatron.post_training, in Megatron-LM's
# repository, not in the wheel): name -> add_argument options.
MODELOPT_FLAGS: dict[str, dict] = {
    "--export-model-type": {"default": "GPTModel", "choices": ["GPTModel", "MambaModel"]},
    "--export-legacy-megatron": {"action": "store_true"},
    "--export-te-mcore-model": {"action": "store_true"},
    "--export-default-te-spec": {"action": "store_true"},
    "--export-force-local-attention": {"action": "store_true"},
    "--export-kv-cache-quant": {
        "default": "none",
        "choices": ["none", "fp8", "fp8_affine", "nvfp4", "nvfp4_affine", "nvfp4_rotate"],
    },
    "--export-real-quant-cfg": {"default": "None", "choices": ["fp8_real_quant", "fp8_blockwise_real_quant", "None"]},
    "--export-quant-cfg": {"default": None},
    "--export-kd-teacher-load": {"default": None},
    "--export-kd-teacher-model-config": {"default": None},
    "--export-kd-teacher-ckpt-format": {"default": None, "choices": ["torch", "torch_dist", "torch_dcp"]},
    "--export-kd-cfg": {"default": None},
    "--finetune-hf-dataset": {"default": None},
    "--finetune-data-split": {"default": "train"},
    "--export-qk-l2-norm": {"action": "store_true"},
    "--export-moe-apply-probs-on-input": {"action": "store_true"},
    "--export-offline-model": {"action": "store_true"},
    "--modelopt-enabled": {"action": "store_true"},
    "--enable-gpt-oss": {"action": "store_true"},
}


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def add_modelopt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ModelOpt's flags (quantization, distillation, export), so upstream command lines parse."""
    group = parser.add_argument_group(
        "modelopt",
        "NVIDIA Model Optimizer flags of upstream's entry (need nvidia-modelopt and Megatron-LM's repository)",
    )
    for flag, options in MODELOPT_FLAGS.items():
        group.add_argument(flag, help="ModelOpt (see Megatron-LM's megatron/post_training)", **options)
    return parser


def modelopt_flags_given(args: argparse.Namespace) -> list[str]:
    """The ModelOpt flags whose value differs from their default."""
    return [
        flag
        for flag, options in MODELOPT_FLAGS.items()
        if getattr(args, _dest(flag)) != options.get("default", False if options.get("action") else None)
    ]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_model_flags(args: argparse.Namespace, cpu: bool) -> list[str]:
    """Refuse the model flags this entry cannot build as upstream does; return the notices to print.

    Args:
        args: Megatron's parsed (not yet validated) arguments.
        cpu: whether the run is in CPU development mode.

    Returns:
        The lines to print about accepted flags that have no effect (as in upstream's entry).

    Raises:
        FlagRefusal: one line naming the flag and why.
    """
    if args.use_legacy_models:
        refuse(
            "--use-legacy-models",
            "the legacy GPT model (megatron.legacy) is part of Megatron-LM's repository, not of the "
            "megatron-core wheel; this entry builds megatron-core's GPTModel",
        )
    if args.spec is not None:
        _check_spec(args.spec)
    else:
        _check_backend(args)
    if args.mtp_num_layers is not None and args.transformer_impl == "inference_optimized":
        refuse("--mtp-num-layers", "multi-token prediction has no --transformer-impl inference_optimized spec")
    if args.record_memory_history and cpu:
        refuse("--record-memory-history", "it records CUDA allocations: not available with --cpu-dev-mode")
    notices = []
    if args.use_rope_scaling and args.rope_scaling_factor != BUILDER_ROPE_SCALING_FACTOR:
        notices.append(
            f"argument --rope-scaling-factor: has no effect: the GPT builder (as upstream's) scales RoPE "
            f"by {BUILDER_ROPE_SCALING_FACTOR:g}"
        )
    given = modelopt_flags_given(args)
    if given and _installed("modelopt"):
        refuse(
            given[0],
            "nvidia-modelopt is installed, but ModelOpt's Megatron integration (megatron.post_training, in "
            "Megatron-LM's repository) is not part of the megatron-core wheel",
        )
    if given:
        notices.append(
            f"argument {', '.join(given)}: no effect: nvidia-modelopt is not installed (upstream's entry then "
            "builds and trains the plain model too)"
        )
    return notices


def _check_backend(args: argparse.Namespace) -> None:
    """The layer specs of ``--transformer-impl`` (with no ``--spec``) must exist for this model."""
    if args.experimental_attention_variant is not None and args.transformer_impl != "transformer_engine":
        refuse(
            "--experimental-attention-variant",
            f"the experimental attention block spec ({args.experimental_attention_variant}) is built "
            "with Transformer Engine only: add --transformer-impl transformer_engine",
        )
    if args.transformer_impl != "local" and not _installed("transformer_engine"):
        refuse(
            "--transformer-impl",
            f"{args.transformer_impl} needs Transformer Engine, which is not installed (use --transformer-impl local)",
        )
    if args.multi_latent_attention and args.transformer_impl == "local":
        refuse(
            "--multi-latent-attention",
            "the local spec's DotProductAttention cannot run MLA (it takes no separate key/value head "
            "sizes, and megatron-core stops inside the model build): use --transformer-impl transformer_engine",
        )
    # the heterogeneous spec is chosen after the experimental and MoE ones (model_provider.decoder_spec)
    heterogeneous = args.heterogeneous_layers_config_path is not None and not args.num_experts
    if args.transformer_impl == "inference_optimized" and heterogeneous and args.experimental_attention_variant is None:
        refuse("--transformer-impl", "inference_optimized has no heterogeneous layer spec")


def _check_spec(spec: list[str]) -> None:
    """``--spec MODULE NAME`` must name an importable module and an attribute of it."""
    if len(spec) != 2:
        refuse("--spec", f"takes MODULE NAME (two values), got {len(spec)}: {' '.join(spec)}")
    module, name = spec
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        refuse("--spec", f"cannot import {module}: {exc}")
    if not hasattr(imported, name):
        refuse("--spec", f"{module} has no {name}")


def print_notices(notices: list[str]) -> None:
    """Print the notices once (on global rank 0), before Megatron initialises."""
    if os.environ.get("RANK", "0") == "0":
        for notice in notices:
            print(f"warning: {notice}", flush=True)
