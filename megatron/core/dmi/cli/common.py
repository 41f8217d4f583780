"""What every ``megatron-dmi`` command shares: the command registry and the common arguments,
opening a store for reading, and printing tables and sizes.

Commands register through ``add_subcommand(name, setup, help)``; ``setup(parser)`` adds the
command's arguments and sets ``func`` (a callable taking the parsed args, returning an exit code).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from megatron.core.dmi.store_address import check_database
from megatron.core.dmi.validators import argparse_type

SetupFn = Callable[[argparse.ArgumentParser], None]
COMMANDS: dict[str, tuple[SetupFn, str]] = {}


def add_subcommand(name: str, setup: SetupFn, help: str) -> None:
    """Register a subcommand: ``setup`` adds its arguments to its parser."""
    COMMANDS[name] = (setup, help)


# The argparse type of every command's --database; --dmi-clickhouse-database checks the same.
database_arg = argparse_type(check_database)


def store_arg(p: argparse.ArgumentParser) -> None:
    """Add the store argument (a directory or a server URL) and ``--database``."""
    p.add_argument("store", help="store directory (--dmi-store-dir) or ClickHouse URL http(s)://host:port")
    p.add_argument("--database", type=database_arg, default="dmi", help="database name (default: dmi)")


def run_arg(p: argparse.ArgumentParser) -> None:
    """Add ``--run`` (default: the latest run)."""
    p.add_argument("--run", dest="run_id", default=None, help="run id (default: the latest run)")


def open_for_reading(store: str, database: str, quiet: bool = False):
    """A read-only snapshot view of ``store`` (a URL: the server itself); says what it took from
    the spool (segments the store has not loaded yet: a live run's latest, a crash's leftovers)."""
    from megatron.core.dmi.reader import open_store

    opened = open_store(store, database=database, progress=sys.stderr.isatty() and not quiet)
    r = opened.ingest_result
    if opened.in_place and not quiet:
        print(f"(the file system of {store} is full: read in place, no snapshot taken and nothing loaded)")
    if (r.segments_loaded or r.segments_corrupt or r.errors) and not quiet:
        print(
            f"(read {r.segments_loaded} spool segment(s) not in the store yet, {r.records} record(s)"
            + (f"; {r.segments_corrupt} corrupt segment(s) skipped" if r.segments_corrupt else "")
            + (f"; {r.records_quarantined} record(s) quarantined" if r.records_quarantined else "")
            + "; the files are left as they are)"
        )
        for e in r.errors:
            print(f"  ! {e}")
    return opened


def open_store_of(args):
    """``open_for_reading`` of the store and database a command was given."""
    return open_for_reading(args.store, args.database)


def fmt_bytes(n: int) -> str:
    """``n`` bytes in binary units (B, KiB, ... TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_table(df, max_rows: int = 200) -> None:
    """Print a DataFrame without its index (``(none)`` when empty), at most ``max_rows`` rows."""
    import pandas as pd

    with pd.option_context("display.max_rows", max_rows, "display.max_columns", 50, "display.width", 200):
        print(df.to_string(index=False) if not df.empty else "(none)")
