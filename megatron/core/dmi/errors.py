"""The one base class of every error DMI raises on purpose, so a caller (the CLI, a training
loop) can catch them all with one ``except DMIError``. Each concrete error also keeps the
built-in base it always had (``ValueError`` for bad input, ``RuntimeError`` for a failed
operation), so existing handlers keep working."""


class DMIError(Exception):
    """Base class of DMI's errors."""


class InvalidArgumentError(DMIError, ValueError, TypeError):
    """A DMI function was given an argument it cannot take (a value or a type outside what it
    documents): a caller's mistake, named in the message. Also a ``ValueError`` and a
    ``TypeError``, the built-in errors such arguments raised before."""


class UnsupportedOperationError(DMIError, NotImplementedError):
    """An operation this object does not offer (e.g. native spool segments handed to a sink that
    takes none)."""
