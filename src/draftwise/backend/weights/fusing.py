"""The lean forward's weights, taken once from a transformers model: each decoder layer's query, key and value
projections fused into one product and its gate and up projections into another, so that a layer runs four
products instead of seven.

How a product's weights are stored and multiplied (the compiled blocked kernel, oneDNN's packed layout,
``F.linear``) is :mod:`~draftwise.backend.weights.products`'s business, and where their bytes live
:mod:`~draftwise.backend.weights.pages`'s: a new weight format plugs in there, behind the same ``make_product``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .pages import huge_page_views
from .products import Linear

#: Builds a product from a weight, an optional bias and the model's projections fused into it (one module, or
#: several stacked by outputs), whose own stored form (a file's quantised blocks) may be used instead of the weight.
ProductFactory = Callable[[torch.Tensor, "torch.Tensor | None", "tuple[Any, ...]"], Linear]


@dataclass
class LeanLayer:
    """One decoder layer's weights."""

    attention_norm: torch.Tensor
    qkv: Linear
    output: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear

    @property
    def products(self) -> tuple[Linear, Linear, Linear, Linear]:
        """The layer's products in the order a forward runs them."""
        return self.qkv, self.output, self.gate_up, self.down


def _joined_weight(projections: tuple[Any, ...]) -> torch.Tensor:
    """The weights of ``projections`` stacked by outputs (a lone projection's own weight, not a copy)."""
    if len(projections) == 1:
        return projections[0].weight.detach()
    return torch.cat([projection.weight.detach() for projection in projections])


def _joined_bias(projections: tuple[Any, ...]) -> torch.Tensor | None:
    """The biases of ``projections`` side by side (zeros for those without), or ``None`` when none has one."""
    template = next((projection.bias for projection in projections if projection.bias is not None), None)
    if template is None:
        return None
    if len(projections) == 1:
        return template.detach()
    return torch.cat([
        projection.bias.detach() if projection.bias is not None else template.new_zeros(projection.out_features)
        for projection in projections
    ])


def layer_projections(layer: Any) -> dict[str, tuple[Any, ...]]:
    """A llama/qwen2 decoder layer's projections as its four products fuse them, by the products' names."""
    attention, mlp = layer.self_attn, layer.mlp
    return {"qkv": (attention.q_proj, attention.k_proj, attention.v_proj), "output": (attention.o_proj,),
            "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}


def product_modules(model: Any) -> dict[str, tuple[Any, ...]]:
    """Every product of the lean forward of ``model`` by name (``layers.3.gate_up``, ``head``), in the order a
    forward runs them (:func:`all_products`'s), with the model modules fused into it."""
    products = {f"layers.{index}.{name}": modules for index, layer in enumerate(model.model.layers)
                for name, modules in layer_projections(layer).items()}
    products["head"] = (model.get_output_embeddings(),)
    return products


def fuse_layer(layer: Any, make_product: ProductFactory) -> LeanLayer:
    """``layer``'s weights (a llama/qwen2 decoder layer of transformers) with its products made by
    ``make_product``."""
    products = {name: make_product(_joined_weight(modules), _joined_bias(modules), modules)
                for name, modules in layer_projections(layer).items()}
    return LeanLayer(attention_norm=layer.input_layernorm.weight.detach(),
                     mlp_norm=layer.post_attention_layernorm.weight.detach(), **products)


def all_products(layers: list[LeanLayer], head: Linear) -> Iterator[Linear]:
    """Every product of a forward, in the order it runs them: each layer's four, then the output head."""
    for layer in layers:
        yield from layer.products
    yield head


def place_in_huge_pages(products: list[Linear], device: torch.device) -> bool:
    """Move the weights of ``products`` into one buffer of transparent huge pages, in the order given (a forward's
    reading order); False where the system has none, or off CPUs. oneDNN's packed weights stay where oneDNN put
    them."""
    if device.type != "cpu":
        return False
    movable = [product for product in products if not product.packed]
    places = huge_page_views([product.weight for product in movable])
    if places is None:
        return False
    for product, place in zip(movable, places):
        place.copy_(product.weight)
        product.weight = place  # the original goes now (where nothing else holds it), not after the last copy
    return True
