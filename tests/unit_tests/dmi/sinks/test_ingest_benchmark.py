"""``benchmarks/ingest_throughput.py``'s ingest pass runs here at its smoke size: raw segments from the JIT-built
native ring and Parquet ones, one and two insert streams, verified reading ahead and in turn, into real chDB
stores; every record loads and each row reports its stages (the figures are not asserted: wall-clock time)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def test_the_ingest_benchmark_loads_raw_and_parquet_spools_and_reports_each_stage(tmp_path):
    out = tmp_path / "ingest.json"
    proc = subprocess.run(
        [sys.executable, "ingest_throughput.py", "--quick", "--skip-store", "--json", str(out)],
        cwd=os.path.join(REPO, "benchmarks"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["ingest"]
    assert {(r["format"], r["streams"], r["read_ahead"]) for r in rows} == {
        (f, s, a) for f in ("raw", "parquet") for s in (1, 2) for a in ("on", "off")
    }
    for r in rows:
        assert r["records"] == r["payload_mb"] == 128  # 1 MiB records: the whole spool loaded
        assert set(r["seconds"]) == {"total", "verify", "insert", "read_back", "record"}
        assert r["GiBps"] > 0 and r["verify_alone_s"] > 0
