"""The core guarantee: every method emits exactly the token ids of plain greedy decoding ("ar").

Tiny random llama and qwen2 models; prompts with repeated segments so that prompt lookup drafts; custom drafters
that are always right (oracle), never right, or random, to drive the engine through full, zero and partial
acceptance in chains and trees, with EOS, max_new_tokens and stop conditions landing inside accepted drafts.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from equivalence import assert_same_ids_as_ar
from tiny import (
    VOCAB,
    CharTokenizer,
    OracleChainDrafter,
    OracleTreeDrafter,
    RandomTreeDrafter,
    WrongDrafter,
    drafter_for,
    random_tree,
    repetitive_prompt,
)

import draftwise
from draftwise.backend.transformers_patches import RowEfficientLinear, use_row_efficient_linear
from draftwise.decoding.drafter import Drafter, NoDrafter
from draftwise.decoding.engine import FinishReason, decode
from draftwise.decoding.stats import GenerationStats
from draftwise.decoding.tree import DraftTree

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

MODELS = ["llama", "qwen2"]
N_PROMPTS = 20


def _cases(seed: int):
    rng = random.Random(seed)
    return [(repetitive_prompt(rng), rng.randint(24, 40)) for _ in range(N_PROMPTS)]


CASES = {"llama": _cases(101), "qwen2": _cases(202)}

_REFERENCES: dict[tuple, list[int]] = {}


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen2):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}


def ar_ids(model, prompt, max_new_tokens):
    """Plain greedy decoding through the engine (memoised: models are fixed for the session)."""
    key = (id(model), tuple(prompt), max_new_tokens, model.generation_config.eos_token_id)
    if key not in _REFERENCES:
        result = draftwise.generate(model, None, prompt_ids=prompt, method="ar", max_new_tokens=max_new_tokens)
        _REFERENCES[key] = result.token_ids
    return _REFERENCES[key]


def run(model, prompt, method, max_new_tokens, **kwargs):
    return draftwise.generate(model, None, prompt_ids=prompt, method=method, max_new_tokens=max_new_tokens, **kwargs)


def check_stats(result):
    stats = result.stats
    assert stats.new_tokens == len(result.token_ids)
    assert sum(stats.accepted_lengths) == stats.new_tokens
    assert stats.steps == len(stats.accepted_lengths)
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    # Each step emits its accepted draft tokens plus one token of the target's own, unless an EOS, stop or length
    # limit cut it inside the accepted draft; the prefill emits one token and accepts none.
    assert stats.new_tokens - stats.steps <= stats.accepted_tokens <= stats.new_tokens - 1
    assert sum(stats.accepts_per_position) == stats.accepted_tokens
    assert all(0.0 <= rate <= 1.0 for rate in stats.acceptance_per_position)


# ----------------------------------------------------------------------------------------------------------------
# ar itself is plain greedy decoding


@pytest.mark.parametrize("kind", MODELS)
def test_ar_matches_transformers_generate(models, kind):
    model = models[kind]
    for prompt, max_new_tokens in CASES[kind][:5]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        result = run(model, prompt, "ar", max_new_tokens)
        assert result.token_ids == expected
        assert result.finish_reason == "length"
        assert result.prompt_ids == prompt
        assert result.stats.drafted_tokens == 0
        assert result.stats.steps == max_new_tokens


@pytest.mark.parametrize("kind", MODELS)
def test_outputs_are_not_degenerate(models, kind):
    """Guard on the fixtures: greedy outputs must vary, or the equivalence tests prove little."""
    distinct = set()
    for prompt, max_new_tokens in CASES[kind][:6]:
        ids = ar_ids(models[kind], prompt, max_new_tokens)
        assert len(ids) == max_new_tokens
        assert len(set(ids)) >= 3
        distinct.add(tuple(ids))
    assert len(distinct) >= 4


# ----------------------------------------------------------------------------------------------------------------
# prompt lookup


@pytest.mark.parametrize("index", range(N_PROMPTS))
@pytest.mark.parametrize("kind", MODELS)
def test_pld_matches_ar(models, kind, index):
    model = models[kind]
    prompt, max_new_tokens = CASES[kind][index]
    # (One prompt need not give prompt lookup anything to draft: test_pld_actually_drafts_and_accepts asks for it.)
    (result,) = assert_same_ids_as_ar(model, None, [prompt], "pld", max_new_tokens=max_new_tokens,
                                      expected=[ar_ids(model, prompt, max_new_tokens)], require_drafting=False)
    assert result.finish_reason == "length"
    assert result.method == "pld"
    check_stats(result)


@pytest.mark.parametrize("kind", MODELS)
def test_pld_actually_drafts_and_accepts(models, kind):
    model = models[kind]
    prompts, lengths = zip(*CASES[kind][:10])
    expected = [ar_ids(model, prompt, length) for prompt, length in zip(prompts, lengths)]
    assert_same_ids_as_ar(model, None, prompts, "pld", max_new_tokens=lengths, expected=expected)


@pytest.mark.parametrize("spec", ["pld:max_ngram=2,min_ngram=1", "pld:max_matches=1,draft_length=2,max_copy_length=4"])
def test_pld_options_match_ar(tiny_llama, spec):
    prompts, lengths = zip(*CASES["llama"][:4])
    expected = [ar_ids(tiny_llama, prompt, length) for prompt, length in zip(prompts, lengths)]
    assert_same_ids_as_ar(tiny_llama, None, prompts, spec, max_new_tokens=lengths, expected=expected)


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_pld_small_budgets_match_ar(tiny_qwen2, budget):
    prompts, lengths = zip(*CASES["qwen2"][:4])
    expected = [ar_ids(tiny_qwen2, prompt, length) for prompt, length in zip(prompts, lengths)]
    results = assert_same_ids_as_ar(tiny_qwen2, None, prompts, "pld", max_new_tokens=lengths, expected=expected,
                                    budget=budget, require_drafting=budget > 0)
    for result in results:
        assert result.stats.drafted_tokens <= budget * (result.stats.steps - 1)
        check_stats(result)


# ----------------------------------------------------------------------------------------------------------------
# oracle drafters: always right


ORACLE_CASES = range(8)


@pytest.mark.parametrize("index", ORACLE_CASES)
@pytest.mark.parametrize("kind", MODELS)
def test_oracle_chain(models, kind, index):
    model = models[kind]
    prompt, max_new_tokens = CASES[kind][index]
    reference = ar_ids(model, prompt, max_new_tokens)
    drafter = OracleChainDrafter(prompt, reference, length=6)
    (result,) = assert_same_ids_as_ar(model, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                      expected=[reference])
    assert result.finish_reason == "length"
    assert result.method == "oracle-chain"
    assert result.stats.mean_accepted_tokens > 3
    assert result.stats.acceptance_rate == 1.0
    assert drafter.resets == 1
    check_stats(result)
    # Every step but the last emits the whole chain plus the bonus token.
    assert all(length == 7 for length in result.stats.accepted_lengths[1:-1])


@pytest.mark.parametrize("index", ORACLE_CASES)
@pytest.mark.parametrize("kind", MODELS)
def test_oracle_tree_with_wrong_siblings(models, kind, index):
    model = models[kind]
    prompt, max_new_tokens = CASES[kind][index]
    reference = ar_ids(model, prompt, max_new_tokens)
    drafter = OracleTreeDrafter(prompt, reference, length=5, seed=index)
    (result,) = assert_same_ids_as_ar(model, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                      expected=[reference], budget=32)
    assert result.stats.mean_accepted_tokens > 3
    assert result.stats.drafted_tokens > result.stats.accepted_tokens  # the wrong branches were verified too
    check_stats(result)
    # The accepted paths were not the leading rows, so the cache had to compact.
    kept = [outcome.verification.kept_rows for outcome in drafter.outcomes]
    assert any(rows != list(range(len(rows))) for rows in kept)


# ----------------------------------------------------------------------------------------------------------------
# always wrong


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("kind", MODELS)
def test_always_wrong_drafter(models, kind, shape):
    model = models[kind]
    for index, (prompt, max_new_tokens) in enumerate(CASES[kind][:6]):
        reference = ar_ids(model, prompt, max_new_tokens)
        drafter = WrongDrafter(prompt, reference, shape=shape, seed=index)
        (result,) = assert_same_ids_as_ar(model, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                          expected=[reference], require_drafting=False)
        assert result.stats.accepted_tokens == 0
        assert result.stats.drafted_tokens > 0
        assert result.stats.mean_accepted_tokens == 1.0
        assert result.stats.steps == len(reference)
        check_stats(result)


# ----------------------------------------------------------------------------------------------------------------
# random trees


@pytest.mark.parametrize("kind", MODELS)
def test_random_tree_drafter(models, kind):
    model = models[kind]
    accepted = 0
    for index, (prompt, max_new_tokens) in enumerate(CASES[kind][:10]):
        reference = ar_ids(model, prompt, max_new_tokens)
        for seed in range(2):
            drafter = RandomTreeDrafter(prompt, reference, seed=1000 * index + seed)
            (result,) = assert_same_ids_as_ar(model, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                              expected=[reference], budget=12, require_drafting=False)
            check_stats(result)
            accepted += result.stats.accepted_tokens
    assert accepted > 0


class PureRandomDrafter(Drafter):
    """Random tokens in random shapes, knowing nothing."""

    name = "pure-random"

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self, context, budget):
        return random_tree(self.rng, self.rng.randint(0, budget), VOCAB)


@pytest.mark.parametrize("kind", MODELS)
def test_pure_random_drafter(models, kind):
    model = models[kind]
    for index, (prompt, max_new_tokens) in enumerate(CASES[kind][:5]):
        drafter = PureRandomDrafter(index)
        (result,) = assert_same_ids_as_ar(model, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                          expected=[ar_ids(model, prompt, max_new_tokens)], budget=16,
                                          require_drafting=False)
        check_stats(result)


class ScoredRandomDrafter(Drafter):
    """Scored trees (random acceptance estimates) mixing true and random paths: the engine trims them to the nodes
    that pay for their cost (DraftTree.best) before verifying."""

    name = "scored-random"

    def __init__(self, prompt, reference, seed):
        self.prompt_length = len(prompt)
        self.reference = reference
        self.rng = random.Random(seed)
        self.verified_sizes = []

    def propose(self, context, budget):
        start = len(context) - self.prompt_length
        paths = []
        for _ in range(self.rng.randint(0, 4)):
            length = self.rng.randint(1, 6)
            if self.rng.random() < 0.5:
                path = self.reference[start : start + length]
            else:
                path = [self.rng.randrange(VOCAB) for _ in range(length)]
            if path:
                paths.append(([self.rng.random() for _ in path], path))
        return DraftTree.from_scored_paths(paths, budget)

    def observe(self, outcome):
        self.verified_sizes.append(len(outcome.tree))


@pytest.mark.parametrize("kind", MODELS)
def test_scored_drafter_matches_ar(models, kind):
    model = models[kind]
    for index, (prompt, max_new_tokens) in enumerate(CASES[kind][:6]):
        reference = ar_ids(model, prompt, max_new_tokens)
        drafter = ScoredRandomDrafter(prompt, reference, seed=index)
        (result,) = assert_same_ids_as_ar(model, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                          expected=[reference], require_drafting=False)
        check_stats(result)


class OversizedDrafter(Drafter):
    """Ignores the budget (and proposes deeper than max_new_tokens allows): the engine must cut."""

    name = "oversized"

    def __init__(self, reference, prompt_length):
        self.reference = reference
        self.prompt_length = prompt_length
        self.sizes = []

    def propose(self, context, budget):
        start = len(context) - self.prompt_length
        truth = self.reference[start:]
        tree = DraftTree.from_paths([[(token + 1) % VOCAB for token in truth], truth + [1, 2, 3, 4, 5, 6]])
        return tree

    def observe(self, outcome):
        self.sizes.append((len(outcome.tree), outcome.tree.max_depth))


@pytest.mark.parametrize("budget", [1, 3, 40])
def test_engine_cuts_oversized_drafts(tiny_llama, budget):
    prompt, max_new_tokens = CASES["llama"][0]
    reference = ar_ids(tiny_llama, prompt, max_new_tokens)
    drafter = OversizedDrafter(reference, len(prompt))
    (result,) = assert_same_ids_as_ar(tiny_llama, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                      expected=[reference], budget=budget, require_drafting=False)
    assert all(size <= budget for size, _ in drafter.sizes)
    check_stats(result)


# ----------------------------------------------------------------------------------------------------------------
# EOS, max_new_tokens and stop conditions inside accepted drafts


def _eos_case(model, kind):
    """A prompt whose greedy output has a token that first appears well inside it, and that token's index."""
    for prompt, max_new_tokens in CASES[kind]:
        reference = ar_ids(model, prompt, max_new_tokens)
        for index in range(4, 9):  # inside the first 8-token oracle draft (which covers reference[1:9])
            token = reference[index]
            if token not in reference[:index]:
                return prompt, max_new_tokens, reference, index
    pytest.fail("no usable EOS position in the fixtures")


