"""``megatron-dmi <command>`` (or ``python -m megatron.core.dmi <command>``): look at what a run
captured, during the run or after it.

Reading commands open a snapshot of the store (see reader/snapshot.py: written under
``<store>/.readers/`` and removed on exit) and leave the store's data and spool as they are; only
``load`` writes the store. This module and the reader import pyarrow, pandas and chDB, not torch
(only ``tensor`` does) nor megatron-core, so ``megatron-dmi`` starts fast (benchmarks/cli_speed.py;
megatron_dmi/__init__.py says why ``python -m megatron.core.dmi`` cannot).

Each command lives in a module of this package that registers it when imported (``read``: the
reading commands and the analyses; ``doctor``: ``doctor`` and ``hooks``; ``watch``; ``ingest``; ``export``
holds what ``export`` writes); ``build_parser`` imports them. Other code can add commands by
calling ``add_subcommand`` (``common.py``) before ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings

from megatron.core.dmi.cli.common import COMMANDS, add_subcommand

# The modules of this package that register commands when imported, in the order ``--help`` lists
# them; imported by ``build_parser`` (test_layering reads this table with the import statements).
COMMAND_MODULES = ("read", "doctor", "watch", "ingest")


def build_parser(prog: str = "python -m megatron.core.dmi") -> argparse.ArgumentParser:
    """The command-line parser with every registered subcommand."""
    for module in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{module}")
    parser = argparse.ArgumentParser(
        prog=prog, description="Inspect Megatron-DMI captures (runs, tensors, expert load)."
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for name, (setup, help_) in COMMANDS.items():
        setup(sub.add_parser(name, help=help_, description=help_))
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m megatron.core.dmi") -> int:
    """Run the command line ``argv``; returns the exit status (DMI's own errors print, not raise)."""
    # Upstream libraries' import-time notices (no CUDA, no Transformer Engine/apex, absl) are not
    # the user's business here; DMI's own warnings (e.g. a corrupt segment) still show.
    warnings.filterwarnings("ignore", module=r"(torch|transformer_engine|apex|megatron\.core(?!\.dmi))(\.|$)")
    # The ClickHouse driver logs each failed request before raising it (the error printed below says it once);
    # torch's extension builder logs "No CUDA runtime is found" on a CPU (``doctor`` reports the GPU itself).
    logging.getLogger("clickhouse_connect").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    args = build_parser(prog).parse_args(argv)
    from megatron.core.dmi.reader import (
        DiskFullError,
        ReconstructionError,
        SchemaVersionError,
        StoreBusyError,
        StoreError,
    )
    from megatron.core.dmi.store.backend import BackendError
    from megatron.core.dmi.store_address import IdentifierError, ServerURLError

    try:
        return int(args.func(args) or 0)
    except DiskFullError as e:  # nothing wrong with the command: the machine lacks room (exit 1, as `load`'s failures)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (
        StoreError,
        StoreBusyError,
        SchemaVersionError,
        ReconstructionError,
        BackendError,
        IdentifierError,
        ServerURLError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


__all__ = ["add_subcommand", "build_parser", "main"]
