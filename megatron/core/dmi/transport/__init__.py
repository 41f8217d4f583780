"""Transports move captured tensors off the training stream: ``native`` (JIT-built ring kernels
with a device gate) or ``torch`` (a pure-PyTorch ring, always available)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from megatron.core.dmi.transport.base import Transport
from megatron.core.dmi.transport.torch_ring import TorchRingTransport

if TYPE_CHECKING:  # the config imports this package (for the slot size)
    from megatron.core.dmi.config import DMIConfig

log = logging.getLogger(__name__)


def open_transport(config: DMIConfig, device: torch.device) -> Transport:
    """The transport ``config.transport`` asks for; ``auto`` falls back to torch if native cannot build.
    The config's values were checked when it was built; they go to the ring as they are."""
    ring = (config.ring_bytes, config.on_full, device)
    if config.transport in ("native", "auto"):
        try:
            from megatron.core.dmi.transport.native import NativeRingTransport

            return NativeRingTransport(*ring, block_timeout=config.block_timeout)
        except (ImportError, RuntimeError, OSError) as exc:
            if config.transport == "native":
                raise
            log.warning("DMI: native ring unavailable (%s); using the torch transport", exc)
    return TorchRingTransport(*ring, block_timeout=config.block_timeout)