@pytest.mark.parametrize("kind", MODELS)
def test_eos_inside_accepted_draft(models, kind, monkeypatch):
    model = models[kind]
    prompt, max_new_tokens, reference, index = _eos_case(model, kind)
    eos = reference[index]
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    expected = reference[: index + 1]
    methods = {
        "ar": "ar",
        "pld": "pld",
        "oracle-chain": OracleChainDrafter(prompt, reference, length=8),
        "oracle-tree": OracleTreeDrafter(prompt, reference, length=8, seed=3),
    }
    for name, method in methods.items():
        result = run(model, prompt, method, max_new_tokens, budget=32)
        assert result.token_ids == expected, name
        assert result.token_ids[-1] == eos
        assert result.finish_reason == "eos", name
        check_stats(result)
    # The oracle's draft ran past the EOS: the engine cut the accepted tokens there.
    chain = methods["oracle-chain"]
    last = chain.outcomes[-1]
    before = len(chain.contexts[-2]) if len(chain.contexts) > 1 else len(prompt) + 1
    emitted_last = len(chain.contexts[-1]) - before
    assert chain.contexts[-1] == prompt + expected
    assert last.verification.accepted >= emitted_last
    assert len(last.verification.tokens) > emitted_last


@pytest.mark.parametrize("kind", MODELS)
def test_ignore_eos_runs_to_the_token_limit(models, kind, monkeypatch):
    """``ignore_eos``: the EOS inside the output is kept and generation goes on, every token plain decoding's."""
    model = models[kind]
    prompt, max_new_tokens, reference, index = _eos_case(model, kind)
    monkeypatch.setattr(model.generation_config, "eos_token_id", reference[index])
    for method in ("ar", "pld", OracleChainDrafter(prompt, reference, length=8)):
        result = draftwise.generate(model, CharTokenizer(), prompt_ids=prompt, method=method,
                                    max_new_tokens=max_new_tokens, ignore_eos=True)
        assert result.token_ids == reference and result.finish_reason == "length"


