"""Peak memory of this process, for the metrics: host RSS (what the kernel counts, CPU runs) and, on a GPU, the
allocator's peak."""
from __future__ import annotations

import resource
import sys

import torch


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (VmHWM), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB on Linux
    return kib / (1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0)


def peak_device_mib(device: torch.device) -> float | None:
    """The CUDA allocator's peak on `device` since the start, in MiB; None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20
