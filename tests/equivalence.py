"""The check every exactness test makes: a method's token ids equal plain greedy decoding's ("ar"), with proof that
the method drafted and had drafts accepted, so that a test cannot pass because drafting was off."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import draftwise

#: generate() options that configure the method under test only; everything else is part of the request and goes to
#: plain decoding too.
METHOD_ONLY_OPTIONS = ("method_options",)


def _as_request(prompt: Any) -> dict[str, Any]:
    """generate()'s keyword for ``prompt``: token ids go as ``prompt_ids``, text and chat messages as ``prompt``."""
    is_text = isinstance(prompt, str)
    is_chat = isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(item, Mapping) for item in prompt)
    return {"prompt": prompt} if is_text or is_chat else {"prompt_ids": list(prompt)}


def _lengths(max_new_tokens: int | Sequence[int], count: int) -> list[int]:
    """One ``max_new_tokens`` per prompt."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * count
    lengths = list(max_new_tokens)
    assert len(lengths) == count, f"{len(lengths)} values of max_new_tokens for {count} prompts"
    return lengths


def _method_name(method: Any) -> str:
    """The method as failure messages name it: its spec, or its drafter's name."""
    return method if isinstance(method, str) else getattr(method, "name", "") or type(method).__name__


def ar_token_ids(model: Any, tokenizer: Any, prompts: Sequence[Any], *, max_new_tokens: int | Sequence[int],
                 **generate_kwargs: Any) -> list[list[int]]:
    """Plain greedy decoding's token ids for each of ``prompts`` (token id lists, strings or chat messages), each
    prompt decoded alone with ``generate(..., method="ar")`` and the same request options."""
    options = {name: value for name, value in generate_kwargs.items() if name not in METHOD_ONLY_OPTIONS}
    lengths = _lengths(max_new_tokens, len(prompts))
    return [
        draftwise.generate(model, tokenizer, method="ar", max_new_tokens=length, **_as_request(prompt), **options)
        .token_ids
        for prompt, length in zip(prompts, lengths)
    ]


def first_difference(got: Sequence[int], expected: Sequence[int]) -> str:
    """Where ``got`` leaves ``expected``, in words (``""`` when they are equal)."""
    if list(got) == list(expected):
        return ""
    position = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    return (f"first difference at output position {position}: got {list(got[position:position + 6])}, "
            f"ar {list(expected[position:position + 6])} (lengths {len(got)} and {len(expected)})")


def assert_same_ids_as_ar(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    method: Any,
    *,
    max_new_tokens: int | Sequence[int],
    require_drafting: bool = True,
    expected: Sequence[Sequence[int]] | None = None,
    max_batch: int | None = None,
    **generate_kwargs: Any,
) -> list[draftwise.GenerationResult]:
    """Assert that ``method`` (a name, a spec or one drafter instance, used for every prompt in order) gives each of
    ``prompts`` exactly plain greedy decoding's token ids, and return its results.

    Args:
        model, tokenizer: as :func:`draftwise.generate` takes them.
        prompts: token id lists, strings or chat messages.
        max_new_tokens: one for all prompts, or one per prompt (prompts decoded alone only).
        require_drafting: also assert that, over all the prompts, the method drafted tokens and had some accepted,
            so that the equality does not hold merely because drafting was off (a row plan that found no exact
            padding, drafts priced out, a drafter that never proposes). Pass ``False`` only where drafting is
            impossible or beside the point (a budget of 0, outputs too short to draft, drafters built to be wrong).
        expected: plain decoding's ids when the caller already has them (from :func:`ar_token_ids` or
            ``method="ar"`` with the same request); computed here otherwise.
        max_batch: decode the prompts as one batch, ``max_batch`` at a time, instead of each alone.
        **generate_kwargs: further options of the request (``budget``, ``stop``, sampling options with a seed, ...),
            given to plain decoding too, except ``method_options``.
    """
    lengths = _lengths(max_new_tokens, len(prompts))
    if expected is None:
        expected = ar_token_ids(model, tokenizer, prompts, max_new_tokens=lengths, **generate_kwargs)
    assert len(expected) == len(prompts), f"{len(expected)} expected outputs for {len(prompts)} prompts"
    if max_batch is not None:
        assert len(set(lengths)) == 1, "a batch shares one max_new_tokens"
        requests = [_as_request(prompt) for prompt in prompts]
        key = "prompt_ids" if "prompt_ids" in requests[0] else "prompt"
        results = draftwise.generate(model, tokenizer, method=method, max_new_tokens=lengths[0], max_batch=max_batch,
                                     **{key: [request[key] for request in requests]}, **generate_kwargs)
    else:
        results = [
            draftwise.generate(model, tokenizer, method=method, max_new_tokens=length, **_as_request(prompt),
                               **generate_kwargs)
            for prompt, length in zip(prompts, lengths)
        ]
    name = _method_name(method)
    differences = [
        f"prompt {index}: {difference}"
        for index, (result, ids) in enumerate(zip(results, expected))
        if (difference := first_difference(result.token_ids, ids))
    ]
    assert not differences, f"{name} differs from plain greedy decoding:\n" + "\n".join(differences)
    if require_drafting:
        drafted = sum(result.stats.drafted_tokens for result in results)
        accepted = sum(result.stats.accepted_tokens for result in results)
        assert drafted > 0 or getattr(model, "exact_trees", True), (
            f"{name} never drafted: the target's row plan found no exact padding, so drafting is off and the "
            "equality proves nothing")
        assert drafted > 0, f"{name} never drafted over {len(prompts)} prompts: the equality proves nothing"
        assert accepted > 0, f"{name} drafted {drafted} tokens over {len(prompts)} prompts and none was accepted"
    return results