@pytest.mark.parametrize("kind", MODELS)
def test_eos_as_eos_list_and_first_token(models, kind, monkeypatch):
    model = models[kind]
    prompt, max_new_tokens = CASES[kind][0]
    reference = ar_ids(model, prompt, max_new_tokens)
    # The very first token is EOS (among several EOS ids): generation ends after the prefill.
    monkeypatch.setattr(model.generation_config, "eos_token_id", [(reference[0] + 1) % VOCAB, reference[0]])
    for method in ("ar", "pld", OracleChainDrafter(prompt, reference)):
        result = run(model, prompt, method, max_new_tokens)
        assert result.token_ids == reference[:1]
        assert result.finish_reason == "eos"
        assert result.stats.steps == 1


def test_eos_from_tokenizer(tiny_llama):
    prompt, max_new_tokens = CASES["llama"][1]
    reference = ar_ids(tiny_llama, prompt, max_new_tokens)
    index = next(i for i in range(3, len(reference)) if reference[i] not in reference[:i])

    class EosTokenizer(CharTokenizer):
        eos_token_id = reference[index]

    tokenizer = EosTokenizer()
    for method in ("ar", "pld", OracleChainDrafter(prompt, reference)):
        result = draftwise.generate(tiny_llama, tokenizer, prompt_ids=prompt, method=method,
                                    max_new_tokens=max_new_tokens)
        assert result.token_ids == reference[: index + 1]
        assert result.finish_reason == "eos"


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9, 13, 22, 30])
def test_max_new_tokens_inside_long_drafts(models, kind, max_new_tokens):
    model = models[kind]
    prompt, _ = CASES[kind][2]
    reference = ar_ids(model, prompt, 40)
    for drafter in (OracleChainDrafter(prompt, reference, length=8), OracleTreeDrafter(prompt, reference, 8, seed=1)):
        result = run(model, prompt, drafter, max_new_tokens, budget=32)
        assert result.token_ids == reference[:max_new_tokens]
        assert len(result.token_ids) == max_new_tokens
        assert result.finish_reason == "length"
        check_stats(result)
        # Drafts never reach past the last token that may be emitted.
        for outcome, context in zip(drafter.outcomes, drafter.contexts):
            emitted_before = len(context) - len(prompt) - len(outcome.verification.tokens)
            assert outcome.tree.max_depth <= max_new_tokens - emitted_before - 1
    assert ar_ids(model, prompt, max_new_tokens) == reference[:max_new_tokens]


