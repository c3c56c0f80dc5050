"""Facts about the running machine that decide how to run a model on it: CPU features, the best dtype, and where
measurements made on it are kept."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

#: CPU flags that mean native bf16 matrix arithmetic.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cache_root() -> Path:
    """Where draftwise keeps converted checkpoints and per-machine measurements: ``~/.cache/draftwise``."""
    return Path.home() / ".cache" / "draftwise"


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in Linux ``/proc/cpuinfo`` (``None`` where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(field):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` computes bf16 natively: any CUDA device, or a CPU with avx512_bf16 or AMX."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype ``dtype="auto"`` picks: bfloat16 where the device computes it natively, float32 otherwise."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def read_bandwidth(device: torch.device | str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """The memory read bandwidth of ``device`` in bytes per second, measured now: the median time to sum a buffer of
    ``megabytes`` (bigger than any cache) with the current threads. A one-row forward cannot take less than the
    model's weight bytes over this."""
    device = torch.device(device)
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):  # the first pass warms the pages up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / statistics.median(times[1:])


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters, each tensor once (a tied output head and embedding count once)."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel() * parameter.element_size()
    return total


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """``dtype`` as a torch dtype; ``"auto"`` is :func:`auto_dtype`. Unknown names raise ``ValueError``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return resolved


def machine_key(device: torch.device | str, dtype: torch.dtype, model_shape: dict[str, Any]) -> str:
    """An identifier of measurements that hold for this machine, library version, thread count, dtype and model
    shape: a different CPU, torch build or thread count measures again."""
    device = torch.device(device)
    description = {
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": cpu_model(),
        "flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "model": model_shape,
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]


class MeasurementStore:
    """Measurements of this machine, one JSON file per key under ``cache_root() / "machine"``.

    Args:
        folder: where the files go (default: ``cache_root() / "machine"``).
    """

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else cache_root() / "machine"

    def load(self, key: str) -> dict[str, Any]:
        path = self.folder / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def save(self, key: str, record: dict[str, Any]) -> None:
        """Write ``record`` (atomically: a file half written is never read)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            scratch = self.folder / f".{key}.{os.getpid()}.tmp"
            scratch.write_text(json.dumps(record, indent=1, sort_keys=True))
            os.replace(scratch, self.folder / f"{key}.json")
        except OSError:
            pass  # a read-only home only costs measuring again next time
