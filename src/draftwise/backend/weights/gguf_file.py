"""A GGUF file's weights for the lean forward, read from the file as it is.

:func:`file_model` builds the transformers model of a GGUF file without its weights (on the ``meta`` device, from the
file's config) and fills in only what the forward keeps in float32: norms, biases and any matrix in a float or
unsupported type. :func:`file_matrices` hands each projection its block-quantised matrix, decoded from the file only
when the forward packs it (so a loaded model never holds more than one product's decoded blocks beside the packed
ones), and :func:`file_embedding` the token embedding as the file's blocks, rows dequantised at lookup. No float copy of
the quantised matrices is ever made.

The same functions take a transformers model loaded (de-quantised) from the file too: each matrix is then checked to
dequantise to exactly the model's weight, which proves the name mapping and llama's query/key row order, and the
model is the float reference the quantised forward is compared with (docs/models.md states the tolerance).
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .fusing import product_modules
from .quantized import (FILE_TYPES, LAYOUT_VERSION, DequantizedRows, MatrixSource, PackedMatrix, QuantizedLinear,
                        QuantizedMatrix, decode, quantize)

#: A decoder layer's GGUF tensor names and the transformers projections they hold.
_PROJECTIONS = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
#: A decoder layer's GGUF norm names and the transformers modules they belong to.
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader: Any, name: str) -> Any:
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def _llama_row_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's query/key rows for its rotary kernel; transformers' loader undoes
    it (``LlamaTensorProcessor._reverse_permute_weights``): the same reordering, of row indices."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


class GGUFWeights:
    """The tensors of a GGUF file, memory-mapped (read once, shared by the functions of this module).

    Raises:
        ValueError: the file is not a readable GGUF file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            reader = GGUFReader(str(path))
        except Exception as error:  # the reader raises many kinds on a bad file
            raise ValueError(f"{path} is not a readable GGUF file: {error}") from error
        self.architecture = _field(reader, "general.architecture")
        self.heads = _field(reader, f"{self.architecture}.attention.head_count")
        self.kv_heads = _field(reader, f"{self.architecture}.attention.head_count_kv") or self.heads
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}

    def places(self, model: Any) -> Iterator[tuple[Any, Any, str, np.ndarray | None]]:
        """``(tensor, module, attribute, row order)`` for each tensor of the file and the parameter of ``model`` it
        holds (the row order llama's query/key rows need, else ``None``). A tied model's head takes the token
        embedding (an ``output.weight`` the file may still hold is left out, as transformers' loader does).

        Raises:
            ValueError: a tensor the model has no place for (a layer it lacks, a name this forward does not know).
        """
        layers = model.model.layers
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        tied = head.weight is embedding.weight
        for name, tensor in self.tensors.items():
            order = None
            if name == "token_embd.weight":
                module, attribute = embedding, "weight"
            elif name == "output.weight":
                if tied:
                    continue
                module, attribute = head, "weight"
            elif name == "output_norm.weight":
                module, attribute = model.model.norm, "weight"
            else:
                found = _LAYER_TENSOR.fullmatch(name)
                part = found.group(2) if found else None
                if part not in _PROJECTIONS and part not in _NORMS:
                    raise ValueError(f"{self.path.name}: tensor {name} has no place in a {self.architecture} model")
                index, attribute = int(found.group(1)), found.group(3)
                if index >= len(layers):
                    raise ValueError(f"{name}: the model has {len(layers)} layers")
                if part in _NORMS:
                    module = getattr(layers[index], _NORMS[part])
                else:
                    block, projection = _PROJECTIONS[part]
                    module = getattr(getattr(layers[index], block), projection)
                    if self.architecture == "llama" and part in ("attn_q", "attn_k"):
                        heads = self.heads if part == "attn_q" else self.kv_heads
                        order = _llama_row_order(tensor.data.shape[0], int(heads))
            yield tensor, module, attribute, order


def _source(source: str | os.PathLike | GGUFWeights) -> GGUFWeights:
    return source if isinstance(source, GGUFWeights) else GGUFWeights(source)


def _is_matrix(tensor: Any, module: Any, attribute: str) -> bool:
    """Whether the file's ``tensor`` runs as block-quantised rows here (a weight matrix in a type with a product)."""
    return attribute == "weight" and tensor.tensor_type.name in FILE_TYPES and module.weight.dim() == 2


