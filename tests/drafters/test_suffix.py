"""The suffix drafter: trees from the continuations of the context's longest earlier match, scored by frequency,
deeper for longer matches, from the request itself and from earlier requests' outputs (shared by forks, bounded);
exact plain decoding on a model whatever it drafts."""

from __future__ import annotations

import pytest

import draftwise
from draftwise.drafters import SuffixDrafter, make_drafter


def paths(tree) -> dict[tuple[int, ...], float]:
    """Every node's path from the root, with its score (parents come before their children)."""
    by_node: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        by_node.append((*(by_node[parent] if parent >= 0 else ()), token))
    return dict(zip(by_node, tree.scores))


def test_it_copies_what_followed_the_longest_earlier_match_deeper_for_longer_matches():
    drafter = SuffixDrafter(min_depth=2, spec_factor=1.0)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    tree = drafter.propose([*text, 20, 21, 1, 2, 3], budget=32)
    assert tree.tokens[:2] == (4, 5)  # a 3-token match: a tree 3 deep
    assert tree.max_depth == 3
    long_match = drafter.propose([*text, 20, 21, *text[:7]], budget=32)  # the same index, grown
    assert long_match.best_path().tokens == (8, 9, 10, 20, 21, 1, 2)[: long_match.max_depth]
    assert long_match.max_depth == 7


def test_frequent_continuations_score_higher_and_rare_ones_are_dropped():
    drafter = SuffixDrafter(min_token_prob=0.2)
    context = [5, 6, 1, 5, 6, 1, 5, 6, 1, 5, 6, 2, 9, 5, 6]
    found = paths(drafter.propose(context, budget=16))
    assert found[(1,)] > found[(2,)]  # 1 followed "5 6" three times, 2 once
    rare = SuffixDrafter(min_token_prob=0.3)
    assert (2,) not in paths(rare.propose(context, budget=16))  # a share of 1/4 is under the floor


def test_earlier_outputs_draft_later_requests_across_forks_and_the_oldest_go():
    shared = SuffixDrafter(max_global_outputs=2)
    first = shared.fork()
    first.reset([1, 2])
    first.finish([1, 2], [40, 41, 42, 43, 44, 45])
    later = shared.fork()
    later.reset([7, 8])
    tree = later.propose([7, 8, 40, 41, 42], budget=8)  # not in its own context after 42: the global index has it
    assert tree.best_path().tokens[:1] == (43,)
    for output in ([50, 51, 52], [60, 61, 62]):
        shared.fork().finish([1], output)
    assert not later.fork().propose([7, 8, 40, 41, 42], budget=8).tokens  # dropped, oldest first
    # Nothing matches across two outputs.
    assert 60 not in shared.fork().propose([9, 52], budget=8).tokens


def test_options_are_checked():
    assert isinstance(make_drafter("suffix:max_ngram=4,spec_factor=2.0"), SuffixDrafter)
    for spec in ("suffix:max_ngram=0", "suffix:min_token_prob=2", "suffix:min_depth=5,max_depth=4"):
        with pytest.raises(draftwise.InvalidRequestError):
            make_drafter(spec)


def test_a_repeated_answer_is_drafted_from_the_global_index_and_stays_exact(tiny_llama, transformers_rows_trusted):
    """Agent loops repeat earlier answers: the second request's answer comes in long accepted drafts, and both are
    plain greedy decoding's tokens."""
    drafter = SuffixDrafter()
    prompt = [3, 17, 29, 41, 5, 8]
    plain = draftwise.generate(tiny_llama, None, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids
    first = draftwise.generate(tiny_llama, None, prompt_ids=prompt, method=drafter, max_new_tokens=40)
    assert first.token_ids == plain
    again = [9, 9, *prompt]  # another prompt, the same end: its answer was seen
    expected = draftwise.generate(tiny_llama, None, prompt_ids=again, method="ar", max_new_tokens=40).token_ids
    second = draftwise.generate(tiny_llama, None, prompt_ids=again, method=drafter, max_new_tokens=40)
    assert second.token_ids == expected
    assert expected[:20] == plain[:20]  # (the tiny model answers both alike)
    assert second.stats.mean_accepted_tokens > 4 > first.stats.mean_accepted_tokens
