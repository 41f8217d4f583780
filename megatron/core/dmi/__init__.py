"""Deep Model Inspection: capture model internals during Megatron training, persist them in
ClickHouse, read them back as full tensors.

Pipeline (one module per stage): hooks -> records -> transport -> drain -> sinks -> reader.
"""

__version__ = "0.1.0"