def test_context_window_edge(tiny_llama):
    """Prompt + max_new_tokens exactly fills the context window; long oracle drafts near its end."""
    rng = random.Random(7)
    limit = tiny_llama.config.max_position_embeddings
    prompt = repetitive_prompt(rng, low=limit - 30, high=limit - 30)
    max_new_tokens = limit - len(prompt)
    reference = ar_ids(tiny_llama, prompt, max_new_tokens)
    assert len(reference) == max_new_tokens
    assert_same_ids_as_ar(tiny_llama, None, [prompt], "pld", max_new_tokens=max_new_tokens, expected=[reference],
                          budget=32, require_drafting=False)
    assert_same_ids_as_ar(tiny_llama, None, [prompt], OracleChainDrafter(prompt, reference, length=10),
                          max_new_tokens=max_new_tokens, expected=[reference], budget=32)
    result = run(tiny_llama, [token % VOCAB for token in range(limit - 1)], "pld", 1)
    assert len(result.token_ids) == 1


def _collect(events):
    events = list(events)
    tokens = [token for event in events for token in event.tokens]
    return events, tokens


@pytest.mark.parametrize("kind", MODELS)
def test_decode_is_stopped_callback(models, kind):
    model = models[kind]
    prompt, max_new_tokens = CASES[kind][3]
    reference = ar_ids(model, prompt, max_new_tokens)
    index = next(i for i in range(5, len(reference)) if reference[i] not in reference[:i])
    stop_token = reference[index]
    calls = []

    def is_stopped(output_ids):
        calls.append(len(output_ids))
        return output_ids[-1] == stop_token

    for drafter in (NoDrafter(), OracleChainDrafter(prompt, reference, length=8),
                    OracleTreeDrafter(prompt, reference, length=8, seed=5)):
        calls.clear()
        stats = GenerationStats()
        events, tokens = _collect(
            decode(model, prompt, drafter, max_new_tokens=max_new_tokens, is_stopped=is_stopped, budget=32,
                   stats=stats)
        )
        assert tokens == reference[: index + 1]
        assert events[-1].finish_reason == FinishReason.STOP
        assert all(event.finish_reason is None for event in events[:-1])
        assert all(event.tokens for event in events)
        # is_stopped saw every prefix of the output once, in order.
        assert calls == list(range(1, index + 2))
        assert stats.new_tokens == index + 1
        assert sum(stats.accepted_lengths) == index + 1


