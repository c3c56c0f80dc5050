"""The compiled ranking kernel (``top_tokens``): each row's k largest values best first, ties to the lower index,
in every dtype, at any width and row count; rows holding NaN are left to torch; and the functions built on it
(``greedy_choice``, ``top_tokens``) agree with torch's argmax and topk."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftwise.backend import native
from draftwise.decoding.verify import greedy_choice, top_tokens

pytestmark = pytest.mark.skipif(native.load_kernels(warn=False) is None,
                                reason=f"the kernels cannot be built here: {native.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(logits: torch.Tensor, k: int) -> list[list[int]]:
    """Each row's indices by descending value, equal values in index order."""
    return [sorted(range(len(row)), key=lambda index: (-row[index], index))[:k] for row in logits.float().tolist()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152])
def test_top_tokens_are_the_largest_values_best_first(dtype, width):
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=generator).to(dtype)
    for k in sorted({1, min(2, width), min(8, width), min(64, width)}):
        ranked = native.top_tokens(logits, k)
        assert ranked is not None and ranked.dtype == torch.int64 and ranked.shape == (5, k)
        if width <= 100:
            assert ranked.tolist() == reference(logits, k)
        else:  # (the reference sort is slow at a full vocabulary: compare values, then ties)
            expected = torch.topk(logits.float(), k, dim=-1)
            assert torch.equal(logits.float().gather(1, ranked), expected.values)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(-3, 3), min_size=1, max_size=70),
    k=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
)
def test_ties_go_to_the_lower_index(values, k, dtype):
    """Few distinct values: ties everywhere, infinities among them."""
    row = torch.tensor([[float("-inf") if value == -3 else float(value) for value in values]], dtype=dtype)
    k = min(k, row.shape[1])
    assert native.top_tokens(row, k).tolist() == reference(row, k)
    assert greedy_choice(row).tolist() == torch.argmax(row.float(), dim=-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_is_ranked_alone(dtype):
    """A row's ranking does not depend on the rows beside it (one thread or several)."""
    logits = torch.randn(37, 3000, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = native.top_tokens(logits, 4)
    for row in range(logits.shape[0]):
        assert torch.equal(native.top_tokens(logits[row : row + 1], 4), together[row : row + 1])


def test_rows_with_nan_are_left_to_torch():
    logits = torch.randn(3, 40)
    logits[1, 33] = float("nan")
    assert native.top_tokens(logits, 2) is None
    # torch's rule then: NaN above everything.
    assert greedy_choice(logits).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert top_tokens(logits, 1)[1].tolist() == [33]


def test_what_the_kernel_does_not_rank_falls_back_to_torch():
    logits = torch.randn(2, 100)
    assert native.top_tokens(logits, 65) is None
    assert top_tokens(logits, 65).tolist() == torch.topk(logits, 65, dim=-1).indices.tolist()
    assert native.top_tokens(logits.double(), 1) is None
    assert greedy_choice(logits.double()).tolist() == torch.argmax(logits, dim=-1).tolist()
    strided = logits[:, ::2]
    assert greedy_choice(strided).tolist() == torch.argmax(strided, dim=-1).tolist()
