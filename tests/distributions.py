"""Distribution tests for sampling: Pearson's chi-square at significance 0.001 (critical value by the
Wilson-Hilferty approximation; cells with expected counts under 5 are pooled)."""

from __future__ import annotations

import math

import torch

Z_999 = 3.0902  # standard normal quantile for significance 0.001


def chi_square_critical(degrees: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    return degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3


def chi_square(counts: torch.Tensor, probabilities: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic (pooling cells expected under 5) and its critical value at significance 0.001."""
    counts = counts.double().flatten()
    expected = probabilities.double().flatten() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0  # impossible cells are checked separately
    counts, expected = counts[keep], expected[keep]
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return statistic, chi_square_critical(max(len(expected) - 1, 1))


def assert_same_distribution(samples: list[int], probabilities: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(samples), minlength=probabilities.numel()).double()
    impossible = counts[probabilities.flatten() == 0].sum()
    assert impossible == 0, f"{int(impossible)} samples fell on tokens of probability 0"
    statistic, critical = chi_square(counts, probabilities)
    assert statistic < critical, f"chi-square {statistic:.1f} >= critical {critical:.1f}: distributions differ"


def random_distribution(generator: torch.Generator, size: int, zeros: int = 0) -> torch.Tensor:
    weights = torch.rand(size, generator=generator, dtype=torch.float64) + 0.05
    if zeros:
        weights[torch.randperm(size, generator=generator)[:zeros]] = 0
    return weights / weights.sum()


def exact_marginals(model, prompt: list[int], params, count: int = 3) -> list[torch.Tensor]:
    """Exact distributions of each of the first ``count`` generated tokens under plain sampling with ``params``
    (every continuation enumerated: vocab ** (count - 1) contexts, for small vocabularies)."""
    from draftwise.decoding.sampling import transform_logits

    device = model.device

    def next_distribution(context: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([context], device=device)).logits[0, -1:]
        return torch.softmax(transform_logits(logits, params, context)[0].double(), -1).cpu()

    marginals = []
    frontier = [(list(prompt), 1.0)]  # (context, probability of its generated part)
    with torch.inference_mode():
        for _ in range(count):
            total = None
            following = []
            for context, weight in frontier:
                distribution = next_distribution(context)
                total = weight * distribution if total is None else total + weight * distribution
                following += [([*context, token], weight * float(distribution[token]))
                              for token in range(distribution.numel()) if distribution[token] > 0]
            marginals.append(total)
            frontier = following
    return marginals


def check_speculative_sampling(target, reference, prompt: list[int], method, options: dict, draws: int = 1500) -> int:
    """Generate four tokens ``draws`` times (seeds 0, 1, ...) with ``method`` on ``target`` and the sampling
    ``options``, assert that the first three tokens' marginals equal plain sampling's (computed exactly on
    ``reference``, the transformers model), and return how many draft tokens were accepted in all. With four tokens
    to generate, the first step drafts two levels, so tokens 2 and 3 come out of the verification walk."""
    import draftwise
    from draftwise.decoding.sampling import SamplingParams

    marginals = exact_marginals(reference, prompt, SamplingParams(**options), count=3)
    samples: list[list[int]] = [[], [], []]
    accepted = 0
    for seed in range(draws):
        result = draftwise.generate(target, None, prompt_ids=prompt, method=method, max_new_tokens=4, seed=seed,
                                    **options)
        for position in range(3):
            samples[position].append(result.token_ids[position])
        accepted += result.stats.accepted_tokens
    for position in range(3):
        assert_same_distribution(samples[position], marginals[position])
    return accepted
