"""Host-to-device copies that never block the host (the GPU hot path makes no host sync)."""

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """t (a CPU tensor) on `device`. To a GPU through pinned memory, asynchronously: a copy from
    pageable memory would wait for the device. (The pinned buffer is kept by torch's caching
    host allocator until the copy is done.)"""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
