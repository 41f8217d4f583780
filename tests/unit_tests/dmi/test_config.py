import pytest

from megatron.core.dmi.config import DMIConfig, LayerRangeError, parse_layers


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
