"""Deep Model Inspection: capture model internals during Megatron training, persist them in
ClickHouse, read them back as full tensors.

Pipeline (one module or package per stage): hooks -> capture -> transport -> drain -> sinks ->
store -> reader -> cli (see docs/architecture.md for the layers each may import).
"""

__version__ = "0.1.0"