def test_decode_without_stop_conditions_runs_to_length(tiny_qwen2):
    prompt, max_new_tokens = CASES["qwen2"][4]
    reference = ar_ids(tiny_qwen2, prompt, max_new_tokens)
    events, tokens = _collect(decode(tiny_qwen2, prompt, NoDrafter(), max_new_tokens=max_new_tokens))
    assert tokens == reference
    assert len(events) == max_new_tokens
    assert events[-1].finish_reason == FinishReason.LENGTH


# ----------------------------------------------------------------------------------------------------------------
# text stop sequences with a one-character-per-token tokenizer


@pytest.mark.parametrize("kind", MODELS)
def test_stop_sequence_with_char_tokenizer(models, kind):
    model = models[kind]
    tokenizer = CharTokenizer()
    prompt, max_new_tokens = CASES[kind][5]
    reference = ar_ids(model, prompt, max_new_tokens)
    text = tokenizer.decode(reference)
    start = next(i for i in range(4, len(reference) - 2) if text.find(text[i : i + 2]) == i)
    stop = text[start : start + 2]
    for method in ("ar", "pld", OracleChainDrafter(prompt, reference, length=8)):
        result = draftwise.generate(model, tokenizer, prompt_ids=prompt, method=method,
                                    max_new_tokens=max_new_tokens, stop=[stop, "\x00never"])
        assert result.token_ids == reference[: start + 2]
        assert result.finish_reason == "stop"
        assert result.text == text[:start]


