"""Schema rendering, identifier validation, server URL / password handling (no database needed)."""

import os

import pytest

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords
from megatron.core.dmi.sinks import open_sink
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store.backend import ServerBackend, chdb_params
from megatron.core.dmi.store_address import (
    IdentifierError,
    ServerURLError,
    check_identifier,
    parse_server_url,
    redact,
    resolve_password,
)

HOSTILE = ["dmi; DROP TABLE x", "a.b", "`dmi`", "dmi'--", "", "1abc", "dmi ", "dmі", "x" * 64, "a\nb", "a/b", None]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_identifiers_rejected(name):
    with pytest.raises(IdentifierError):
        check_identifier(name)
    with pytest.raises(IdentifierError):
        S.ddl(name)
    with pytest.raises(IdentifierError):
        ServerBackend("http://127.0.0.1:9", database=name)


def test_hostile_database_rejected_by_the_config_and_by_open_sink(tmp_path):
    hostile = "dmi; DROP DATABASE default"
    with pytest.raises(IdentifierError):
        DMIConfig(persist="clickhouse", store_dir=str(tmp_path), clickhouse_database=hostile)
    cfg = DMIConfig(persist="clickhouse", store_dir=str(tmp_path))
    cfg.clickhouse_database = hostile  # set after the config's check: the sink checks again before any SQL
    with pytest.raises(IdentifierError):
        open_sink(cfg, ParallelCoords(), "r", True)


def test_good_identifiers():
    for name in ["dmi", "DMI_runs2", "_x", "a" * 63]:
        assert check_identifier(name) == name


def test_ddl_covers_every_table_with_codecs():
    stmts = S.ddl("dmi")
    text = "\n".join(stmts)
    for t in ("tensors", "expert_counts", "runs", "topology", "drops", "reports", "segments", "schema_version"):
        assert f"dmi.{t} (" in text
    assert "payload String CODEC(LZ4)" in text  # the default store codec
    assert "iteration Int64 CODEC(Delta, ZSTD(1))" in text
    assert "ReplacingMergeTree ORDER BY (run_id, phase, output, layer, iteration, microbatch" in text


def test_url_parsing():
    assert parse_server_url("http://ch.example:8123") == {
        "host": "ch.example",
        "port": 8123,
        "username": "default",
        "secure": False,
    }
    assert parse_server_url("https://alice@ch:9443")["username"] == "alice"
    assert parse_server_url("https://ch")["port"] == 8443
    for bad in ["ftp://x:1", "http://u:secret@h:1", "http://:8123", "http://h:1/db?x=1", "h:8123", "http://h:99999"]:
        with pytest.raises(ServerURLError) as e:
            parse_server_url(bad)
        assert "secret" not in str(e.value)


def test_password_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("DMI_CLICKHOUSE_PASSWORD", raising=False)
    monkeypatch.delenv("DMI_CLICKHOUSE_PASSWORD_FILE", raising=False)
    assert resolve_password() == ""
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    monkeypatch.setenv("DMI_CLICKHOUSE_PASSWORD_FILE", str(f))
    assert resolve_password() == "from-file"
    monkeypatch.setenv("DMI_CLICKHOUSE_PASSWORD", "from-env")
    assert resolve_password() == "from-env"
    assert resolve_password("explicit") == "explicit"


def test_password_never_in_errors_or_repr(tmp_path, monkeypatch):
    secret = "s3cr3t-Pa55"
    monkeypatch.setenv("DMI_CLICKHOUSE_PASSWORD", secret)
    assert redact(f"auth failed for {secret}", secret) == "auth failed for ***"
    cfg = DMIConfig(persist="clickhouse", store_dir=str(tmp_path), clickhouse_url="http://127.0.0.1:1")
    assert secret not in repr(cfg)
    sink = open_sink(cfg, ParallelCoords(), "r", True)
    argv = " ".join(sink.ingester._proc.args)  # the ingester process gets it in its environment only
    assert "--clickhouse-url http://127.0.0.1:1" in argv and secret not in argv
    rep = sink.close()
    assert rep.errors and any("cannot connect to ClickHouse" in e for e in rep.errors)
    assert all(secret not in e for e in rep.errors)
    assert secret not in repr(sink.__dict__.get("report"))
    for folder, _, files in os.walk(tmp_path):  # the ingester's status, the spool's report segment
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert secret.encode() not in f.read(), name


def test_chdb_param_encoding():
    p = chdb_params({"s": "a\\b\tc\nd'e", "a": ["x'y", "z\\"], "i": 3, "n": [1, 2]})
    assert p == {"s": "a\\\\b\\tc\\nd'e", "a": "['x\\'y','z\\\\']", "i": "3", "n": "[1,2]"}
