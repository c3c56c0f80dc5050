"""TreeKVCache: compaction of accepted rows, rollback, growth, and refusal of unsupported architectures."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny import make_tiny_model, tiny_config

from draftwise.backend.cache import TreeKVCache
from draftwise.backend.rows import RowBlock, attention_mask, position_ids
from draftwise.backend.target import TransformersTarget
from draftwise.decoding.tree import DraftTree
from draftwise.errors import UnsupportedModelError

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _inference_mode():
    # The engine drives the cache inside torch.inference_mode(); buffers made there can only be edited there.
    with torch.inference_mode():
        yield


# ----------------------------------------------------------------------------------------------------------------
# helpers


def model_forward(model, cache, ids, positions, mask):
    """One forward through the model's public interface with explicit mask and positions."""
    return model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
    ).logits


def prefill(model, tokens, capacity=256):
    cache = TransformersTarget(model).new_cache(capacity)
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        parents = [RowBlock.chain(tokens).parents]
        positions = position_ids(parents, [0], "cpu")
        logits = model_forward(model, cache, ids, positions, attention_mask(parents, [0], model.dtype, "cpu"))
    cache.keep(0, range(len(tokens)))
    return cache, logits[0]


def tree_forward(model, cache, root, tree):
    with torch.inference_mode():
        rows = torch.tensor([[root, *tree.tokens]])
        mask = attention_mask([tree.row_parents], cache.lengths, model.dtype, "cpu")
        positions = position_ids([tree.row_parents], cache.lengths, "cpu")
        return model_forward(model, cache, rows, positions, mask)[0]


def committed(cache, layer, length):
    return cache.layers[layer].keys[0, :, :length], cache.layers[layer].values[0, :, :length]


