"""The hook-group registry: one module per catalog group, placements derived from the catalog's
producers, and each group's refusal check, which HookSet.attach runs as the flags do."""

import pkgutil

import pytest

from megatron.core.dmi import catalog
from megatron.core.dmi.capture import Placement
from megatron.core.dmi.hooks import HookSet, groups
from megatron.core.dmi.hooks.groups.base import ModelFacts, Shards, UnsupportedModelError
from megatron.core.dmi.hooks.groups.mlp import experts_unsupported
from megatron.core.dmi.key import ParallelCoords
from tests.unit_tests.dmi.hooks.model_fixtures import capture_for, tiny_gpt

SITES = ("layer_site", "block_site", "model_site")


def test_every_catalog_group_has_one_group_module_and_every_module_a_group():
    modules = {m.name for m in pkgutil.iter_modules(groups.__path__)} - {"base"}
    assert modules == set(catalog.GROUPS) == set(groups.GROUP_MODULES)
    for name, module in groups.GROUP_MODULES.items():
        assert module.__name__ == f"{groups.__name__}.{name}" and module.GROUP == name
        assert any(hasattr(module, site) for site in SITES), name


def _shards(tp_rank=0, tp=2, sequence_parallel=False, dp=0, rank=0, group_ranks=()):
    return Shards(ParallelCoords(rank=rank, tp=tp_rank, dp=dp), tp, sequence_parallel, group_ranks)


def test_placement_follows_the_catalogs_producers():
    # "sequence": a token slice per TP rank under SP, else TP rank 0 speaks for the group
    assert _shards(tp_rank=1, sequence_parallel=True).placement("resid.in", 8) == Placement(8, 16, 16)
    assert _shards(tp_rank=0).placement("resid.in", 8) == Placement(0, 8, 8)
    assert _shards(tp_rank=1).placement("resid.in", 8) is None
    # "tensor": every TP rank its shard index, SP or not
    for sp in (False, True):
        assert _shards(tp_rank=1, sequence_parallel=sp).placement("attn.context", 8) == Placement(0, 8, 8, 1, 2)
    # "replicated": TP rank 0 only, SP or not
    assert _shards(tp_rank=0, sequence_parallel=True).placement("loss.token", 8) == Placement(0, 8, 8)
    assert _shards(tp_rank=1, sequence_parallel=True).placement("loss.token", 8) is None
    # "one": TP rank 0 of DP rank 0
    assert _shards(tp_rank=0, dp=0).placement("router.weight", 4) == Placement(0, 4, 4)
    assert _shards(tp_rank=0, dp=1).placement("router.weight", 4) is None
    assert _shards(tp_rank=1, dp=0).placement("router.weight", 4) is None
    # "every": this rank's index among the ranks whose records make the tensor
    assert _shards(rank=5, group_ranks=(4, 5)).placement("mlp.experts", 3) == Placement(0, 3, 3, 1, 2)


def test_every_producers_kind_is_placed():
    kinds = {o.producers for o in catalog.OUTPUTS}
    assert kinds == {"sequence", "tensor", "replicated", "one", "every"}
    for o in catalog.OUTPUTS:
        group_ranks = (0,) if o.producers == "every" else ()
        assert _shards(tp=1, group_ranks=group_ranks).placement(o.name, 4) is not None, o.name


@pytest.mark.parametrize(
    "facts,flag",
    [
        (ModelFacts(moe=True, dispatcher="flex"), "--moe-token-dispatcher-type"),
        (ModelFacts(moe=True, tensor_parallel=2), "--sequence-parallel"),
        (ModelFacts(moe=True, capacity_factor=1.0), "--moe-expert-capacity-factor"),
        (ModelFacts(moe=True, latent_size=16), "--moe-latent-size"),
        (
            ModelFacts(moe=True, dispatcher="alltoall", padding_for_quantization=True),
            "--moe-router-padding-for-quantization",
        ),
    ],
)
def test_expert_rows_refusals_name_the_flag(facts, flag):
    assert experts_unsupported(facts)[0] == flag
    assert groups.refusal(frozenset({"mlp.experts"}), facts)[0] == flag
    assert groups.refusal(frozenset({"mlp.out"}), facts) is None  # only the output that cannot be captured
    assert experts_unsupported(ModelFacts(moe=True)) is None
    assert experts_unsupported(ModelFacts(moe=True, tensor_parallel=2, sequence_parallel=True)) is None
    assert (
        experts_unsupported(ModelFacts(moe=True, dispatcher="alltoall", tensor_parallel=2, sequence_parallel=True))
        is None
    )


