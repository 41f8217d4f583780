"""What a store needs to be read on its own: the model configuration DMI's outputs depend on, the
parallel layout, the command line and the package versions of a run.

Everything here is computed once at start-up from megatron-core objects (a ``TransformerConfig``
and ``parallel_state``), never from ``megatron.training``, so any training loop can record it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# TransformerConfig fields that decide the shapes, dtypes and values of captured outputs: how many
# layers and which are MoE, the router's selection (top-k, score function, capacity and how it
# drops), attention geometry (heads, groups, head dims, MLA), precision and recomputation.
MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_moe_experts",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_load_balancing_type",
    "moe_router_dtype",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity",
    "moe_token_dispatcher_type",
    "moe_grouped_gemm",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "params_dtype",
    "bf16",
    "fp16",
    "fp8",
    "fp8_recipe",
    "apply_rope_fusion",
    "normalization",
    "recompute_granularity",
    "recompute_modules",
    "recompute_method",
    "recompute_num_layers",
    "cuda_graph_impl",
    "cuda_graph_scope",
    "sequence_parallel",
    "transformer_impl",
)

_SECRET_FLAG = re.compile(r"(password|passwd|secret|token|api[-_]?key|credential)", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def _plain(value: Any) -> Any:
    """A JSON-friendly form of a config value (dtypes and enums as their names)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value)


def model_summary(transformer_config: Any, **extra: Any) -> dict[str, Any]:
    """The fields of ``transformer_config`` listed in ``MODEL_FIELDS`` that it has, plus ``extra``
    (values only the training loop knows, such as the sequence length or the vocabulary size)."""
    out = {
        name: _plain(getattr(transformer_config, name)) for name in MODEL_FIELDS if hasattr(transformer_config, name)
    }
    out.update({k: _plain(v) for k, v in extra.items() if v is not None})
    return out


def parallel_layout() -> dict[str, int | bool]:
    """Group sizes of this process's parallel state (1 where a group is not initialised).
    Sequence parallelism is a model setting, recorded by ``model_summary``."""
    from megatron.core import parallel_state as ps

    def size(fn_name: str) -> int:
        try:
            value = getattr(ps, fn_name)()
        except (AssertionError, AttributeError, RuntimeError):
            return 1
        return int(value) if value else 1

    import torch

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return {
        "world_size": world,
        "tp": size("get_tensor_model_parallel_world_size"),
        "pp": size("get_pipeline_model_parallel_world_size"),
        "vpp": size("get_virtual_pipeline_model_parallel_world_size"),
        "cp": size("get_context_parallel_world_size"),
        "ep": size("get_expert_model_parallel_world_size"),
        "etp": size("get_expert_tensor_parallel_world_size"),
        "dp": size("get_data_parallel_world_size"),
    }


def scrub_command_line(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every secret-looking flag (``--x-password v``, ``--api-key=v``)
    and the user info of every URL (``http://user:pw@host``) replaced by ``***``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        if arg.startswith("-") and _SECRET_FLAG.search(arg.split("=", 1)[0]) and "file" not in arg.split("=", 1)[0]:
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=***")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(_URL_USERINFO.sub(r"\g<scheme>***@", arg))
    return out


def package_versions() -> dict[str, str]:
    """Versions of the packages a run depends on; Transformer Engine only where it is installed."""
    from importlib import metadata

    out = {}
    for dist in (
        "torch",
        "megatron-core",
        "megatron-dmi",
        "chdb",
        "chdb-core-lite",
        "clickhouse-connect",
        "pyarrow",
        "numpy",
        "transformer-engine",
        "transformer-engine-torch",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if "transformer-engine" not in out:
        try:  # TE unpacked onto the path (no dist-info) still says what it is.
            import importlib.util

            if importlib.util.find_spec("transformer_engine") is not None:
                import transformer_engine

                out["transformer-engine"] = str(getattr(transformer_engine, "__version__", "unknown"))
        except Exception:  # a broken TE install must not stop DMI from starting
            pass
    return out
