"""Weights in transparent huge pages: the same bytes in one buffer, and the same logits from the lean forward."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny_model

from draftwise.backend.forward.lean import LeanTarget
from draftwise.backend.rows import RowBlock
from draftwise.backend.weights import pages


def test_gathered_tensors_are_equal_contiguous_and_aligned(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(pages, "SETTING", setting)
    if not pages.huge_pages_available():
        pytest.skip("no madvise(MADV_HUGEPAGE) here")
    tensors = [torch.randn(3, 5, dtype=torch.bfloat16), torch.arange(7, dtype=torch.float32),
               torch.randn(4, 6).t(), torch.zeros(0, 3)]
    copies = pages.gather_in_huge_pages(tensors)
    assert copies is not None
    for tensor, copy in zip(tensors, copies):
        assert torch.equal(tensor, copy) and copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert copy.is_contiguous() and copy.data_ptr() % pages.ALIGNMENT == 0
    assert copies[0].data_ptr() % pages.HUGE_PAGE == 0
    starts = [copy.data_ptr() for copy in copies[:3]]
    assert starts == sorted(starts)  # in the given order, one after another
    copies[1].fill_(0)  # copies, not views of the originals
    assert tensors[1].sum() > 0


@pytest.mark.parametrize("setting", ["always madvise [never]\n", None])
def test_nothing_moves_where_the_system_has_no_huge_pages(setting, tmp_path, monkeypatch):
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(pages, "SETTING", path)
    assert not pages.huge_pages_available()
    assert pages.gather_in_huge_pages([torch.ones(4)]) is None
    target = LeanTarget(make_tiny_model("llama"))
    assert not target.huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_gives_the_same_bits_from_huge_pages(dtype):
    model = make_tiny_model("qwen2").to(dtype)
    placed, left = LeanTarget(model), LeanTarget(model, huge_pages=False)
    assert not left.huge_pages
    if not pages.huge_pages_available():
        pytest.skip("no transparent huge pages here")
    if all(product.packed for product in left.products):
        pytest.skip("every product's weights are packed by oneDNN here (no blocked kernel for this dtype): none move")
    assert placed.huge_pages
    prompt, rows = list(range(5, 40)), RowBlock((3, 4, 5, 6), (-1, 0, 0, 2))
    outputs = []
    for target in (placed, left):
        cache = target.new_cache(64)
        outputs.append((target.prefill([cache], [prompt]).logits[0], target.forward([cache], [rows]).logits[0]))
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