def test_the_groups_without_constraints_refuse_nothing():
    anything = ModelFacts(mtp_layers=1, dispatcher="flex", tensor_parallel=2, capacity_factor=1.0)
    assert groups.refusal(catalog.parse_hooks("attn,attn.q,attn.k,resid,loss,mlp.out"), anything) is None


def test_attach_refuses_what_the_flags_refuse(megatron_cpu):
    dense = tiny_gpt(num_experts=None)
    assert groups.refusal(frozenset({"router.logits"}), ModelFacts.of(dense.config)) is not None
    hooks = HookSet(capture_for("router"))
    with pytest.raises(UnsupportedModelError, match="--dmi-hooks: router outputs need a MoE model"):
        hooks.attach(dense)
    hooks.remove()
    HookSet(capture_for("attn,resid,mlp")).attach(dense)  # the dense model's own groups attach


def _module_state(model) -> list:
    """Every module's hooks and instance attributes (a method wrapper is an instance attribute)."""
    return [
        (
            name,
            sorted(vars(m)),
            list(m._forward_hooks),
            list(m._forward_pre_hooks),
            list(getattr(getattr(m, "token_dispatcher", None), "__dict__", {})),
        )
        for name, m in model.named_modules()
    ]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_every_group_attaches_and_remove_restores_every_module(megatron_cpu, dispatcher):
    import megatron.core.transformer.moe.router as mcore_router

    model = tiny_gpt(shared_expert_size=32, dispatcher=dispatcher)
    before = _module_state(model)
    token_dropping = mcore_router.apply_router_token_dropping
    every_output = ",".join(catalog.BY_NAME)
    hooks = HookSet(capture_for(every_output))
    hooks.attach(model)
    assert _module_state(model) != before
    assert {g for groups_here in hooks.layers.values() for g in groups_here} == {
        "router",
        "attn",
        "resid",
        "mlp",
        "grad",
    }
    hooks.remove()
    assert _module_state(model) == before
    assert mcore_router.apply_router_token_dropping is token_dropping


# the hook and wrapper functions the groups install (what runs when a site fires)
SITE_FUNCTIONS = {
    "routing",
    "hook",
    "block_output",
    "norm_input",
    "layer_output",
    "publish_weights",
    "shared_hook",
    "combined",
    "take_labels",
    "layer_input",
    "attention_output",
}


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_on_an_uncaptured_step_every_site_is_one_frame_of_dmi(megatron_cpu, dispatcher):
    """The per-step decision is read by each site as one attribute: on a step that captures nothing,
    DMI's code that runs is the sites' own functions, each returning at once (nothing else of DMI
    is called, nothing is published)."""
    import os
    import sys

    import megatron.core.dmi as dmi
    from tests.unit_tests.dmi.hooks.model_fixtures import tokens

    model = tiny_gpt(shared_expert_size=32, dispatcher=dispatcher)
    capture = capture_for(",".join(catalog.BY_NAME))
    hooks = HookSet(capture)
    hooks.attach(model)
    capture.begin_step("train", 1, wanted=False)
    package = os.path.dirname(dmi.__file__)
    shim = os.path.join(package, "cpu_mode.py")  # the CPU development shim this test runs under
    ran = []

    def profile(frame, event, arg):
        where = frame.f_code.co_filename
        if event == "call" and where.startswith(package) and where != shim:
            ran.append(frame.f_code.co_name)

    ids, pos = tokens()
    sys.setprofile(profile)
    try:
        model(ids, pos, None, labels=ids).sum().backward()
    finally:
        sys.setprofile(None)
    hooks.remove()
    assert ran and set(ran) <= SITE_FUNCTIONS, sorted(set(ran) - SITE_FUNCTIONS)
    assert capture.transport.stats.published == 0


def test_a_site_that_publishes_nothing_on_this_rank_installs_nothing(megatron_cpu):
    """Layers left out by the layer selection get no hook and no wrapper; the topology still lists them."""
    model = tiny_gpt()
    before = _module_state(model.decoder.layers[0])
    hooks = HookSet(capture_for("router,attn,resid,mlp", layers=frozenset({1})))
    hooks.attach(model)
    assert _module_state(model.decoder.layers[0]) == before
    assert _module_state(model.decoder.layers[1]) != _module_state(tiny_gpt().decoder.layers[1])
    assert sorted(hooks.layers) == [0, 1]
    hooks.remove()
