import pytest

from tests.unit_tests.dmi.megatron_cpu import megatron_on_cpu


@pytest.fixture
def megatron_cpu():
    """megatron-core usable on the CPU for the duration of one test."""
    with megatron_on_cpu():
        yield
