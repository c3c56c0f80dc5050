"""Matrix products whose result for a row does not depend on how many rows share the product.

Matrix kernels pick their algorithm by the shape of the call: on these CPUs a one-row product (a matrix-vector
kernel) rounds differently from a two-row one, and some libraries switch again at 4, 8 or 12 rows. Each kind of
product here is padded to a *minimum row count* from which the machine's kernel gives every row the same bits
whatever the number of rows; that count is measured on the running machine (:mod:`draftwise.backend.calibration.invariance`).

On CPUs with oneDNN, the weights are also packed once into oneDNN's blocked layout (the layout PyTorch's own
compiler freezes weights into): a few-row product then streams the weights about twice as fast as ``F.linear``, and
its results do not depend on the row count beyond one row.

On CPUs with AVX-512 (float32) and avx512_bf16 (bfloat16), and on CPUs with AVX2 and FMA (both dtypes, the
weights widened to float32 in registers), the engine's own kernel (``blocked_linear`` of
:mod:`draftwise.backend.native`) replaces both: every output is one float32 sum in a fixed order whatever the call's
row count, so it needs no padding at all. With AVX-512 it is faster than oneDNN up to 64 rows and level with it at
128-256 rows in bfloat16, faster at every count in float32 (one row of all SmolLM2-135M's products: 1.8 ms against
4.1 ms in bfloat16, 3.4 ms against 15.4 ms in float32). With AVX2 (a two-core Zen 3, one 576 x 3072 product in
float32): 0.15 ms against oneDNN's 0.21 at one row, 0.32 against 0.52 at eight, 2.9 against 2.6 at 64, 10.6 against
8.2 at 256.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack weights of ``dtype`` on ``device`` (CPUs with oneDNN; not every CPU packs fp16)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.zeros(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def blocked_available(kernels: Any | None, weight: torch.Tensor) -> bool:
    """Whether the compiled ``kernels`` can run ``weight``'s products (float32 on CPUs with AVX-512 or AVX2 and FMA,
    bfloat16 with avx512_bf16 or AVX2 and FMA, and an even number of input features)."""
    if kernels is None or weight.device.type != "cpu":
        return False
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(weight.dtype)
    if name is None or name not in kernels.blocked_linear_dtypes():
        return False
    return weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0


class Linear:
    """``y = x @ weight.T + bias`` over rows, padded to at least :attr:`min_rows` rows.

    Args:
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or ``None``.
        packed: pack the weight for oneDNN (see :func:`packing_available`).
        min_rows: the row count from which the kernel is row-count invariant on this machine.
        fixed_rows: when set, every product runs at exactly ``min_rows`` rows (inputs padded to a multiple of it and
            computed ``min_rows`` rows at a time): for GPU libraries, whose kernel choice for a shape depends on the
            row count at every size, this is the one way a row's bits cannot depend on its neighbours.
        kernels: the compiled kernels' module: where they can run this weight (:func:`blocked_available`), products
            run through their ``blocked_linear`` (``packed`` is then ignored).
    """

    #: The block quantisation the weights are kept in (``None``: the model's float dtype).
    quantization: str | None = None

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, min_rows: int = 1, fixed_rows: bool = False,
        kernels: Any | None = None,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.blocked = kernels if blocked_available(kernels, weight) else None
        self.packed = packed and self.blocked is None
        if self.blocked is not None:
            self.weight = self.blocked.pack_blocked_weight(weight.contiguous())
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.min_rows = min_rows
        self.fixed_rows = fixed_rows

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.shape[0]
        product = self._bound_product()
        if self.fixed_rows and rows > self.min_rows:
            chunk = self.min_rows
            padded = -(-rows // chunk) * chunk
            if padded > rows:
                inputs = torch.cat([inputs, inputs.new_zeros(padded - rows, self.in_features)])
            output = torch.cat([product(part) for part in inputs.split(chunk)])
            return output[:rows]
        padded = self.padded_rows(rows)
        if padded > rows:
            inputs = torch.cat([inputs, inputs.new_zeros(padded - rows, self.in_features)])
        output = product(inputs)
        return output[:rows] if padded > rows else output

    def _bound_product(self) -> Any:
        """The product of one call's rows (called once per piece of a fixed-row call): where the weights must be
        prepared per call (dequantised), they are prepared here once for all pieces."""
        return self._product

    def padded_rows(self, rows: int) -> int:
        """The row count a product of ``rows`` rows runs at: at least :attr:`min_rows`; for oneDNN's packed
        products beyond 64 rows, a multiple of 8 (up to 128) or 16 (beyond). oneDNN keeps a compiled kernel for
        every shape it meets (~0.4 MB each): a server whose forwards took every row count up to a few hundred (prompt
        pieces beside decoding rows) grew by hundreds of MB. This bounds the shapes to about 100 a weight for at most
        a ninth more rows where a product costs nearly its row count (a row's bits do not depend on the padding, see
        :attr:`min_rows`); small products, a decoding step's, keep their exact count (41 rows padded to 48 took 22%
        longer on a two-core CPU)."""
        rows = max(rows, self.min_rows)
        if self.packed and rows > 64:
            granule = 8 if rows <= 128 else 16
            rows = -(-rows // granule) * granule
        return rows

    def _product(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None:
            if inputs.stride(-1) != 1:
                inputs = inputs.contiguous()
            return self.blocked.blocked_linear(inputs, self.weight, self.bias, self.out_features)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(inputs, self.weight, self.bias, "none", [], "")
        return F.linear(inputs, self.weight, self.bias)
