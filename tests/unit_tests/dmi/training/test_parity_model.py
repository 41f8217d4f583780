"""Model-building parity with upstream's GPT entry (core_v0.17.1's gpt_builders.py), flag by flag.

Upstream's entry is not in the wheel, so each expected model is built here from megatron-core's own
spec functions, called with the arguments upstream's builder gives them; the entry's model provider
must build the same modules (by name and type) with the same parameter count. Refusals: one line
naming the flag, before any process group exists."""

from __future__ import annotations

import json

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import L2Norm

from megatron.training.dmi import model_flags
from megatron.training.dmi.model_provider import get_embedding_ranks
from tests.unit_tests.dmi.training.parity_models import (
    DENSE,
    MOE,
    assert_same_model,
    entry_model,
    local_layer,
    megatron_args,
    moe_block,
    mtp_block,
    parse,
)

MTP = ["--mtp-num-layers", "1"]


def _attention_norms(model: GPTModel) -> set[type]:
    return {
        type(getattr(layer.self_attention, name))
        for layer in model.decoder.layers
        for name in ("q_layernorm", "k_layernorm")
    }


def test_qk_l2_norm_on_themoe_block_spec():
    model = assert_same_model([*MOE, "--qk-l2-norm"], moe_block)
    assert _attention_norms(model) == {L2Norm}


def test_qk_l2_norm_on_the_local_dense_spec_is_not_applied_as_upstream():
    # upstream's dense local spec is not given --qk-l2-norm: q/k stay identities
    model = assert_same_model([*DENSE, "--qk-l2-norm"], local_layer)
    assert _attention_norms(model) == {IdentityOp}


@pytest.mark.parametrize(
    "flags",
    [
        ["--moe-layer-freq", "[1,0]"],
        ["--moe-layer-freq", "2", "--normalization", "RMSNorm", "--qk-layernorm"],
    ],
)
def test_moe_layer_pattern_and_norms_take_the_decoder_block_spec(flags):
    model = assert_same_model([*MOE, *flags], moe_block)
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MoELayer", "MLP"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--normalization", "RMSNorm"],
        ["--qk-layernorm", "--group-query-attention", "--num-query-groups", "2"],
    ],
)
def test_denselocal_layer_spec(flags):
    assert_same_model([*DENSE, *flags], local_layer)


def test_use_rope_scaling_scales_the_rotary_frequencies():
    rope = ["--position-embedding-type", "rope"]
    scaled = assert_same_model([*DENSE, *rope, "--use-rope-scaling"], local_layer)
    plain, _ = entry_model([*DENSE, *rope])
    dim = 64 // 4
    expected = RotaryEmbedding(dim, 1.0, rope_scaling=True, use_cpu_initialization=True).inv_freq
    assert torch.equal(scaled.rotary_pos_emb.inv_freq, expected)
    assert not torch.equal(plain.rotary_pos_emb.inv_freq, expected)


def test_spec_module_name_is_imported():
    spec = ["--spec", "tests.unit_tests.dmi.training.parity_models", "QK_LAYERNORM_LAYER"]
    from tests.unit_tests.dmi.training.parity_models import QK_LAYERNORM_LAYER

    model = assert_same_model([*DENSE, *spec], lambda args, config: QK_LAYERNORM_LAYER)
    assert IdentityOp not in _attention_norms(model)


def test_heterogeneous_layers_config_builds_per_layer_specs(tmp_path):
    # layer 2: no attention, a smaller FFN (a config in the format of HF's Nemotron-NAS block_configs)
    blocks = [
        {"attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 2},
         "ffn": {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 128}},
        {"attention": {"no_op": True, "replace_with_linear": False, "n_heads_in_group": None},
         "ffn": {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 64}},
    ]  # fmt: skip
    hf = {
        "block_configs": blocks,
        "hidden_act": "silu",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "tie_word_embeddings": True,
        "rope_theta": 10000,
        "rope_scaling": {"factor": 8.0},
    }
    path = tmp_path / "heterogeneous.json"
    path.write_text(json.dumps(hf))
    flags = ["--heterogeneous-layers-config-path", str(path), "--swiglu", "--normalization", "RMSNorm"]
    flags += ["--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope"]
    flags += ["--use-rope-scaling", "--use-rotary-position-embeddings", "--rotary-base", "10000"]
    model = assert_same_model([*DENSE, *flags], lambda args, config: get_gpt_heterogeneous_layer_spec(config, False))
    layers = model.decoder.layers
    assert type(layers[1].self_attention).__name__ == "IdentityOp"
    assert layers[0].mlp.linear_fc2.weight.shape[1] == 128 and layers[1].mlp.linear_fc2.weight.shape[1] == 64


