"""Facts about the running machine that decide how to run a model on it: CPU features, the best dtype, and where
measurements made on it are kept."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Mapping
from functools import cache
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


def finish_queued_work(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a GPU's; a CPU's is done when its call returns), so that a timed call
    counts its running time, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device | str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """The memory read bandwidth of ``device`` in bytes per second, measured now: the median time to sum a buffer of
    ``megabytes`` (bigger than any cache) with the current threads. A one-row forward cannot take less than the
    model's weight bytes over this."""
    device = torch.device(device)
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):  # the first pass warms the pages up
        finish_queued_work(device)
        start = time.perf_counter()
        buffer.sum()
        finish_queued_work(device)
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


#: The sources a backend measurement depends on: everything under ``draftwise/backend`` (the forward, its weights,
#: caches and kernels, and the measuring code itself).
BACKEND_FOLDER = Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = (".py", ".cpp", ".h")


@cache
def code_digest(folder: Path = BACKEND_FOLDER) -> str:
    """A digest of the backend's sources: measurements are keyed by it, so an edit to the forward, its kernels or
    the measuring code measures again (no version number to bump by hand)."""
    digest = hashlib.sha256()
    for path in sorted(path for path in folder.rglob("*") if path.suffix in SOURCE_SUFFIXES and path.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def machine_key(device: torch.device | str, dtype: torch.dtype, model_shape: dict[str, Any]) -> str:
    """An identifier of measurements that hold for this machine, library version, thread count, dtype, model shape
    and backend code (:func:`code_digest`): a different CPU, torch build, thread count or forward measures again."""
    device = torch.device(device)
    description = {
        "code": code_digest(),
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

    Every record is stamped with the :func:`code_digest` that wrote it. Saving prunes the records written by other
    code (or by code that stamped none) once they have gone unwritten for :attr:`STALE_AFTER_S`: another checkout on
    the same machine keeps its records while it is in use, and code that is gone leaves nothing behind for long.

    Args:
        folder: where the files go (default: ``cache_root() / "machine"``).
    """

    #: Age (seconds since last written) after which another code's records are pruned.
    STALE_AFTER_S = 7 * 24 * 3600.0

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else cache_root() / "machine"

    def load(self, key: str) -> dict[str, Any]:
        path = self.folder / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def save(self, key: str, record: dict[str, Any]) -> None:
        """Write ``record`` (atomically: a file half written is never read), stamped with the current
        :func:`code_digest`, then :meth:`prune`."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            scratch = self.folder / f".{key}.{os.getpid()}.tmp"
            scratch.write_text(json.dumps({**record, "code": code_digest()}, indent=1, sort_keys=True))
            os.replace(scratch, self.folder / f"{key}.json")
        except OSError:
            return  # a read-only home only costs measuring again next time
        self.prune()

    def prune(self, now: float | None = None) -> list[Path]:
        """Delete records of other code (see the class notes) unwritten for :attr:`STALE_AFTER_S`; returns them."""
        now = time.time() if now is None else now
        current, removed = code_digest(), []
        for path in self.folder.glob("*.json"):
            try:
                if now - path.stat().st_mtime < self.STALE_AFTER_S:
                    continue
                stamped = json.loads(path.read_text()).get("code")
            except (OSError, ValueError, AttributeError):
                stamped = None
            if stamped != current:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed.append(path)
        return removed


def bandwidth_floor(model: Any, earlier: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fastest plain decoding can be on this machine: every weight read once a token, at the read bandwidth
    measured now (``weights_mb``, ``read_gb_per_s``, ``floor_ms_per_token``). An input embedding that is not also
    the output head is left out: a token reads one of its rows. Block-quantised products count as packed.

    With ``earlier`` (this function's result at a run's start), the faster of the two readings counts, and
    ``read_gb_per_s_probes`` lists both: a floor bounds the run, and on some machines the bandwidth moves by half
    within minutes (one probe read 38 GB/s at a run's start, and decoding then ran faster than that floor)."""
    network = model if hasattr(model, "get_output_embeddings") else model.model  # (a target holds its model)
    if getattr(model, "quantization", None):  # block-quantised products: the bytes they read, as packed
        weights = sum(product.weight.numel() * product.weight.element_size() for product in model.products)
    else:
        weights = weight_bytes(network)
        embedding, head = network.get_input_embeddings(), network.get_output_embeddings()
        if embedding is not None and (head is None or head.weight.data_ptr() != embedding.weight.data_ptr()):
            weights -= embedding.weight.numel() * embedding.weight.element_size()
    bandwidth = read_bandwidth(model.device)
    probes = [*(earlier or {}).get("read_gb_per_s_probes", []), bandwidth / 1e9]
    bandwidth = max(probes) * 1e9
    return {
        "weights_mb": weights / 1e6,
        "read_gb_per_s": bandwidth / 1e9,
        "read_gb_per_s_probes": probes,
        "floor_ms_per_token": 1000 * weights / bandwidth,
    }