def assert_cache_matches(cache, reference, length):
    assert cache.lengths == [length]
    for layer in range(len(cache.layers)):
        keys, values = committed(cache, layer, length)
        ref_keys, ref_values = committed(reference, layer, length)
        torch.testing.assert_close(keys, ref_keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(values, ref_values, atol=ATOL, rtol=0)


PROMPT = [3, 17, 42, 8, 8, 61, 5, 23, 17, 42]


# ----------------------------------------------------------------------------------------------------------------
# with a model


def test_prefill_fills_the_cache(tiny_model):
    cache, _ = prefill(tiny_model, PROMPT)
    assert cache.lengths == [len(PROMPT)]
    assert cache.get_seq_length() == len(PROMPT)
    layer = cache.layers[0]
    config = tiny_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert layer.keys.shape[:2] == (1, config.num_key_value_heads)
    assert layer.keys.shape[-1] == head_dim
    # Non-zero keys where the prompt went.
    assert layer.keys[0, :, : len(PROMPT)].abs().sum(dim=(0, 2)).gt(0).all()


@pytest.mark.parametrize(
    "tree, accepted_nodes",
    [
        # A chain, fully accepted: rows 0..3 are a prefix, nothing moves.
        (DraftTree.chain([11, 12, 13]), [0, 1, 2]),
        # A chain, partially accepted.
        (DraftTree.chain([11, 12, 13]), [0]),
        # Nothing accepted: only the root stays.
        (DraftTree.chain([11, 12, 13]), []),
        # A tree whose accepted path is not a prefix of the rows: root -> node 2 -> node 4 -> node 5.
        (DraftTree((11, 12, 13, 14, 15, 16), (-1, 0, -1, 0, 2, 4)), [2, 4, 5]),
        # The second child of the root, then its first child.
        (DraftTree((20, 21, 22, 23), (-1, -1, 0, 1)), [1, 3]),
    ],
)
def test_keep_compacts_exactly_the_accepted_rows(tiny_model, tree, accepted_nodes):
    root = 30
    cache, _ = prefill(tiny_model, PROMPT)
    logits = tree_forward(tiny_model, cache, root, tree)
    # Until keep(), nothing is committed.
    assert cache.lengths == [len(PROMPT)]
    kept_rows = [0, *(node + 1 for node in accepted_nodes)]
    cache.keep(0, kept_rows)
    accepted_tokens = [tree.tokens[node] for node in accepted_nodes]

    sequence = PROMPT + [root, *accepted_tokens]
    reference, reference_logits = prefill(tiny_model, sequence)
    assert_cache_matches(cache, reference, len(sequence))
    # Tree attention gave each kept row the logits it has in the plain sequence.
    torch.testing.assert_close(
        logits[kept_rows], reference_logits[len(PROMPT) :], atol=1e-4, rtol=1e-4
    )


def test_two_steps_of_compaction(tiny_model):
    cache, _ = prefill(tiny_model, PROMPT)
    tree1 = DraftTree((11, 12, 13, 14), (-1, -1, 1, 0))
    tree_forward(tiny_model, cache, 30, tree1)
    cache.keep(0, [0, 2, 3])  # root, node 1 (12), node 2 (13)
    tree2 = DraftTree((40, 41, 42), (-1, -1, 1))
    tree_forward(tiny_model, cache, 50, tree2)
    cache.keep(0, [0, 2, 3])  # root 50, node 1 (41), node 2 (42)
    sequence = PROMPT + [30, 12, 13, 50, 41, 42]
    reference, _ = prefill(tiny_model, sequence)
    assert_cache_matches(cache, reference, len(sequence))


def test_truncate_rolls_back(tiny_model):
    cache, _ = prefill(tiny_model, PROMPT)
    tree_forward(tiny_model, cache, 30, DraftTree.chain([11, 12, 13]))
    cache.keep(0, [0, 1, 2, 3])
    assert cache.lengths == [len(PROMPT) + 4]
    cache.truncate(0, len(PROMPT) + 1)  # keep only the root 30
    assert cache.lengths == [len(PROMPT) + 1]
    assert cache.get_seq_length() == len(PROMPT) + 1
    logits = tree_forward(tiny_model, cache, 44, DraftTree.chain([45]))
    cache.keep(0, [0, 1])
    sequence = PROMPT + [30, 44, 45]
    reference, reference_logits = prefill(tiny_model, sequence)
    assert_cache_matches(cache, reference, len(sequence))
    torch.testing.assert_close(logits, reference_logits[-2:], atol=1e-4, rtol=1e-4)


def test_truncate_past_committed_raises(tiny_model):
    cache, _ = prefill(tiny_model, PROMPT)
    with pytest.raises(ValueError):
        cache.truncate(0, len(PROMPT) + 1)
    cache.truncate(0, 0)
    assert cache.lengths == [0]


def test_buffer_grows_when_capacity_is_exceeded(tiny_model):
    cache, small_logits = prefill(tiny_model, PROMPT, capacity=4)
    assert cache.layers[0].keys.shape[-2] >= len(PROMPT)
    assert cache.capacity >= len(PROMPT)
    before = cache.layers[0].keys.shape[-2]
    tree = DraftTree((11, 12, 13, 14, 15, 16, 17, 18), (-1, 0, 1, 2, -1, 4, 5, 6))
    logits = tree_forward(tiny_model, cache, 30, tree)
    for layer in cache.layers:
        assert layer.keys.shape[-2] >= len(PROMPT) + len(tree) + 1
        assert layer.keys.shape == layer.values.shape
    assert cache.layers[0].keys.shape[-2] > before
    cache.keep(0, [0, 5, 6, 7, 8])

    big, big_logits = prefill(tiny_model, PROMPT, capacity=256)
    torch.testing.assert_close(small_logits, big_logits, atol=1e-5, rtol=0)
    big_tree_logits = tree_forward(tiny_model, big, 30, tree)
    torch.testing.assert_close(logits, big_tree_logits, atol=1e-5, rtol=0)
    big.keep(0, [0, 5, 6, 7, 8])
    assert_cache_matches(cache, big, len(PROMPT) + 5)


# ----------------------------------------------------------------------------------------------------------------
# without a model: hand-made keys and values


def _rows(start, count, heads=2, dim=3):
    """Keys whose every entry is the row's number: row r of the forward has value start + r."""
    values = torch.arange(start, start + count, dtype=torch.float32)
    return values[None, None, :, None].expand(1, heads, count, dim).clone()


def test_keep_moves_rows_into_place_by_hand():
    cache = TreeKVCache(num_layers=2, capacity=16)
    for layer in range(2):
        cache.update(_rows(0, 5), -_rows(0, 5), layer)
    cache.keep(0, range(5))
    assert cache.lengths == [5]
    for layer in range(2):
        cache.update(_rows(100, 6), -_rows(100, 6), layer)
    cache.keep(0, [0, 2, 5])
    assert cache.lengths == [8]
    for layer in cache.layers:
        assert layer.keys[0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 100, 102, 105]
        assert layer.values[0, 1, :8, 2].tolist() == [0, -1, -2, -3, -4, -100, -102, -105]


def test_update_returns_committed_plus_new_rows():
    cache = TreeKVCache(num_layers=1, capacity=16)
    cache.update(_rows(0, 3), _rows(0, 3), 0)
    cache.keep(0, [0, 1, 2])
    keys, values = cache.update(_rows(10, 2), _rows(10, 2), 0)
    assert keys.shape[-2] == 5
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 10, 11]
    # Rejected rows are overwritten by the next forward.
    cache.keep(0, [0])
    keys, _ = cache.update(_rows(20, 2), _rows(20, 2), 0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 10, 20, 21]


