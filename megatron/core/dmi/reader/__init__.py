"""Read DMI stores back: list runs, describe captures, rebuild full tensors, answer common
questions (expert load, dropped tokens, router entropy, attention patterns).

    from megatron.core.dmi.reader import open_store
    with open_store("dmi_store") as store:
        print(store.runs())
        logits = store.tensor(run_id, "router.logits", iteration=10, layer=3)

Names are imported on first use: reading a store needs pyarrow, pandas and chDB, not torch;
``open_spool_run`` reads a spool-only store (``--dmi-persist spool``) from its segments with
neither pandas nor chDB (``reader/spool.py``). The
tensor rebuild itself is ``megatron.core.dmi.reader.reconstruct.reconstruct``: a lazy name equal to
a submodule's would be replaced by the submodule as soon as anything imports it.
"""

import importlib

_MODULE_OF = {
    "open_store": "store",
    "Store": "store",
    "TensorSelection": "selection",
    "RunDescription": "store",
    "resolve_store_dir": "store",
    "open_spool_run": "spool",
    "StoreError": "errors",
    "NotAStoreError": "errors",
    "DiskFullError": "errors",
    "ReconstructionError": "errors",
    "AmbiguousLayerError": "errors",
    "StoreBusyError": "megatron.core.dmi.store.backend",
    "SchemaVersionError": "megatron.core.dmi.store.schema",
}


def __getattr__(name: str):
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod if "." in mod else f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


__all__ = list(_MODULE_OF)
