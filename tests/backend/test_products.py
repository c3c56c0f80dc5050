"""The library products' padding: at least the measured minimum row count, and few distinct shapes for oneDNN's
packed products (it keeps a compiled kernel per shape)."""

from __future__ import annotations

import pytest
import torch

from draftwise.backend.weights.products import Linear, packing_available


def test_packed_products_run_at_few_shapes_and_unpacked_at_the_rows_given():
    weight = torch.randn(24, 16)
    packed = Linear(weight, None, packed=False, min_rows=4)
    packed.packed = True  # (the rule alone: whether this CPU packs is beside the point)
    shapes = {packed.padded_rows(rows) for rows in range(1, 529)}
    assert len(shapes) <= 100
    for rows in range(1, 529):
        padded = packed.padded_rows(rows)
        assert 0 <= padded - max(rows, 4) < (1 if rows <= 64 else 8 if rows <= 128 else 16)
        assert padded <= 528
    plain = Linear(weight, None, packed=False, min_rows=4)
    assert [plain.padded_rows(rows) for rows in (1, 4, 17, 300)] == [4, 4, 17, 300]
    assert [packed.padded_rows(rows) for rows in (17, 41, 64, 65, 129)] == [17, 41, 64, 72, 144]


@pytest.mark.skipif(not packing_available(torch.float32, torch.device("cpu")), reason="oneDNN cannot pack here")
def test_a_padded_packed_product_gives_the_rows_asked_for():
    weight, bias = torch.randn(40, 32), torch.randn(40)
    product = Linear(weight, bias, packed=True, min_rows=2)
    inputs = torch.randn(37, 32)
    output = product(inputs)
    assert output.shape == (37, 40)
    torch.testing.assert_close(output, inputs @ weight.T + bias, atol=1e-4, rtol=1e-4)