def test_growth_by_hand_preserves_committed_rows():
    cache = TreeKVCache(num_layers=1, capacity=2)
    cache.update(_rows(0, 2), _rows(0, 2), 0)
    cache.keep(0, [0, 1])
    keys, _ = cache.update(_rows(7, 3), _rows(7, 3), 0)
    assert cache.layers[0].keys.shape[-2] >= 5
    assert cache.capacity >= 5
    assert keys[0, 0, :, 0].tolist() == [0, 1, 7, 8, 9]
    cache.keep(0, [2])
    assert cache.layers[0].keys[0, 0, :3, 0].tolist() == [0, 1, 9]


def test_batched_lengths_write_each_sequence_at_its_own_length():
    cache = TreeKVCache(num_layers=1, batch_size=2, capacity=8)
    first = torch.cat([_rows(0, 3), _rows(50, 3)])
    cache.update(first, first, 0)
    cache.keep(0, [0, 1, 2])
    cache.keep(1, [0])
    assert cache.lengths == [3, 1]
    second = torch.cat([_rows(10, 2), _rows(60, 2)])
    cache.update(second, second, 0)
    cache.keep(0, [1])
    cache.keep(1, [0, 1])
    keys = cache.layers[0].keys
    assert keys[0, 0, :4, 0].tolist() == [0, 1, 2, 11]
    assert keys[1, 0, :3, 0].tolist() == [50, 60, 61]


# ----------------------------------------------------------------------------------------------------------------
# unsupported architectures


def test_target_accepts_full_attention_models(tiny_llama, tiny_qwen2):
    for model in (tiny_llama, tiny_qwen2):
        cache = TransformersTarget(model).new_cache(8)
        assert len(cache.layers) == model.config.num_hidden_layers
        assert cache.lengths == [0]


def test_target_refuses_qwen2_sliding_window():
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert "sliding_attention" in config.layer_types
    model = transformers.Qwen2ForCausalLM(config)
    with pytest.raises(UnsupportedModelError, match="full attention"):
        TransformersTarget(model)


def test_target_refuses_mixed_layer_types():
    config = tiny_config("qwen2", layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    model = transformers.Qwen2ForCausalLM(config)
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        TransformersTarget(model)


def test_target_refuses_unknown_layer_types():
    config = tiny_config("llama")
    config.layer_types = ["full_attention", "linear_attention"]

    class FakeModel:
        pass

    fake = FakeModel()
    fake.config = config
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        TransformersTarget(fake)


def test_generate_refuses_sliding_window_model():
    import draftwise

    model = make_tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(UnsupportedModelError):
        draftwise.generate(model, None, prompt_ids=[1, 2, 3], method="ar", max_new_tokens=4)


def test_target_refuses_mistral_sliding_window():
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=4,
    )
    model = transformers.MistralForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError):
        TransformersTarget(model)
