"""The draft-model drafter: plain greedy decoding's ids with chains and dynamic trees on every backend, a draft cache
that always equals a fresh prefill of the context, exact sampling through the draft distribution, clear refusals."""

from __future__ import annotations

import random

import pytest
import torch
from distributions import check_speculative_sampling
from equivalence import assert_same_ids_as_ar
from tiny import make_tiny_model, noisy_copy, repetitive_prompt

import draftwise
from draftwise.backend.forward.lean import LeanTarget
from draftwise.decoding.sampling import SamplingParams
from draftwise.drafters.draft_model import DraftModelDrafter, TreeGrowth, pick_children
from draftwise.drafters.stores.acceptance import AcceptanceTracker
from draftwise.errors import UnsupportedModelError, UnsupportedOptionError

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")


def _model_of(target):
    return target.model if isinstance(target, LeanTarget) else target


@pytest.mark.parametrize("width", [1, 2, 4])
def test_greedy_ids_equal_ar_with_chains_and_trees(target, width):
    drafter = DraftModelDrafter(model=noisy_copy(_model_of(target), noise=0.05), width=width, depth=5, adaptive=False)
    rng = random.Random(width)
    prompts = [repetitive_prompt(rng, low=10, high=80) for _ in range(4)]
    results = assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=40)
    assert all(result.stats.draft_time_s > 0 for result in results)
    accepted = sum(result.stats.accepted_tokens for result in results)
    drafted = sum(result.stats.drafted_tokens for result in results)
    assert width == 1 or drafted > accepted


@pytest.mark.parametrize("width", [1, 2])
def test_batched_sequences_get_their_batch_1_ids(target, width):
    drafter = DraftModelDrafter(model=noisy_copy(_model_of(target), noise=0.05), width=width, depth=4, adaptive=False)
    rng = random.Random(5)
    batch = [repetitive_prompt(rng, low=5, high=60) for _ in range(5)]
    assert_same_ids_as_ar(target, None, batch, drafter, max_new_tokens=30, max_batch=3)


@pytest.mark.parametrize("width", [1, 3])
def test_draft_cache_equals_a_fresh_prefill_after_any_accept_pattern(width):
    """Contexts that grow by accepted drafts, by tokens the draft never proposed, and that change behind the cache
    (a new request sharing a prefix): the draft's logits always equal those of a fresh prefill (chains keep their
    drafted rows in the draft cache, trees roll them back)."""
    target = LeanTarget(make_tiny_model("llama", seed=0))
    draft_model = noisy_copy(target.model, noise=0.1)
    drafter = DraftModelDrafter(model=draft_model, width=width, depth=4, adaptive=False)
    drafter.attach(_setup(target))
    rng = random.Random(0)
    context = repetitive_prompt(rng, low=20, high=40)
    for step in range(40):
        tree = drafter.propose(tuple(context), 12)
        kind = rng.random()
        if kind < 0.5 and len(tree):  # accept a path of the draft, then the target's own token
            node = rng.randrange(len(tree))
            context += [tree.tokens[n] for n in tree.path_to(node)] + [rng.randrange(96)]
        elif kind < 0.85:  # everything rejected
            context += [rng.randrange(96)]
        else:  # the context changes behind the cache
            context = context[: rng.randrange(1, len(context))] + [rng.randrange(96) for _ in range(rng.randint(1, 5))]
        fresh = DraftModelDrafter(model=draft_model)
        fresh.attach(_setup(target))
        torch.testing.assert_close(drafter.sync_logits(context), fresh.sync_logits(context), atol=1e-4, rtol=0)


def _setup(target):
    from draftwise.decoding.drafter import SequenceSetup
    from draftwise.decoding.latency import LatencyModel

    return SequenceSetup(target, None, SamplingParams(), LatencyModel())


def test_refusals():
    target = make_tiny_model("llama", seed=0)
    other_vocabulary = make_tiny_model("llama", seed=1, vocab=128)
    with pytest.raises(UnsupportedModelError, match="tokenizer"):
        draftwise.generate(target, None, prompt_ids=[1, 2, 3], method=DraftModelDrafter(model=other_vocabulary),
                           max_new_tokens=4)
    with pytest.raises(UnsupportedOptionError, match="draft model"):
        draftwise.make_drafter("draft")
    with pytest.raises(UnsupportedOptionError, match="width"):
        draftwise.make_drafter("draft:model=x,width=0")


def test_sibling_scores_keep_the_draw_order():
    """Sampled siblings are numbered in draw order and never score above an earlier draw, so the engine's cut keeps
    a prefix of the draws (what recursive rejection without replacement needs)."""
    q = torch.tensor([0.05, 0.5, 0.1, 0.35])
    growth = TreeGrowth(AcceptanceTracker())
    generator = torch.Generator().manual_seed(0)
    nodes = growth.add_children(-1, q, 4, greedy=False, generator=generator)
    scores = [growth.scores[node] for node in nodes]
    assert scores == sorted(scores, reverse=True)
    assert pick_children(torch.tensor([0.0, 1.0, 0.0]), 3, greedy=False, generator=generator) == [1]


SMALL_VOCAB = 24
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]


@pytest.mark.parametrize("width", [1, 3])
def test_sampling_keeps_the_target_distribution(width):
    """Chain rejection sampling (width 1) and recursive rejection over sampled siblings (width 3): the first three
    tokens' marginals equal plain sampling's (chi-square over 1500 draws)."""
    model = make_tiny_model("llama", seed=3, vocab=SMALL_VOCAB, scale=1.5)
    drafter = DraftModelDrafter(model=noisy_copy(model, noise=0.5, seed=4), width=width, depth=3, adaptive=False)
    accepted = check_speculative_sampling(model, model, PROMPT, drafter, {"temperature": 0.8, "top_p": 0.95})
    assert accepted > 100


