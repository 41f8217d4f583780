"""A layer spec for ``--spec tests.unit_tests.dmi.training.parity_specs QK_LAYERNORM_LAYER``: the
local spec with q/k layernorm, which the default spec of the same flags does not have."""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

QK_LAYERNORM_LAYER = get_gpt_layer_local_spec(qk_layernorm=True)
