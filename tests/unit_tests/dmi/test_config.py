import inspect

import pytest

from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.config import MIN_RING_BYTES, CaptureWindowError, DMIConfig, LayerRangeError, parse_layers
from megatron.core.dmi.drain import Drain
from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.transport.abi import SLOT_ALIGN


def test_the_smallest_ring_is_one_native_slot():
    """config keeps its own minimum (it does not import the ring's ABI): it must stay one slot."""
    assert MIN_RING_BYTES == SLOT_ALIGN


def test_layer_ranges():
    assert parse_layers("0,4-7") == {0, 4, 5, 6, 7}
    assert parse_layers(None) is None and parse_layers("all") is None


@pytest.mark.parametrize("bad", ["", "a", "3-", "-1", "5-2", "1,,2", "1-2-3"])
def test_malformed_layer_ranges(bad):
    with pytest.raises(LayerRangeError):
        parse_layers(bad)


def test_iteration_selection():
    c = DMIConfig(hooks=frozenset({"router.logits"}), interval=3, start_iter=2, end_iter=10)
    assert [i for i in range(1, 15) if c.captures_iteration("train", i)] == [2, 5, 8]
    assert not c.captures_iteration("valid", 2)
    assert DMIConfig(phases=frozenset({"train", "valid"})).captures_iteration("valid", 1)


def test_layer_selection():
    c = DMIConfig(layers=frozenset({1}))
    assert c.captures_layer(1) and not c.captures_layer(0)
    assert DMIConfig().captures_layer(99)


# -- a config built in code is checked by the same field parsers as the flags ------------------------
@pytest.mark.parametrize(
    "values,message",
    [
        ({"interval": 0}, "expected a positive integer, got 0"),
        ({"flush_records": 2.5}, "expected a positive integer, got 2.5"),
        ({"ring_mb": (SLOT_ALIGN - 1) / (1 << 20)}, f"ring size must hold at least one {SLOT_ALIGN}-byte slot"),
        ({"ring_mb": float("nan")}, "ring size must hold at least one"),
        ({"block_timeout": 0}, "expected seconds above 0 and at most 604800 (a week), got 0"),
        ({"block_timeout": float("inf")}, "expected seconds above 0"),
        ({"on_full": "wait"}, "on_full must be one of ('block', 'drop'), got 'wait'"),
        ({"phases": ["test"]}, "unknown phase(s) ['test']"),
        ({"layers": [1 << 16]}, "layer 65536 is out of range (0..65535)"),
        ({"hooks": ["bogus"]}, "unknown hook 'bogus'"),
        ({"clickhouse_url": "http://u:p@h:1"}, "put the password in $DMI_CLICKHOUSE_PASSWORD"),
        ({"clickhouse_database": "system"}, "database name 'system' is reserved by ClickHouse"),
        ({"start_iter": 5, "end_iter": 3}, "3 is before --dmi-start-iter 5"),
        ({"ingest_threads": 0, "clickhouse_url": "http://h:1"}, "expected a positive integer, got 0"),
    ],
)
def test_bad_values_are_refused_by_the_config_itself(values, message):
    with pytest.raises(ValueError) as e:
        DMIConfig(**values)
    assert isinstance(e.value, DMIError) and str(e.value).startswith(message), str(e.value)


def test_the_end_before_the_start_is_a_capture_window_error():
    with pytest.raises(CaptureWindowError):
        DMIConfig(start_iter=5, end_iter=3)


def test_typed_values_and_iterables_become_the_fields_types():
    c = DMIConfig(hooks=["router.logits"], phases=("valid",), layers=[3, 1], ring_mb=1, block_timeout=2)
    assert c.hooks == frozenset({"router.logits"}) and c.phases == frozenset({"valid"})
    assert c.layers == frozenset({1, 3}) and c.ring_bytes == 1 << 20 and c.block_timeout == 2.0
    assert DMIConfig(hooks=["router"]).hooks == parse_hooks("router")  # groups resolve as on the command line


def test_the_drain_batches_by_the_config_default_when_not_told():
    assert inspect.signature(Drain).parameters["batch_records"].default == DMIConfig().flush_records
