"""GGUF files of llama/qwen2 shape with random weights, written block by block (a model of 7B shape never exists as
floats): random bytes in each type's block layout with small finite float16 scales, float32 norms near one, qwen2's
query/key/value biases, and a byte-level tokenizer (256 byte tokens, two merges, filler tokens up to the vocabulary) that transformers and
llama.cpp both read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    architecture: str  # "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False


#: Llama-2-7B's and Qwen2.5-7B's shapes, and a tiny one of each family for fast tests.
LLAMA2_7B = Shape("llama", 4096, 32, 32, 32, 11008, 32000)
QWEN25_7B = Shape("qwen2", 3584, 28, 28, 4, 18944, 152064)
TINY_LLAMA = Shape("llama", 256, 2, 4, 2, 512, 384, tied=True)
TINY_QWEN = Shape("qwen2", 256, 2, 4, 2, 512, 384)


def random_blocks(type_name: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random bytes in ``type_name``'s block layout, with finite, small float16 scales (and offsets)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    block_inputs, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    count = in_features // block_inputs
    blocks = rng.integers(0, 256, size=(out_features, count, block_bytes), dtype=np.uint8)

    def halves() -> np.ndarray:
        return (rng.standard_normal((out_features, count)) * 0.01).astype(np.float16).view(np.uint8).reshape(
            out_features, count, 2)

    if type_name == "Q6_K":
        blocks[..., 208:210] = halves()
    else:
        blocks[..., 0:2] = halves()
        if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            blocks[..., 2:4] = halves()
    return blocks.reshape(out_features, -1)


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return [chr(code) for _, code in sorted(zip(printable, characters))]


def write_random_gguf(path: str | Path, shape: Shape, type_name: str = "Q4_0", head_type: str = "Q6_K",
                      seed: int = 0) -> Path:
    """A GGUF file of ``shape`` with random weights: every projection in ``type_name``, the output head in
    ``head_type`` (the token embedding in ``type_name``; no separate head where ``shape.tied``)."""
    import gguf

    path = Path(path)
    kinds = {name: gguf.GGMLQuantizationType[name] for name in {type_name, head_type}}
    head_dim = shape.hidden // shape.heads
    tensors: list[tuple[str, tuple[int, int] | tuple[int], str]] = [("token_embd.weight", (shape.vocab, shape.hidden),
                                                                      type_name)]
    for layer in range(shape.layers):
        prefix = f"blk.{layer}."
        tensors += [(prefix + "attn_norm.weight", (shape.hidden,), "F32"),
                    (prefix + "attn_q.weight", (shape.hidden, shape.hidden), type_name),
                    (prefix + "attn_k.weight", (shape.kv_heads * head_dim, shape.hidden), type_name),
                    (prefix + "attn_v.weight", (shape.kv_heads * head_dim, shape.hidden), type_name),
                    (prefix + "attn_output.weight", (shape.hidden, shape.hidden), type_name),
                    (prefix + "ffn_norm.weight", (shape.hidden,), "F32"),
                    (prefix + "ffn_gate.weight", (shape.intermediate, shape.hidden), type_name),
                    (prefix + "ffn_up.weight", (shape.intermediate, shape.hidden), type_name),
                    (prefix + "ffn_down.weight", (shape.hidden, shape.intermediate), type_name)]
        if shape.architecture == "qwen2":
            tensors += [(prefix + "attn_q.bias", (shape.hidden,), "F32"),
                        (prefix + "attn_k.bias", (shape.kv_heads * head_dim,), "F32"),
                        (prefix + "attn_v.bias", (shape.kv_heads * head_dim,), "F32")]
    tensors.append(("output_norm.weight", (shape.hidden,), "F32"))
    if not shape.tied:
        tensors.append(("output.weight", (shape.vocab, shape.hidden), head_type))

    writer = gguf.GGUFWriter(str(path), shape.architecture)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = _byte_tokens() + ["ab", "abc"] + [f"<t{index}>" for index in range(shape.vocab - 260)] + ["<s>", "</s>"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (shape.vocab - 2) + [3, 3])
    writer.add_token_scores([0.0] * shape.vocab)
    # (llama.cpp refuses a byte-level vocabulary without merges; transformers before 5.24 read a list of one merge
    # as the merge's characters)
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(shape.vocab - 2)
    writer.add_eos_token_id(shape.vocab - 1)

    def values(index: int, name: str, size: tuple[int, ...], kind: str) -> np.ndarray:
        if kind == "F32":
            rng = np.random.default_rng(seed * 100003 + index)
            scale = 0.02 if name.endswith("bias") else 0.1
            return (1.0 * (not name.endswith("bias")) + scale * rng.standard_normal(size)).astype(np.float32)
        return random_blocks(kind, size[0], size[1], seed=seed * 100003 + index)

    for name, size, kind in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, size, np.dtype(np.float32), int(np.prod(size)) * 4)
        else:
            block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[kinds[kind]]
            byte_shape = (size[0], size[1] // block_inputs * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), kinds[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, size, kind) in enumerate(tensors):
        writer.write_tensor_data(values(index, name, size, kind))
    writer.close()
    return path