def file_config(path: str | os.PathLike) -> Any:
    """The transformers config of the GGUF file at ``path`` (transformers' reading of its metadata).

    Raises:
        ValueError: the file has no config transformers can read.
    """
    from transformers import AutoConfig

    path = Path(path)
    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:  # transformers raises many kinds on a bad file
        raise ValueError(f"{path} is not a readable GGUF model: {error}") from error


def file_model(source: str | os.PathLike | GGUFWeights, config: Any, device: torch.device | str = "cpu") -> Any:
    """The transformers model of a GGUF file with only its float tensors loaded: built on the ``meta`` device from
    ``config`` (:func:`file_config`), then norms, biases and any matrix in a type without a quantised product here
    set from the file in float32 (gguf's de-quantisation, the values transformers' loader gives). The block-quantised
    matrices stay on ``meta``: :func:`file_matrices` and :func:`file_embedding` give the forward their blocks. The
    model cannot run its own forward; it carries the config, generation config and module structure. Its float
    tensors are put on ``device``.

    Raises:
        ValueError: the file does not fit the config.
    """
    from gguf import quants

    weights = _source(source)
    model = _empty_model(config)

    def floats() -> Iterator[tuple[Any, str, torch.Tensor]]:
        for tensor, module, attribute, order in weights.places(model):
            if _is_matrix(tensor, module, attribute):
                continue
            current = getattr(module, attribute)
            values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            if order is not None:
                values = values[order]
            if current is None or values.size != current.numel():
                raise ValueError(f"{tensor.name} has {values.size} values; the model's {type(module).__name__} "
                                 f"{attribute} {None if current is None else tuple(current.shape)}")
            yield (module, attribute,
                   torch.from_numpy(np.array(values, dtype=np.float32)).reshape(current.shape).to(device))

    return _with_floats(model, floats())


def _empty_model(config: Any) -> Any:
    """The float32 transformers model of ``config`` on the ``meta`` device (no memory for its weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _with_floats(model: Any, floats: Iterator[tuple[Any, str, torch.Tensor]]) -> Any:
    """``model`` with each ``(module, attribute, values)`` of ``floats`` set as a parameter, a tied head kept tied."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embedding.weight
    for module, attribute, values in floats:
        setattr(module, attribute, torch.nn.Parameter(values, requires_grad=False))
    if tied:
        head.weight = embedding.weight
    return model.eval()


class FileMatrices(Mapping):
    """The block-quantised matrices of a GGUF file by the model projection (or head) each belongs to, decoded when
    looked up (see :func:`file_matrices`)."""

    def __init__(self, entries: dict[Any, tuple[Any, np.ndarray | None]]) -> None:
        self._entries = entries

    def __getitem__(self, module: Any) -> QuantizedMatrix:
        tensor, order = self._entries[module]
        type_name = tensor.tensor_type.name
        matrix = decode(np.asarray(tensor.data), type_name)
        if order is not None:
            matrix = matrix.rows(order)
        weight = module.weight.detach()
        if tuple(weight.shape) != matrix.shape or (
                weight.device.type != "meta" and not torch.equal(matrix.dequantize(), weight.float().cpu())):
            raise ValueError(f"{tensor.name} ({type_name}) does not dequantise to the model's "
                             f"{type(module).__name__} weight of shape {tuple(weight.shape)}: the model was not loaded "
                             f"from this file")
        return matrix

    def __contains__(self, module: object) -> bool:
        return module in self._entries  # without decoding (Mapping's own would look the matrix up)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def file_matrices(model: Any, source: str | os.PathLike | GGUFWeights) -> FileMatrices:
    """The quantised matrices of a GGUF file, by the projection module of ``model`` (loaded from that file, with
    :func:`file_model` or de-quantised by transformers) each belongs to: the decoder layers' projections and the
    output head (the token embedding where the model ties them). Each is decoded from the file when looked up, and
    checked then against the module's weight where the model holds one. Matrices in float types (F32, F16, BF16) or
    types without a product here are left out.

    Raises:
        ValueError: the file does not match the model (a shape or a layer the model lacks; at lookup, a matrix that
            does not dequantise to the model's weight).
    """
    weights = _source(source)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    entries: dict[Any, tuple[Any, np.ndarray | None]] = {}
    for tensor, module, attribute, order in weights.places(model):
        if not _is_matrix(tensor, module, attribute):
            continue
        if module is embedding:
            if head.weight is not embedding.weight:
                continue  # an untied embedding is looked up, not multiplied: see file_embedding
            module = head
        entries[module] = (tensor, order)
    return FileMatrices(entries)