@pytest.mark.parametrize("base", [DENSE, MOE], ids=["dense", "moe"])
def test_mtp_num_layers_builds_themtp_block(base):
    flags = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    spec_of = moe_block if base is MOE else local_layer
    model = assert_same_model([*base, *flags], spec_of, mtp_block)
    assert len(model.mtp.layers) == 1


def _refusal(argv: list[str], cpu: bool = True) -> str:
    with pytest.raises(SystemExit) as exc:
        model_flags.check_model_flags(parse(argv), cpu=cpu)
    return str(exc.value)


REFUSALS = {
    "legacy model": (["--use-legacy-models"], "--use-legacy-models", "megatron.legacy"),
    "spec of one value": (["--spec", "local"], "--spec", "two values"),
    "spec module missing": (["--spec", "no_such_module_xyz", "SPEC"], "--spec", "cannot import no_such_module_xyz"),
    "spec name missing": (["--spec", "tests.unit_tests.dmi.training.parity_models", "NOPE"], "--spec", "has no NOPE"),
    "experimental attention on local": (
        ["--experimental-attention-variant", "gated_delta_net"],
        "--experimental-attention-variant",
        "Transformer Engine only",
    ),
    "transformer engine not installed": (
        ["--transformer-impl", "transformer_engine"],
        "--transformer-impl",
        "Transformer Engine, which is not installed",
    ),
    "inference_optimized without transformer engine": (
        ["--transformer-impl", "inference_optimized"],
        "--transformer-impl",
        "inference_optimized needs Transformer Engine",
    ),
    "multi-latent attention on local": (
        ["--multi-latent-attention", "--position-embedding-type", "rope"],
        "--multi-latent-attention",
        "DotProductAttention",
    ),
    "memory history on the CPU": (["--record-memory-history"], "--record-memory-history", "--cpu-dev-mode"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_is_one_line_naming_the_flag(case):
    extra, flag, detail = REFUSALS[case]
    message = _refusal([*DENSE, *extra])
    assert message.startswith(f"error: argument {flag}: ") and detail in message and "\n" not in message


def test_mtp_with_inference_optimized_is_refused_as_upstream_asserts():
    # with Transformer Engine missing the backend is refused first; the MTP check follows it
    args = parse(
        [*DENSE, "--mtp-num-layers", "1", "--spec", "tests.unit_tests.dmi.training.parity_models", "QK_LAYERNORM_LAYER"]
    )
    args.transformer_impl = "inference_optimized"
    with pytest.raises(SystemExit, match="argument --mtp-num-layers: .*inference_optimized"):
        model_flags.check_model_flags(args, cpu=True)


def test_modelopt_flags_parse_and_say_they_have_no_effect_without_modelopt():
    flags = ["--export-te-mcore-model", "--export-kd-teacher-load", "/teacher", "--export-kd-cfg", "kd.yaml"]
    notices = model_flags.check_model_flags(parse([*DENSE, *flags]), cpu=True)
    assert notices == [
        "argument --export-te-mcore-model, --export-kd-teacher-load, --export-kd-cfg: no effect: nvidia-modelopt "
        "is not installed (upstream's entry then builds and trains the plain model too)"
    ]


def test_rope_scaling_factor_is_accepted_and_said_to_have_no_effect():
    notices = model_flags.check_model_flags(
        parse([*DENSE, "--use-rope-scaling", "--rope-scaling-factor", "16"]), cpu=True
    )
    assert len(notices) == 1 and notices[0].startswith("argument --rope-scaling-factor: has no effect")


@pytest.mark.parametrize(
    "flags, ranks",
    [
        ([], [0, 8]),  # tied: the output layer on the last stage shares the embedding
        (["--untie-embeddings-and-output-weights"], [0]),
        (["--untie-embeddings-and-output-weights", *MTP], [0, 8]),  # MTP embeds on the last stage
    ],
)
def test_embedding_ranks_of_a_pipeline(flags, ranks):
    with megatron_args([*MOE, "--position-embedding-type", "rope", *flags]):
        assert get_embedding_ranks([0, 4, 8]) == ranks
        assert get_embedding_ranks([3]) == [3]