def test_stream_pieces_join_to_the_text(tiny_llama):
    tokenizer = CharTokenizer()
    prompt, max_new_tokens = CASES["llama"][6]
    reference = ar_ids(tiny_llama, prompt, max_new_tokens)
    text = tokenizer.decode(reference)
    stop = text[10:13]
    expected_end = text.find(stop)
    for method in ("ar", "pld", OracleChainDrafter(prompt, reference, length=8)):
        pieces = draftwise.stream(tiny_llama, tokenizer, prompt_ids=prompt, method=method,
                                  max_new_tokens=max_new_tokens, stop=stop)
        with pytest.raises(RuntimeError):
            pieces.result
        collected = list(pieces)
        assert "".join(collected) == text[:expected_end]
        # Text that could still begin the stop sequence is held back: no piece contains it.
        assert all(stop not in piece for piece in collected)
        assert pieces.result.text == text[:expected_end]
        assert pieces.result.finish_reason == "stop"


def test_stream_without_stop_matches_generate(tiny_qwen2):
    tokenizer = CharTokenizer()
    prompt, max_new_tokens = CASES["qwen2"][7]
    pieces = draftwise.stream(tiny_qwen2, tokenizer, prompt_ids=prompt, method="pld", max_new_tokens=max_new_tokens)
    text = "".join(pieces)
    assert pieces.result.token_ids == ar_ids(tiny_qwen2, prompt, max_new_tokens)
    assert text == pieces.result.text == tokenizer.decode(pieces.result.token_ids)


def test_string_prompt_goes_through_the_tokenizer(tiny_llama):
    tokenizer = CharTokenizer()
    prompt_text = "".join(chr(0x100 + token) for token in CASES["llama"][8][0])
    result = draftwise.generate(tiny_llama, tokenizer, prompt_text, method="pld", max_new_tokens=20)
    assert result.prompt_ids == CASES["llama"][8][0]
    assert result.token_ids == ar_ids(tiny_llama, CASES["llama"][8][0], 20)


# ----------------------------------------------------------------------------------------------------------------
# variants of the model: row-efficient linear layers, eager attention


@pytest.fixture(scope="module")
def row_efficient_llama(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    replaced = use_row_efficient_linear(model)
    assert replaced > 0
    assert use_row_efficient_linear(model) == 0  # idempotent
    assert isinstance(model.lm_head, RowEfficientLinear)
    return model


def test_row_efficient_linear_keeps_outputs(tiny_llama, row_efficient_llama):
    for index, (prompt, max_new_tokens) in enumerate(CASES["llama"][:5]):
        reference = ar_ids(tiny_llama, prompt, max_new_tokens)
        assert run(row_efficient_llama, prompt, "ar", max_new_tokens).token_ids == reference
        assert run(row_efficient_llama, prompt, "pld", max_new_tokens).token_ids == reference
        drafter = OracleTreeDrafter(prompt, reference, seed=index)
        assert run(row_efficient_llama, prompt, drafter, max_new_tokens, budget=32).token_ids == reference


def test_row_efficient_linear_matches_linear():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 24)
    fast = RowEfficientLinear(linear)
    # Every padded row count (see kernels.PAD_TO), both sides of each threshold, and a batch of several sequences.
    for shape in [(1, rows, 16) for rows in (*range(1, 18), 32, 33, 80)] + [(3, 4, 16), (2, 7, 16)]:
        inputs = torch.randn(*shape)
        output = fast(inputs)
        torch.testing.assert_close(output, linear(inputs), atol=1e-5, rtol=1e-5)
        # Strided outputs would slow every later op and push attention off its fused kernel.
        assert output.is_contiguous()
    assert fast.weight is linear.weight


