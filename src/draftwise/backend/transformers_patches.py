"""Linear layers that stay cheap for the few-row forwards of draft verification on a CPU.

On x86 CPUs, ``torch.nn.functional.linear`` on 2 to 32 rows goes through a small-batch GEMM path that can cost two
or three times the one-row matrix-vector product (on SmolLM2's 49152 x 576 output head: 7.8 ms for 1 row, 17.6 ms
for 2). Computing the same product as ``(W @ x.T).T`` keeps the weight as the streaming operand and costs 5 to 9 ms
for 2 to 8 rows. Verification forwards are exactly this shape, so the speed of small trees depends on it.

Two details matter as much as the kernel choice. The transposed product must be made contiguous again: left strided,
every later elementwise op runs on strided memory and ``scaled_dot_product_attention`` falls back from its fused
kernel to the unfused one (a 2-row SmolLM2 forward at 1500 cached tokens cost 90 ms instead of 52). And a single row
is best computed as two: the matrix-vector kernel streams weights from memory at about 13 GB/s on this kind of
machine, the two-row product at about 22 GB/s (a one-row SmolLM2 forward: 56 ms -> 47 ms). For the same reason some
row counts are padded up: MKL's skinny products cost about one extra row's weight pass per row beyond a multiple of 8
(a whole SmolLM2's products: 4 rows 29 ms, 7 rows 53, 8 rows 48, 12 rows 84, 16 rows 66), so 3 rows run as 4, 7 as 8
and 10 to 15 as 16 (a 3-row forward: 59 ms -> 51 ms; 12 rows: 97 ms -> 90 ms).

:func:`use_row_efficient_linear` swaps a model's ``nn.Linear`` modules for :class:`RowEfficientLinear`, which shares
the same parameters (the state dict is unchanged) and takes the faster route for few rows. It is applied by
:func:`draftwise.load_model` on CPU; on CUDA the stock kernels are already fine and nothing is swapped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Up to this many rows ``(W @ x.T).T`` (with :data:`PAD_TO`) gave the fastest whole SmolLM2 forwards (thresholds 8, 16
#: and 32 measured; 16 won at 9 to 16 rows and tied below).
FEW_ROWS = 16
#: Up to this many rows it still wins for wide output layers (the vocabulary head); above, GEMM is as fast.
SMALL_ROWS = 32
#: Row counts computed as a larger count (copies of the first row fill the gap): cheaper whole, measured.
PAD_TO = {1: 2, 3: 4, 7: 8, 10: 16, 11: 16, 12: 16, 13: 16, 14: 16, 15: 16}


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
        padded = PAD_TO.get(rows, rows)
        if padded != rows:
            # One row runs as two (the matrix-vector kernel streams weights slower than the two-row product), and
            # a few other counts as the next multiple of 8 or 4: see the module notes.
            flat = torch.cat([flat, flat[:1].expand(padded - rows, -1)])
        # Contiguous rows: a transposed result would make every later elementwise op and attention strided (and
        # push scaled_dot_product_attention off its fused kernel), costing more than this copy.
        output = torch.mm(self.weight, flat.t())[:, :rows].t().contiguous()
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


#: Name under which :func:`grouped_query_sdpa` is registered with transformers' ``AttentionInterface``.
GQA_SDPA = "draftwise_gqa_sdpa"


def grouped_query_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention that keeps grouped key/value heads grouped, with or without a mask.

    transformers' own ``sdpa`` copies every key/value head once per query group (``repeat_kv``) whenever a mask is
    given and more than one row is queried, which is every tree verification: at 1000 cached tokens that copy costs
    more than the attention itself. ``enable_gqa`` lets PyTorch read the shared heads in place.
    """
    groups = query.shape[1] // key.shape[1]
    rows, keys = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :keys]
    elif causal and rows > 1 and rows != keys:
        # SDPA's is_causal aligns the diagonal top-left; with cached keys the queries are the last rows.
        attention_mask = torch.ones(rows, keys, dtype=torch.bool, device=query.device).tril(keys - rows)
    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        is_causal=causal and attention_mask is None and rows > 1,
        enable_gqa=groups > 1,
    )
    return output.transpose(1, 2).contiguous(), None


def use_grouped_query_sdpa(model: nn.Module) -> None:
    """Run ``model``'s attention through :func:`grouped_query_sdpa` (registered with transformers' public
    ``AttentionInterface`` under :data:`GQA_SDPA`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, grouped_query_sdpa)
    # transformers builds masks for its own calls (generate, prompt lookup) per attention name: SDPA's masks.
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
