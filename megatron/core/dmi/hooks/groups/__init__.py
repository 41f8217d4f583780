"""The hook groups, one module each (``catalog.GROUPS`` names them), and their refusal checks."""

from __future__ import annotations

from megatron.core.dmi import catalog
from megatron.core.dmi.hooks.groups import attn, grad, logits, loss, mlp, resid, router
from megatron.core.dmi.hooks.groups.base import ModelFacts, Refusal

GROUP_MODULES = {m.GROUP: m for m in (router, attn, resid, mlp, loss, logits, grad)}


def refusal(hooks: frozenset[str], facts: ModelFacts) -> Refusal | None:
    """The first selected group's reason why ``hooks`` cannot be captured exactly with ``facts``, or None.

    Args:
        hooks: the selected output names.
        facts: the model's configuration as the checks read it.

    Returns:
        (the flag to change, why) or None.
    """
    for group, module in GROUP_MODULES.items():
        selected = frozenset(catalog.outputs_of_group(group, hooks))
        check = getattr(module, "refusal", None)
        why = check(selected, facts) if check is not None and selected else None
        if why is not None:
            return why
    return None