@pytest.mark.parametrize("kind", MODELS)
def test_eager_attention_matches_ar(models, kind):
    model = copy.deepcopy(models[kind])
    model.set_attn_implementation("eager")
    for index, (prompt, max_new_tokens) in enumerate(CASES[kind][:4]):
        reference = ar_ids(models[kind], prompt, max_new_tokens)
        assert run(model, prompt, "ar", max_new_tokens).token_ids == reference
        assert run(model, prompt, "pld", max_new_tokens).token_ids == reference
        drafter = OracleTreeDrafter(prompt, reference, seed=index)
        assert run(model, prompt, drafter, max_new_tokens, budget=32).token_ids == reference


# ----------------------------------------------------------------------------------------------------------------
# what drafters are told


def test_drafter_observes_each_step(tiny_qwen2):
    prompt, max_new_tokens = CASES["qwen2"][9]
    reference = ar_ids(tiny_qwen2, prompt, max_new_tokens)
    drafter = OracleTreeDrafter(prompt, reference, length=4, seed=9)
    (result,) = assert_same_ids_as_ar(tiny_qwen2, None, [prompt], drafter, max_new_tokens=max_new_tokens,
                                      expected=[reference], budget=32)
    assert drafter.proposals == len(drafter.outcomes) == result.stats.steps - 1
    emitted = 1  # the prefill's token
    for outcome, context in zip(drafter.outcomes, drafter.contexts):
        tree, verification = outcome.tree, outcome.verification
        assert outcome.logits.shape == (len(tree) + 1, tiny_qwen2.config.vocab_size)
        assert outcome.logits.argmax(-1)[verification.kept_rows].tolist() == list(verification.tokens)
        emitted += len(verification.tokens)
        assert context == prompt + reference[:emitted]
    assert emitted == len(reference)


def test_step_outcome_context_is_a_snapshot(tiny_qwen2):
    prompt, max_new_tokens = CASES["qwen2"][9]
    reference = ar_ids(tiny_qwen2, prompt, max_new_tokens)
    drafter = OracleChainDrafter(prompt, reference, length=4)
    run(tiny_qwen2, prompt, drafter, max_new_tokens)
    assert len(drafter.outcomes) > 1
    assert [list(outcome.new_context) for outcome in drafter.outcomes] == drafter.contexts


def test_drafter_instance_is_reusable(tiny_llama):
    (p1, n1), (p2, n2) = CASES["llama"][10], CASES["llama"][11]
    r1, r2 = ar_ids(tiny_llama, p1, n1), ar_ids(tiny_llama, p2, n2)
    pld = draftwise.make_drafter("pld")
    assert_same_ids_as_ar(tiny_llama, None, [p1, p2, p1], pld, max_new_tokens=[n1, n2, n1], expected=[r1, r2, r1],
                          require_drafting=False)


# ---------------------------------------------------------------- every registered drafter, same guarantee

DRAFTER_METHODS = sorted(set(draftwise.METHODS) - {"ar"})


@pytest.mark.parametrize("method", DRAFTER_METHODS)
@pytest.mark.parametrize("kind", MODELS)
def test_every_method_matches_ar(models, kind, method):
    """One drafter instance over all prompts, so state learned across requests is exercised too."""
    model = models[kind]
    prompts, lengths = zip(*CASES[kind])
    expected = [ar_ids(model, prompt, length) for prompt, length in zip(prompts, lengths)]
    assert_same_ids_as_ar(model, None, prompts, drafter_for(method, model), max_new_tokens=lengths, expected=expected)


def test_grouped_query_sdpa_keeps_transformers_paths_exact(tiny_llama):
    """With draftwise's attention installed, transformers' own generate and prompt lookup (which build their own
    masks) still give plain greedy decoding's ids."""
    from draftwise.backend.transformers_patches import use_grouped_query_sdpa
    from draftwise.bench import measure_hf

    model = copy.deepcopy(tiny_llama)
    use_grouped_query_sdpa(model)
    for prompt, max_new_tokens in CASES["llama"][:5]:
        expected = ar_ids(tiny_llama, prompt, max_new_tokens)
        ours = draftwise.generate(model, None, prompt_ids=prompt, method="pld", max_new_tokens=max_new_tokens)
        assert ours.token_ids == expected
        for lookup in (False, True):
            ids = measure_hf(model, prompt, max_new_tokens, [], "hf-pld" if lookup else "hf").token_ids
            assert ids == expected
