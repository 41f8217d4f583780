"""Read DMI stores back: list runs, describe captures, rebuild full tensors, answer common
questions (expert load, dropped tokens, router entropy, attention patterns).

    from megatron.core.dmi.reader import open_store
    with open_store("dmi_store") as store:
        print(store.runs())
        logits = store.tensor(run_id, "router.logits", iteration=10, layer=3)
"""

from megatron.core.dmi.reader.reconstruct import ReconstructionError, reconstruct
from megatron.core.dmi.reader.store import RunDescription, Store, StoreError, open_store, resolve_store_dir
from megatron.core.dmi.sinks.backend import StoreBusyError
from megatron.core.dmi.sinks.schema import SchemaVersionError

__all__ = ["open_store", "Store", "RunDescription", "ReconstructionError", "reconstruct", "StoreError",
           "StoreBusyError", "SchemaVersionError", "resolve_store_dir"]