@pytest.mark.parametrize("width", [1, 2])
def test_a_draft_head_over_part_of_the_vocabulary_keeps_greedy_ids(width):
    """A draft scoring only the 16 lowest ids and the context's tokens: plain greedy decoding's ids, drafts still
    accepted; a greedy draft's distribution stays over those tokens, a sampled one's is the whole vocabulary's,
    zero outside them."""
    target = LeanTarget(make_tiny_model("llama", seed=0))
    drafter = DraftModelDrafter(model=noisy_copy(target.model, noise=0.05), width=width, depth=4, adaptive=False,
                                vocab=16)
    rng = random.Random(7)
    prompts = [repetitive_prompt(rng, low=10, high=60) for _ in range(3)]
    assert_same_ids_as_ar(target, None, prompts, drafter, max_new_tokens=30)
    head = drafter._shared["head"]
    assert head is not None and head.size == 16 and head.extra
    logits = torch.randn(len(head.ids))
    q, ids = drafter._distribution(logits)
    assert torch.equal(ids, head.ids) and q.shape == logits.shape
    drafter._sampling = SamplingParams(temperature=0.8)
    q, ids = drafter._distribution(logits)
    assert ids is None
    outside = torch.ones(q.shape[-1], dtype=torch.bool)
    outside[head.ids] = False
    assert q.shape[-1] == target.model.config.vocab_size and float(q[outside].sum()) == 0.0
    torch.testing.assert_close(float(q.sum()), 1.0)


def test_sampling_with_a_draft_head_over_part_of_the_vocabulary_keeps_the_target_distribution():
    model = make_tiny_model("llama", seed=3, vocab=SMALL_VOCAB, scale=1.5)
    drafter = DraftModelDrafter(model=noisy_copy(model, noise=0.5, seed=4), width=2, depth=3, adaptive=False, vocab=6)
    accepted = check_speculative_sampling(LeanTarget(model), model, PROMPT, drafter, {"temperature": 0.8})
    assert accepted > 100


def test_a_draft_head_missing_too_many_tokens_gives_way_to_the_whole_vocabulary():
    """Chains keep their rows in the draft cache, so the tokens counted are those fed to the draft since its last
    synchronisation: a 4-token head on a 96-token model misses most of them and is given up, ids unchanged."""
    target = LeanTarget(make_tiny_model("llama", seed=0))
    drafter = DraftModelDrafter(model=noisy_copy(target.model, noise=0.05), width=1, depth=4, adaptive=False, vocab=4)
    drafter.MISS_WINDOW = 16
    prompt = repetitive_prompt(random.Random(3), low=10, high=30)
    assert_same_ids_as_ar(target, None, [prompt], drafter, max_new_tokens=40, require_drafting=False)
    assert drafter._shared["seen"] >= 16 and drafter._shared["head"] is None


def test_drafting_can_pay_weighs_verification_and_draft_forwards():
    """The machine above: Qwen2.5-Coder-1.5B's Q4_K_M file on a two-core Zen 2, its 0.5B draft at 11 ms a forward.
    With 16-bit activations a second row costs 65 % of a first, and drafts accepted 90 % of the time promise no 5 %;
    with 8-bit ones (a second row 33 %) they do."""
    from draftwise.decoding.latency import LatencyModel
    from draftwise.drafters.draft_model import drafting_can_pay

    sixteen = LatencyModel(prior={1: 0.0445, 2: 0.0732, 3: 0.0971, 4: 0.1243, 8: 0.227})
    eight = LatencyModel(prior={1: 0.0392, 2: 0.0520, 3: 0.0682, 4: 0.0870, 8: 0.154})
    rates = [0.9] * 8
    assert not drafting_can_pay(sixteen, 0.0111, rates, margin=1.05)
    assert drafting_can_pay(sixteen, 0.0111, [1.0] * 8, margin=1.05)
    assert drafting_can_pay(eight, 0.0111, rates, margin=1.05)
    assert not drafting_can_pay(eight, 0.0111, [0.1] * 8)


def test_a_draft_that_cannot_pay_is_never_run():
    """Where verifying a second row costs as much as a plain step, an adaptive draft model is not run at all: no
    draft cache is made (no prompt read), the ids stay plain decoding's; a machine where rows are nearly free drafts."""
    from draftwise.decoding.drafter import SequenceSetup
    from draftwise.decoding.latency import LatencyModel

    target = LeanTarget(make_tiny_model("llama", seed=0))
    drafter = DraftModelDrafter(model=noisy_copy(target.model, noise=0.05), depth=4)
    prompt = tuple(repetitive_prompt(random.Random(1), low=20, high=30))
    drafter.attach(SequenceSetup(target, None, SamplingParams(), LatencyModel(prior={1: 1.0, 2: 2.0, 8: 8.0})))
    assert drafter._shared["clock"].estimate(1) is not None  # (measured when the draft model was prepared)
    assert len(drafter.propose(prompt, 8)) == 0 and drafter._cache is None
    drafter.attach(SequenceSetup(target, None, SamplingParams(), LatencyModel(prior={1: 1.0, 2: 1.0, 8: 1.0})))
    assert len(drafter.propose(prompt, 8)) > 0 and drafter._cache is not None
