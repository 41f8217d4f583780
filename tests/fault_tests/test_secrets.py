"""The ClickHouse password never leaks (issue 17 item 6), not even when a server echoes the
request's headers (``Authorization: Basic base64(user:password)``) in its error bodies, and not
when it sits in a malformed URL."""

import argparse
import base64
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from megatron.training.dmi.arguments import add_dmi_args
from tests.fault_tests.test_faults import cli, read_store, report_line, train

HERE = os.path.dirname(os.path.abspath(__file__))
USER = "dmi"
SECRET = "s3cr3t/Pw+of=the-echo"


def secret_forms():
    """The password as a request carries it: plain, and base64 of user:password and of itself."""
    forms = {SECRET}
    for raw in (f"{USER}:{SECRET}", SECRET):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            forms.add(encode(raw.encode()).decode().rstrip("="))
    return sorted(forms)


def assert_no_secret(text, where):
    for form in secret_forms():
        assert form not in text, f"{form!r} in {where}"


def assert_no_secret_under(root):
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert_no_secret(f.read().decode("latin-1"), os.path.join(folder, name))


@pytest.mark.parametrize("server", ["proxy", "clickhouse"])
def test_server_echoing_authorization_never_leaks_the_password(server, tmp_path):
    """proxy: a 500 page without ClickHouse's exception code; clickhouse: the same body with the
    code, so the client treats it as a ClickHouse error message and the run reports it."""
    tmp = str(tmp_path)
    srv = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "echo_headers_server.py")]
        + (["--clickhouse-code"] if server == "clickhouse" else []),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(srv.stdout.readline())
        store = os.path.join(tmp, "store")
        rc, out = train(
            tmp,
            [
                "--dmi-hooks",
                "router",
                "--dmi-clickhouse-url",
                f"http://{USER}@127.0.0.1:{port}",
                "--dmi-store-dir",
                store,
            ],
            env={"DMI_CLICKHOUSE_PASSWORD": SECRET},
        )
    finally:
        srv.kill()
        srv.wait()
    assert rc == 0, out[-4000:]
    assert_no_secret(out, "the training output")
    assert_no_secret_under(store)
    assert "DMI ingester: " in out and "ClickHouse at 127.0.0.1" in out and "segments wait in" in out  # it retries
    line = report_line(out)
    assert "captured 64 records" in line and "spooled 64" in line and "errors:" in line, line
    report = out[out.index("DMI end-of-run report") :]  # the errors may span lines
    if server == "clickhouse":  # the ClickHouse error is kept, scrubbed
        assert "proxy refused the request" in report and "Authorization: Basic ***" in report, report
    else:  # a foreign error page is not shown at all
        assert "the response body is not shown" in report and "request headers were" not in report, report
    # the spool's reports, loaded into a store: its reports.errors are clean too
    target = os.path.join(tmp, "loaded")
    rc, msg = cli("load", store, "--store", target)
    assert rc == 0, msg
    data, text = read_store(target)
    (run,) = data["runs"].values()
    assert run["reports"] and run["reports"][0]["errors"], run["reports"]
    assert_no_secret(json.dumps(data) + text, "the loaded store's reports")
    assert_no_secret_under(target)


@pytest.mark.parametrize(
    "url",
    [
        f"http://{USER}:{SECRET}@127.0.0.1:1",
        f"http://{USER}:{SECRET}@127.0.0.1:x",
        f"http://{USER}:s3cr3t/value@127.0.0.1:1",
    ],
)
def test_a_password_in_a_malformed_url_is_never_echoed(url):
    err = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        add_dmi_args(argparse.ArgumentParser(prog="pretrain_gpt.py")).parse_args(["--dmi-clickhouse-url", url])
    assert "error: argument --dmi-clickhouse-url" in err.getvalue()
    assert "s3cr3t" not in err.getvalue(), err.getvalue()