class RequantizedMatrices(Mapping):
    """A model's products quantised again to one of :data:`~draftwise.backend.weights.quantized.KINDS`, each when
    looked up (see :func:`requantized_matrices`)."""

    def __init__(self, file: FileMatrices, floats: list[Any], kind: str) -> None:
        self._file, self._floats, self._kind = file, floats, kind

    def __getitem__(self, module: Any) -> QuantizedMatrix:
        if module in self._file:
            weight = self._file[module].dequantize()
        elif module in self._floats:
            weight = module.weight.detach()
        else:
            raise KeyError(module)
        return decode(quantize(weight, self._kind), self._kind)

    def __contains__(self, module: object) -> bool:
        return module in self._file or module in self._floats

    def __iter__(self) -> Iterator[Any]:
        yield from self._file
        yield from self._floats

    def __len__(self) -> int:
        return len(self._file) + len(self._floats)


def requantized_matrices(model: Any, file: FileMatrices, kind: str) -> RequantizedMatrices:
    """The products of ``model`` (from :func:`file_model`) quantised to ``kind`` (``"q8_0"``/``"q4_0"``): the GGUF
    file's matrices (``file``) de-quantised to the float values transformers' loader gives, and the float matrices
    ``model`` holds (a file's F16 head, say), each quantised by the ``gguf`` package when looked up, one at a time:
    the matrices a float checkpoint of the same file quantised on load would get, with no float copy of the model."""
    floats = [module for module in model.modules()
              if isinstance(module, torch.nn.Linear) and module not in file and module.weight.device.type != "meta"]
    return RequantizedMatrices(file, floats, kind)


