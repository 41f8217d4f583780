"""Two runs on one --dmi-store-dir (issue 17 item 4): the second is refused at start-up, naming
the store and the run that holds it, and the first loses nothing. Real processes, the real
native spool writer with a segment open."""

from tests.unit_tests.dmi.isolated import run_isolated, run_parallel
from tests.unit_tests.dmi.sinks import workers as W


def test_a_second_run_on_a_live_store_is_refused_and_the_first_keeps_everything(tmp_path):
    store = str(tmp_path / "store")
    ready, release = str(tmp_path / "first-ready"), str(tmp_path / "second-done")
    first, second = run_parallel(
        [(W.hold_spool_open, (store, ready, release)), (W.start_second_writer, (store, ready, release))]
    )
    # before: the second writer deleted the first one's open segment (reported as a rename failure)
    assert second.startswith(f"--dmi-store-dir {store} is in use by another DMI run (pid "), second
    assert f"run {W.RUN}" in second and "give this run its own --dmi-store-dir" in second
    assert first["report"]["errors"] == [] and first["report"]["records_dropped"] == 0
    assert first["held"] == first["report"]["records_written"] == first["published"]
    # once the first run has closed, the store takes a new run
    assert run_isolated(W.start_second_writer, store, ready, str(tmp_path / "third-done")) == "started"
