"""The one base class of every error DMI raises on purpose, so a caller (the CLI, a training
loop) can catch them all with one ``except DMIError``. Each concrete error also keeps the
built-in base it always had (``ValueError`` for bad input, ``RuntimeError`` for a failed
operation), so existing handlers keep working."""


class DMIError(Exception):
    """Base class of DMI's errors."""
