"""What a run row records so a store can be read without the training command."""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.dmi import provenance


def test_model_summary_takes_the_fields_outputs_depend_on_from_a_real_config():
    cfg = TransformerConfig(
        num_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_expert_capacity_factor=1.5,
        moe_token_drop_policy="probs",
        params_dtype=torch.bfloat16,
        bf16=True,
        add_bias_linear=False,
    )
    m = provenance.model_summary(cfg, seq_length=32, vocab_size=None)
    assert m["num_layers"] == 3 and m["num_moe_experts"] == 8 and m["moe_router_topk"] == 2
    assert m["moe_expert_capacity_factor"] == 1.5 and m["moe_token_drop_policy"] == "probs"
    assert m["params_dtype"] == "torch.bfloat16" and m["seq_length"] == 32
    assert "vocab_size" not in m  # unknown extras are left out, not stored as null
    assert set(m) <= set(provenance.MODEL_FIELDS) | {"seq_length"}


def test_command_line_is_scrubbed_of_secrets():
    argv = [
        "pretrain_gpt.py",
        "--dmi-clickhouse-url",
        "http://dmi:s3cr3t@db:8123",
        "--wandb-api-key",
        "k3y",
        "--hf-token=t0k",
        "--dmi-clickhouse-password-file",
        "/run/secret_pw",
        "--num-layers",
        "2",
    ]
    out = provenance.scrub_command_line(argv)
    text = " ".join(out)
    for secret in ("s3cr3t", "k3y", "t0k"):
        assert secret not in text
    assert out[2] == "http://***@db:8123" and out[4] == "***" and out[5] == "--hf-token=***"
    assert "/run/secret_pw" in out and out[-2:] == ["--num-layers", "2"]  # a file path is not the secret


def test_versions_name_the_packages_a_store_depends_on():
    v = provenance.package_versions()
    for dist in ("torch", "megatron-core", "chdb", "pyarrow"):
        assert v.get(dist), dist


def test_layout_is_all_ones_without_process_groups():
    assert provenance.parallel_layout() == {
        "world_size": 1,
        "tp": 1,
        "pp": 1,
        "vpp": 1,
        "cp": 1,
        "ep": 1,
        "etp": 1,
        "dp": 1,
    }
