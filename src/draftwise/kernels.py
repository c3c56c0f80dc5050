"""Linear layers that stay cheap for the few-row forwards of draft verification on a CPU.

On x86 CPUs, ``torch.nn.functional.linear`` on 2 to 32 rows goes through a small-batch GEMM path that can cost two
or three times the one-row matrix-vector product (on SmolLM2's 49152 x 576 output head: 7.8 ms for 1 row, 17.6 ms
for 2). Computing the same product as ``(W @ x.T).T`` keeps the weight as the streaming operand and costs 5 to 9 ms
for 2 to 8 rows. Verification forwards are exactly this shape, so the speed of small trees depends on it.

:func:`use_row_efficient_linear` swaps a model's ``nn.Linear`` modules for :class:`RowEfficientLinear`, which shares
the same parameters (the state dict is unchanged) and takes the faster route for few rows. It is applied by
:func:`draftwise.load_model` on CPU; on CUDA the stock kernels are already fine and nothing is swapped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Up to this many rows ``(W @ x.T).T`` beats ``F.linear`` for every layer shape measured.
FEW_ROWS = 4
#: Up to this many rows it still wins for wide output layers (the vocabulary head); above, GEMM is as fast.
SMALL_ROWS = 32


class RowEfficientLinear(nn.Module):
    """``nn.Linear`` replacement that computes few-row products as ``(W @ x.T).T``; same parameters, same results
    up to float rounding."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.numel() // self.in_features
        wide = self.out_features >= 8 * self.in_features
        if rows > (SMALL_ROWS if wide else FEW_ROWS) or inputs.device.type != "cpu":
            return F.linear(inputs, self.weight, self.bias)
        flat = inputs.reshape(rows, self.in_features)
        output = torch.mm(self.weight, flat.t()).t()
        if self.bias is not None:
            output = output + self.bias
        return output.reshape(*inputs.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_row_efficient_linear(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`RowEfficientLinear` sharing its parameters.

    Returns the number of modules replaced. Idempotent.
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            model.set_submodule(name, RowEfficientLinear(module))
            replaced += 1
    return replaced
