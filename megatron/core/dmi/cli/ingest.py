"""``ingest``: be a store's ingester (store/ingester.py).

A training run with ``--dmi-persist clickhouse`` starts one itself; run it by hand for a job whose
ranks only spool (``--dmi-persist spool``), to keep one store loaded across several runs, or to load
what a run left in the spool of a server store:

    megatron-dmi ingest dmi_store --follow      # until Ctrl-C or SIGTERM, then a final pass
    megatron-dmi ingest dmi_store               # one pass, then exit
    megatron-dmi ingest dmi_store --clickhouse-url http://ch:8123 --threads 4   # into a server, 4 inserts at once
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron.core.dmi.cli.common import add_subcommand, database_arg
from megatron.core.dmi.validators import NICE_MAX, argparse_type, nice_increment, positive_int, positive_seconds


def cmd_ingest(args) -> int:
    """``ingest``: load the store's spool into it, once or (``--follow``) until told to stop."""
    from megatron.core.dmi.store.ingester import EXIT_STANDING_DOWN, serve

    if not os.path.isdir(args.store):
        print(f"error: no DMI store directory at {args.store}", file=sys.stderr)
        return 2
    by_hand = args.control is None
    rc = serve(
        args.store,
        database=args.database,
        follow=args.follow,
        poll_s=args.poll_seconds,
        threads=args.threads,
        nice=args.nice,
        codec=args.codec,
        url=args.clickhouse_url,
        control=sys.stdin if args.control == "stdin" else None,
        out=None if by_hand else sys.stdout,
        interrupt_finishes=by_hand,
    )
    if by_hand:
        from megatron.core.dmi.store.ingester import read_status

        s = read_status(args.store)
        if rc == EXIT_STANDING_DOWN:
            print(f"not ingesting: another process holds the store {args.store}", file=sys.stderr)
        elif s is not None:
            r = s.result
            print(
                f"ingested {r.get('segments_loaded', 0)} segment(s), {r.get('records', 0)} record(s) in "
                f"{s.passes} pass(es); {s.waiting_segments} segment(s) left in the spool"
            )
            for e in r.get("errors", []):
                print(f"  ! {e}")
    return rc


def _url_arg(text: str) -> str:
    """An argparse type: a ClickHouse server URL, checked as --dmi-clickhouse-url is."""
    from megatron.core.dmi.store_address import ServerURLError, parse_server_url

    try:
        parse_server_url(text)
    except ServerURLError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--dmi-clickhouse-url ")) from None
    return text


def _setup_ingest(p):
    p.add_argument("store", help="the store directory (holding spool/, and chdb/ for the embedded store)")
    p.add_argument("--follow", action="store_true", help="keep ingesting until Ctrl-C or SIGTERM, then a final pass")
    p.add_argument("--database", type=database_arg, default="dmi")
    p.add_argument(
        "--poll-seconds",
        type=argparse_type(positive_seconds),
        default=2.0,
        help="a pass at least this often (seconds above 0; default 2)",
    )
    p.add_argument(
        "--clickhouse-url",
        type=_url_arg,
        default=None,
        help="load the spool into this ClickHouse server, http(s)://[user@]host:port, instead of the embedded store "
        "(password: $DMI_CLICKHOUSE_PASSWORD or $DMI_CLICKHOUSE_PASSWORD_FILE)",
    )
    p.add_argument(
        "--threads",
        type=argparse_type(positive_int),
        default=None,
        help="the embedded store's chDB threads (also each insert's streams), or with --clickhouse-url that many "
        "parallel inserts into the server (default: a quarter of the cores, 1-4)",
    )
    p.add_argument(
        "--nice",
        type=argparse_type(nice_increment),
        default=0,
        help=f"lower this process's CPU priority by this (0-{NICE_MAX})",
    )
    p.add_argument(
        "--codec", choices=["lz4", "zstd1", "none"], default=None, help="payload codec of a store created now"
    )
    # the training process's supervisor talks to the ingester through its stdin ("wake", "final")
    p.add_argument("--control", choices=["stdin"], default=None, help="(used by a training run's supervisor)")
    p.set_defaults(func=cmd_ingest)


add_subcommand("ingest", _setup_ingest, "be the store's ingester: load its spool (--follow: keep loading)")
