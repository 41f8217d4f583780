"""The payload codec is a store setting: chosen when the store is created, kept by the store after that."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing

import pytest

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.records import records_to_table
from megatron.core.dmi.store import schema as S
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W


def open_with_codec(store_dir: str, codec: str | None, iteration: int) -> dict:
    """Open (or create) the chDB store with ``codec``, load one batch of records through the ingest path, and
    report the store's codec, the warnings the open logged and the payloads read back."""
    from megatron.core.dmi.store.backend import ChdbBackend
    from megatron.core.dmi.store.ingest import load_table

    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("megatron.core.dmi.store.backend").addHandler(handler)
    backend = ChdbBackend(os.path.join(store_dir, "chdb"))
    try:
        backend.ensure_schema(payload_codec=codec)
        records = [
            dataclasses.replace(r, key=dataclasses.replace(r.key, iteration=iteration)) for r in W.dtype_records()
        ]
        load_table(backend, "tensors", records_to_table(records))
        ddl = backend.query_arrow(
            "SELECT compression_codec FROM system.columns WHERE database = 'dmi' AND table = 'tensors' "
            "AND name = 'payload'"
        )
        stored = backend.query_arrow(
            "SELECT payload FROM dmi.tensors WHERE iteration = {it:Int64} ORDER BY output, layer", {"it": iteration}
        )
        sent = records_to_table(records).sort_by([("output", "ascending"), ("layer", "ascending")])
        return {
            "setting": backend.payload_codec,
            "ddl": ddl.column("compression_codec")[0].as_py(),
            "warnings": warned,
            "payloads_equal": stored.column("payload").to_pylist() == sent.column("payload").to_pylist(),
        }
    finally:
        logging.getLogger("megatron.core.dmi.store.backend").removeHandler(handler)
        backend.close()


def test_a_new_store_takes_the_codec_asked_for_and_keeps_it(tmp_path):
    first = run_isolated(open_with_codec, str(tmp_path), "zstd1", 1)
    assert first == {"setting": "zstd1", "ddl": "CODEC(ZSTD(1))", "warnings": [], "payloads_equal": True}
    again = run_isolated(open_with_codec, str(tmp_path), "lz4", 2)
    assert again["setting"] == "zstd1" and again["ddl"] == "CODEC(ZSTD(1))" and again["payloads_equal"]
    assert len(again["warnings"]) == 1
    assert "keeps the payload codec zstd1" in again["warnings"][0] and "lz4" in again["warnings"][0]
    quiet = run_isolated(open_with_codec, str(tmp_path), None, 3)  # not asking for a codec: nothing to say
    assert quiet["setting"] == "zstd1" and quiet["warnings"] == []


def test_a_store_opened_without_a_codec_gets_the_default(tmp_path):
    got = run_isolated(open_with_codec, str(tmp_path), None, 1)
    assert got["setting"] == S.DEFAULT_PAYLOAD_CODEC == DMIConfig.store_codec
    assert got["ddl"] == f"CODEC({S.PAYLOAD_CODECS[S.DEFAULT_PAYLOAD_CODEC]})" and got["payloads_equal"]


def test_a_store_without_compression_round_trips_payloads(tmp_path):
    got = run_isolated(open_with_codec, str(tmp_path), "none", 1)
    assert got["setting"] == "none" and got["ddl"] == "CODEC(NONE)" and got["payloads_equal"]


def test_the_flag_offers_exactly_the_store_codecs():
    field = next(f for f in dataclasses.fields(DMIConfig) if f.name == "store_codec")
    assert set(typing.get_args(field.type)) == set(S.PAYLOAD_CODECS)


def test_an_unknown_codec_is_refused_by_name():
    with pytest.raises(S.PayloadCodecError, match="unknown store codec 'zstd9': expected one of lz4, zstd1, none"):
        S.ddl("dmi", "zstd9")
    with pytest.raises(ValueError, match="store_codec must be one of"):
        DMIConfig(store_codec="zstd9")
