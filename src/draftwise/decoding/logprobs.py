"""Log-probabilities of the emitted tokens, as evaluation clients ask for them (OpenAI's ``logprobs``).

They are the model's own distribution at each emitted position (the raw logits' log-softmax in float32, before any
sampling transform: vLLM's default ``raw_logprobs``). Each comes from the verification row that decided the token,
and every verification row is bitwise plain decoding's row, so a speculative run returns exactly the log-probabilities
of plain decoding, whatever was drafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Most alternatives per token a request may ask for (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the ``top`` most likely tokens at its position, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` under row ``i`` of ``logits`` (``(len(tokens), vocab)``, raw), with the
    ``top`` most likely tokens of each row."""
    if not tokens:
        return []
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(list(tokens), device=rows.device).unsqueeze(1)).squeeze(1).tolist()
    if top > 0:
        values, indices = rows.topk(min(top, rows.shape[-1]), dim=-1)
        alternatives = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(indices.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprob(int(token), value, alternative)
            for token, value, alternative in zip(tokens, chosen, alternatives)]
