"""The decoding engine: prefill, then draft -> verify -> accept -> update, one forward pass per step.

Every method, plain autoregressive decoding (``ar``) included, runs through :func:`decode`. The model is an
unmodified transformers causal LM called through its public forward with an explicit 4D attention mask and explicit
position ids; the draft tree is verified in that one forward (tree attention) and the :class:`~draftwise.cache.
TreeKVCache` keeps exactly the accepted path afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .cache import TreeKVCache
from .drafters.base import Drafter, StepOutcome
from .latency import LatencyModel
from .stats import GenerationStats
from .tree import DraftTree, tree_attention_mask, tree_position_ids
from .sampling import SamplingParams, transform_logits
from .verify import Verification, greedy_choice, verify_greedy, verify_sampled

#: Default upper bound on draft nodes per step. On a 2-core CPU a forward of 16 rows costs about 2x one row.
DEFAULT_BUDGET = 16


class FinishReason:
    """Why generation ended: ``"eos"``, ``"stop"`` (a stop sequence) or ``"length"`` (max_new_tokens)."""

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"


@dataclass
class StepEvent:
    """Tokens emitted by one step (after stop handling), and whether generation finished with them."""

    tokens: list[int]
    finish_reason: str | None = None


def context_length(model: torch.nn.Module) -> int:
    """The model's maximum number of positions (prompt plus generated tokens)."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def model_forward(
    model: torch.nn.Module,
    cache: TreeKVCache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """One forward through the model's public interface; returns logits ``(batch, rows, vocab)``."""
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return output.logits


def causal_mask(length: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Additive 4D causal mask ``(1, 1, length, length)`` for the prefill of an empty cache."""
    blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)
    return mask[None, None]


def verify_step(
    logits: torch.Tensor,
    tree: DraftTree,
    context: Sequence[int],
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[Verification, torch.Tensor]:
    """Verify ``tree`` against the target's logits at every row; returns the outcome and the transformed logits.

    The user's transforms (repetition penalty, temperature, top-k, top-p, min-p) shape the target distribution of
    every row exactly as in plain decoding. Greedy takes :func:`greedy_choice` of each row; sampling draws node by
    node (:func:`~draftwise.verify.verify_sampled`).
    """
    logits = transform_logits(logits, sampling, context, tree)
    if sampling.greedy:
        return verify_greedy(tree, greedy_choice(logits).tolist()), logits
    return verify_sampled(tree, torch.softmax(logits.float(), dim=-1), generator), logits


def decode(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    is_stopped: Callable[[Sequence[int]], bool] | None = None,
    budget: int = DEFAULT_BUDGET,
    stats: GenerationStats | None = None,
    latency: LatencyModel | None = None,
    sampling: SamplingParams | None = None,
) -> Iterator[StepEvent]:
    """Generate with ``drafter``'s drafts; yield the tokens of each step as they are accepted.

    Greedy (the default ``sampling``) gives the token ids of plain greedy decoding; sampling gives text from exactly
    the distribution of plain sampling with the same options. In both, emitted tokens are processed one by one and generation
    ends at the first EOS token, the first token after which ``is_stopped(output_ids)`` holds, or after
    ``max_new_tokens`` tokens, exactly where plain decoding would end. ``stats`` (if given) is filled in.

    When the drafter scores its nodes, each step verifies only the best-scoring ones that pay for their cost
    according to ``latency`` (learned from this run's forwards; pass one in to share it between runs).

    The caller validates the request (see :func:`draftwise.api.generate`); this function assumes sane arguments.
    """
    stats = stats if stats is not None else GenerationStats()
    latency = latency if latency is not None else LatencyModel()
    sampling = sampling if sampling is not None else SamplingParams()
    generator = sampling.generator(model.device)
    device = model.device
    dtype = model.dtype
    limit = context_length(model)
    eos = frozenset(int(token) for token in eos_token_ids)
    output: list[int] = []
    context = list(prompt_ids)

    def accept(tokens: Sequence[int]) -> StepEvent:
        """Append tokens one at a time, ending where plain decoding would."""
        taken: list[int] = []
        for token in tokens:
            taken.append(token)
            output.append(token)
            if token in eos:
                return StepEvent(taken, FinishReason.EOS)
            if is_stopped is not None and is_stopped(output):
                return StepEvent(taken, FinishReason.STOP)
            if len(output) >= max_new_tokens:
                return StepEvent(taken, FinishReason.LENGTH)
        return StepEvent(taken)

    with torch.inference_mode():
        started = time.perf_counter()
        cache = TreeKVCache.for_model(model, capacity=len(context) + max_new_tokens + budget + 1)
        prompt = torch.tensor([context], dtype=torch.long, device=device)
        positions = torch.arange(len(context), device=device)[None]
        logits = model_forward(model, cache, prompt, positions, causal_mask(len(context), dtype, device), 1)
        cache.keep(0, range(len(context)))
        first, _ = verify_step(logits[0, -1:], DraftTree(), context, sampling, generator)
        event = accept(first.tokens)
        stats.time_to_first_token_s = time.perf_counter() - started
        stats.record_step(emitted=1, drafted=0, accepted=0, attempted=0)
        context.extend(event.tokens)
        drafter.reset(prompt_ids)
        stats.time_s = time.perf_counter() - started
        yield event

        while event.finish_reason is None:
            draft_started = time.perf_counter()
            # A draft never needs to reach past the last token we may emit or past the context window.
            max_depth = min(max_new_tokens - len(output) - 1, limit - len(context) - 1)
            snapshot = tuple(context)  # drafters may keep what they are given; the engine's list keeps growing
            tree = drafter.propose(snapshot, budget).cut(budget, max_depth) if max_depth > 0 else DraftTree()
            if tree.scores is not None and len(tree):
                tree = tree.best(latency.best_size(sorted(tree.scores, reverse=True)))
            forward_started = time.perf_counter()
            stats.draft_time_s += forward_started - draft_started

            lengths = cache.lengths
            rows = torch.tensor([[context[-1], *tree.tokens]], dtype=torch.long, device=device)
            mask = tree_attention_mask([tree], lengths, dtype, device)
            positions = tree_position_ids([tree], lengths, device)
            logits = model_forward(model, cache, rows, positions, mask)[0]
            verification, logits = verify_step(logits, tree, snapshot, sampling, generator)
            latency.record(len(tree) + 1, time.perf_counter() - forward_started)
            cache.keep(0, verification.kept_rows)

            event = accept(verification.tokens)
            context.extend(event.tokens)
            # An EOS or stop inside the accepted draft ends the step early: count only what was emitted.
            stats.record_step(
                emitted=len(event.tokens),
                drafted=len(tree),
                accepted=min(verification.accepted, len(event.tokens)),
                attempted=min(verification.attempted, len(event.tokens)),
            )
            observe_started = time.perf_counter()
            drafter.observe(StepOutcome(tree, verification, logits, tuple(context), snapshot[-1], snapshot))
            stats.draft_time_s += time.perf_counter() - observe_started
            stats.time_s = time.perf_counter() - started
            yield event
