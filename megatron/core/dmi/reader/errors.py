"""The reader's errors, importable without torch (the CLI catches them on every command)."""

from megatron.core.dmi.errors import DMIError


class StoreError(DMIError, RuntimeError):
    """The store cannot answer: no such store, run, iteration or layer."""


class ReconstructionError(DMIError, RuntimeError):
    """The stored shards do not form exactly one full tensor (gap, overlap, conflict, corruption)."""


class AmbiguousLayerError(StoreError):
    """A tensor query named no layer, but the output was captured at several."""

    def __init__(self, output: str, iteration: int, layers: str):
        """Keep the output, the iteration and the layers it was captured at (``layers``: as text); the message names
        ``layer=``."""
        self.output, self.iteration, self.layers = output, iteration, layers
        super().__init__(self.message("layer="))

    def message(self, argument: str) -> str:
        """The error text naming how the caller chooses a layer (``layer=``; ``--layer`` in the CLI)."""
        return f"{self.output} at iteration {self.iteration} has layers {self.layers}: pass {argument}"