class EmbeddingRows:
    """A token embedding kept as a GGUF file's blocks (a copy of them: the file's mapping may close); the rows a
    forward looks up are dequantised then, to gguf's values (those of the float model's table).

    Args:
        blocks: ``(vocabulary, bytes per row)`` uint8, as the file holds them.
        type_name: their GGUF type (one of :data:`~draftwise.backend.weights.quantized.FILE_TYPES`).
        device: where the looked-up rows go.
    """

    #: Most rows a lookup takes from :attr:`recent` (a decoding step's few tokens); more are decoded together.
    RECENT_LOOKUP = 16
    #: Bytes of dequantised rows kept in :attr:`recent`.
    RECENT_BYTES = 16 << 20

    def __init__(self, blocks: np.ndarray, type_name: str, device: torch.device | str = "cpu") -> None:
        self.blocks = np.array(blocks, dtype=np.uint8)
        self.type_name = type_name
        self.device = torch.device(device)
        self.width = decode(self.blocks[:1], type_name).shape[1]
        #: The rows looked up last, by token, least recently used first: a decoding step looks up a few tokens,
        #: which text repeats, and decoding one row through the blocks' general path costs more than a small model's
        #: product (0.1 ms of SmolLM2-135M's 3 ms step).
        self.recent: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._recent_limit = max(1, self.RECENT_BYTES // (4 * self.width))

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.width

    def to(self, device: torch.device | str) -> EmbeddingRows | DequantizedRows:
        """These rows for a forward on ``device``: themselves on the CPU; elsewhere the blocks decoded onto the
        device once (:class:`~draftwise.backend.weights.quantized.DequantizedRows`), looked up without the host."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        return DequantizedRows(decode(self.blocks, self.type_name), device)

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).tolist()
        if len(ids) > self.RECENT_LOOKUP:
            rows = self._decode(ids)
        else:
            missing = [token for token in dict.fromkeys(ids) if token not in self.recent]
            if missing:
                for token, row in zip(missing, self._decode(missing)):
                    self.recent[token] = row
            for token in ids:
                self.recent.move_to_end(token)
            rows = torch.stack([self.recent[token] for token in ids])
            while len(self.recent) > self._recent_limit:
                self.recent.popitem(last=False)
        return rows.reshape(*tokens.shape, self.width).to(self.device)

    def _decode(self, ids: list[int]) -> torch.Tensor:
        return decode(self.blocks[np.asarray(ids, dtype=np.int64)], self.type_name).dequantize()


def file_embedding(model: Any, source: str | os.PathLike | GGUFWeights) -> EmbeddingRows | None:
    """The token embedding of a GGUF file as its blocks (:class:`EmbeddingRows`) where ``model`` (from
    :func:`file_model`) does not hold it in float; ``None`` where it does."""
    embedding = model.get_input_embeddings()
    if embedding.weight.device.type != "meta":
        return None
    tensor = _source(source).tensors["token_embd.weight"]
    return EmbeddingRows(np.asarray(tensor.data), tensor.tensor_type.name)


class PackedProducts(MatrixSource):
    """A model's products as packed before (:func:`save_packed`), by the model modules fused into each."""

    def __init__(self, model: Any, products: dict[str, PackedMatrix]) -> None:
        self._products = products
        self._keys = {module: key for key, modules in product_modules(model).items() if key in products
                      for module in modules}

    def __contains__(self, module: object) -> bool:
        return module in self._keys

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def packed(self, modules: tuple[Any, ...]) -> PackedMatrix:
        keys = {self._keys[module] for module in modules}
        if len(keys) != 1:
            raise ValueError(f"the packed products hold no product of exactly these modules: {sorted(keys)}")
        return self._products.pop(keys.pop())  # handed over once: the product keeps it, this source lets it go


def save_packed(path: str | os.PathLike, model: Any, target: Any, embedding: EmbeddingRows | None) -> None:
    """Write what a GGUF file's model needs to load again without reading the file: ``model``'s float parameters
    (those not on ``meta``), ``target``'s block-quantised products as packed, and the token embedding's blocks
    (one safetensors file, written whole or not at all)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {f"float/{name}": parameter.detach().contiguous()
                                        for name, parameter in model.named_parameters()
                                        if parameter.device.type != "meta"}
    products = {}
    for (key, _), product in zip(product_modules(model).items(), target.products):
        if isinstance(product, QuantizedLinear):
            tensors[f"packed/{key}"] = product.weight  # (views of one huge-page buffer, apart: safetensors takes them)
            products[key] = {"format": product.format, "shape": [product.out_features, product.in_features],
                             "types": list(product.types)}
    header = {"layout": LAYOUT_VERSION, "products": products}
    if embedding is not None:
        tensors["embedding"] = torch.from_numpy(embedding.blocks)
        header["embedding"] = embedding.type_name
    path = Path(path)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(scratch), metadata={"draftwise": json.dumps(header)})
    os.replace(scratch, path)


def load_packed(path: str | os.PathLike, config: Any) -> tuple[Any, PackedProducts, EmbeddingRows | None]:
    """A model saved by :func:`save_packed`: the model of ``config`` on ``meta`` with its float parameters set, its
    packed products and its token embedding's blocks (``None`` where the model holds the table in float).

    Raises:
        ValueError: a file of another packed layout, or one that does not fit ``config``.
    """
    from safetensors import safe_open

    model = _empty_model(config)
    with safe_open(str(path), framework="pt") as handle:
        header = json.loads((handle.metadata() or {}).get("draftwise", "{}"))
        if header.get("layout") != LAYOUT_VERSION:
            raise ValueError(f"{path} holds products packed in another layout")

        def floats() -> Iterator[tuple[Any, str, torch.Tensor]]:
            for key in handle.keys():
                if not key.startswith("float/"):
                    continue
                name = key.removeprefix("float/")
                owner, _, attribute = name.rpartition(".")
                module = model.get_submodule(owner)
                current = getattr(module, attribute)
                values = handle.get_tensor(key).clone()  # (a view of the mapped file would keep all of it mapped)
                if current is None or tuple(current.shape) != tuple(values.shape):
                    raise ValueError(f"{path}: {name} does not fit the model")
                yield module, attribute, values

        _with_floats(model, floats())
        products = {key: PackedMatrix(handle.get_tensor(f"packed/{key}"), info["format"], tuple(info["shape"]),
                                      tuple(info["types"]))
                    for key, info in header["products"].items()}
        embedding = None
        if "embedding" in header:
            embedding = EmbeddingRows(handle.get_tensor("embedding").numpy(), header["embedding"])
    return model, PackedProducts(model, products), embedding
