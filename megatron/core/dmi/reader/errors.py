"""The reader's errors, importable without torch (the CLI catches them on every command)."""

from collections.abc import Sequence

from megatron.core.dmi.errors import DMIError


class StoreError(DMIError, RuntimeError):
    """The store cannot answer: no such store, run, iteration or layer."""


class NotAStoreError(StoreError):
    """The path given is no DMI store: missing, a plain file, or a folder without ``chdb/`` or ``spool/``.

    ``found``: the store folders found under the path (a run's ``--save`` folder, a parent of stores), so the
    message can name them; ``missing``: the path does not exist (a reader that waits for a run may retry).
    """

    def __init__(self, message: str, found: Sequence[str] = (), missing: bool = False):
        """Keep the message, the stores found under the path and whether the path is missing."""
        self.found, self.missing = list(found), missing
        super().__init__(message)


class DiskFullError(StoreError):
    """The store's file system has no room for the reader's snapshot, and the store cannot be read in
    place instead (its run still writes it, or it is a spool that has to be loaded to be read)."""


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


def format_ranges(xs: Sequence[int]) -> str:
    """Integers as compact ranges for messages: ``[0, 1, 2, 5]`` -> ``"0-2,5"`` (``"-"`` for none)."""
    xs = sorted(set(xs))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) or "-"
