"""Probing the machine's devices. A leaf below config.py and kv_cache/ (it imports only torch)."""

from __future__ import annotations

import os

import torch


def device_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`; for CPU the host's available and total RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")
