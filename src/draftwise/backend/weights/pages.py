"""Weights in transparent huge pages, so that streaming them costs fewer address translations.

A one-row forward reads every weight once, in a few hundred short streams (each thread's share of one product). In
pages of 4 KB a 135M-parameter model in bfloat16 spans 66,000 pages, far more than the translation buffers hold: on
a two-core AMD EPYC (Zen 5) SmolLM2-135M's 120 layer products took 3.9-4.3 ms for one row from 4 KB pages and
3.5-3.6 ms from 2 MB pages (a whole one-row forward 5.6-6.3 ms against 5.3-5.6 ms) while its memory was fast, and
about as long either way while it was slow (both then wait on the bandwidth). The weights are copied one product at a time,
each original let go once copied, so loading holds one product twice at most. Linux hands out huge pages to
memory that asks for them (``madvise``) where ``/sys/kernel/mm/transparent_hugepage/enabled`` allows it, which is the
default; elsewhere the weights stay where they are. The bytes are the same either way: only where they live moves.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

#: Size of a transparent huge page on x86-64 and most arm64 kernels.
HUGE_PAGE = 2 << 20
#: Each tensor starts on a cache line.
ALIGNMENT = 64
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this system gives transparent huge pages to memory that asks for them (Linux, with the setting
    ``always`` or ``madvise``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed ``uint8`` CPU tensor of ``nbytes`` bytes that starts on a huge page and asks for huge pages (the
    tensor keeps its memory mapping alive)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def huge_page_views(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Uninitialised places for ``tensors`` (CPU tensors with ordinary strides; only their shapes and dtypes are
    read, no reference is kept) laid out one after another in one huge-page buffer, in the given order, each
    contiguous and starting on a cache line; ``None`` where the system has no transparent huge pages. A caller that
    fills them one at a time and lets each original go needs room for one original at a time, not all of them."""
    if not tensors or not huge_pages_available():
        return None
    offsets, total = [], 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise ValueError("only strided CPU tensors can be gathered")
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    buffer = huge_page_buffer(total)
    return [buffer[offset : offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            for tensor, offset in zip(tensors, offsets)]


def gather_in_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of ``tensors`` in the places :func:`huge_page_views` gives; ``None`` where the system has no
    transparent huge pages (then nothing is copied)."""
    copies = huge_page_views(tensors)
    if copies is not None:
        for tensor, copy in zip(tensors, copies):
            copy.copy_(tensor)
    return copies
