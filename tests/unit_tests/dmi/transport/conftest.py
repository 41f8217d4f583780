"""Markers used by the native transport tests (also declared in pyproject.toml; registering them
here keeps ``--strict-markers`` happy when this folder is run on its own)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~30 s on a 2-core CPU")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
