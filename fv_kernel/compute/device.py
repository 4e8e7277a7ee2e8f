"""How much memory a device has, and how many bytes a module keeps on it.

Read before anything loads (pre-flight) and when the engine sizes its ``"auto"`` memory
budget; nothing here knows a card or an instance.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from fv_kernel.errors import CapacityError

__all__ = ["device_key", "device_total_bytes", "device_available_bytes", "module_bytes"]


def device_key(device: torch.device | str) -> str:
    """A stable name for a device: ``"cuda"`` becomes ``"cuda:<current index>"``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return f"cuda:{index}"
    return str(device)


def device_total_bytes(device: torch.device | str) -> int:
    """Total memory of ``device``: the GPU's memory for CUDA, the machine's RAM for CPU.

    Raises :class:`CapacityError` for a device whose size fv cannot read; the deploy
    config then has to give ``scheduler.budgets.memory_bytes`` explicitly.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CapacityError(
                f"cannot size the memory budget of {device_key(device)}: CUDA is not available", param="memory_bytes"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    if device.type == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):
            pass
    raise CapacityError(
        f"cannot read the memory size of device {str(device)!r}; set scheduler.budgets.memory_bytes "
        "(bytes, e.g. '40GiB') or 'unlimited' in the deploy config",
        param="memory_bytes",
    )


def _meminfo_available_bytes() -> int | None:
    """Linux's ``MemAvailable`` (what can be allocated without swapping), or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_available_bytes(device: torch.device | str) -> int:
    """Memory that can still be allocated on ``device`` now: the GPU's free memory for CUDA, the
    machine's available RAM for CPU (``MemAvailable``; the total where the OS does not report it).

    Raises :class:`CapacityError` where fv cannot read it (as :func:`device_total_bytes`).
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    if device.type == "cpu":
        available = _meminfo_available_bytes()
        if available is not None:
            return available
    return device_total_bytes(device)


def module_bytes(module: Any, device: torch.device | str | None = None) -> int:
    """Bytes of a module's parameters and buffers (shared storage counted once), on ``device`` if given.

    Components that are not ``nn.Module`` s (tokenizers, processors) hold no device memory: 0.
    """
    if not isinstance(module, nn.Module):
        return 0
    want = None if device is None else device_key(device)
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type == "meta" or (want is not None and device_key(tensor.device) != want):
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
