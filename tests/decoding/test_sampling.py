"""Distribution tests: every sampling verification path must reproduce the target distribution exactly.

Each test draws many samples and compares their histogram with the exact distribution by Pearson's chi-square test at
significance 0.001 (critical value by the Wilson-Hilferty approximation; cells with expected counts under 5 are
pooled). A test that shows the per-path rule of REST and ADED failing the same check proves the test has power.
"""

from __future__ import annotations

import random

import pytest
import torch
from distributions import assert_same_distribution, check_speculative_sampling, chi_square, random_distribution
from tiny import FixedCosts, make_tiny_model

import draftwise
from draftwise.decoding.drafter import Drafter
from draftwise.decoding.sampling import (
    SamplingParams,
    _probabilities_by_sorting,
    row_histories,
    target_probabilities,
    transform_logits,
)
from draftwise.decoding.tree import DraftTree
from draftwise.decoding.verify import recursive_rejection, verify_probabilistic, verify_sampled

# (tiny models passed as they are draft on the transformers backend: see conftest.transformers_rows_trusted)
pytestmark = pytest.mark.usefixtures("transformers_rows_trusted")

VOCAB = 6
SAMPLES = 12000


# ---------------------------------------------------------------- pure verification functions, known p and q


def test_recursive_rejection_single_candidate_is_exact():
    source = torch.Generator().manual_seed(0)
    p, q = random_distribution(source, VOCAB, zeros=1), random_distribution(source, VOCAB)
    emitted = []
    for _ in range(SAMPLES):
        candidate = int(torch.multinomial(q, 1, generator=source))
        emitted.append(recursive_rejection(p, q, [candidate], source)[1])
    assert_same_distribution(emitted, p)


@pytest.mark.parametrize("without_replacement", [False, True])
def test_recursive_rejection_many_candidates_is_exact(without_replacement):
    source = torch.Generator().manual_seed(1)
    p, q = random_distribution(source, VOCAB), random_distribution(source, VOCAB, zeros=1)
    emitted = []
    for _ in range(SAMPLES):
        candidates = torch.multinomial(q, 3, replacement=not without_replacement, generator=source).tolist()
        emitted.append(recursive_rejection(p, q, candidates, source, without_replacement)[1])
    assert_same_distribution(emitted, p)


def _decode_two_tokens(verify) -> list[int]:
    """Joint index (first * VOCAB + second) of the first two tokens of many short decodes driven by ``verify``."""
    joint = []
    for _ in range(SAMPLES):
        tokens: list[int] = []
        while len(tokens) < 2:
            tokens.extend(verify(tokens))
        joint.append(tokens[0] * VOCAB + tokens[1])
    return joint


def test_chain_rejection_sampling_is_exact():
    """Leviathan/Chen chain verification: the first two tokens follow p(x1) p(x2 | x1)."""
    source = torch.Generator().manual_seed(2)
    p_first = random_distribution(source, VOCAB)
    p_next = torch.stack([random_distribution(source, VOCAB, zeros=1) for _ in range(VOCAB)])
    p_third = random_distribution(source, VOCAB)
    q_first = random_distribution(source, VOCAB)
    q_next = torch.stack([random_distribution(source, VOCAB) for _ in range(VOCAB)])

    def verify(prefix):
        if prefix:  # second token from a fresh step: the root's distribution is p(. | first)
            p_root, q_root = p_next[prefix[0]], q_next[prefix[0]]
            draft = [int(torch.multinomial(q_root, 1, generator=source))]
            p_rows = torch.stack([p_root, p_third])
            return verify_probabilistic(DraftTree.chain(draft), p_rows, q_root[None], source).tokens
        first = int(torch.multinomial(q_first, 1, generator=source))
        second = int(torch.multinomial(q_next[first], 1, generator=source))
        p_rows = torch.stack([p_first, p_next[first], p_third])
        q_rows = torch.stack([q_first, q_next[first]])
        return verify_probabilistic(DraftTree.chain([first, second]), p_rows, q_rows, source).tokens

    exact = (p_first[:, None] * p_next).flatten()
    assert_same_distribution(_decode_two_tokens(verify), exact)


def test_tree_rejection_sampling_is_exact():
    """Multi-candidate tree verification: two distinct children drawn from q (without replacement) at the root, one
    child below each. (A tree holds no duplicate children, so tree drafts are drawn without replacement.)"""
    source = torch.Generator().manual_seed(3)
    p_first = random_distribution(source, VOCAB)
    p_next = torch.stack([random_distribution(source, VOCAB) for _ in range(VOCAB)])
    q_first = random_distribution(source, VOCAB)
    q_next = torch.stack([random_distribution(source, VOCAB) for _ in range(VOCAB)])

    def verify(prefix):
        if prefix:
            return [int(torch.multinomial(p_next[prefix[0]], 1, generator=source))]
        roots = torch.multinomial(q_first, 2, replacement=False, generator=source).tolist()
        return _tree_step(roots, p_first, q_first, p_next, q_next, source, without_replacement=True)

    exact = (p_first[:, None] * p_next).flatten()
    assert_same_distribution(_decode_two_tokens(verify), exact)


def _tree_step(roots, p_first, q_first, p_next, q_next, source, without_replacement):
    tokens, parents, p_rows, q_rows = [], [], [p_first], [q_first]
    for root in roots:
        tokens.append(root)
        parents.append(-1)
    for index, root in enumerate(roots):
        tokens.append(int(torch.multinomial(q_next[root], 1, generator=source)))
        parents.append(index)
    for root in roots:
        p_rows.append(p_next[root])
        q_rows.append(q_next[root])
    for child in tokens[len(roots) :]:
        p_rows.append(p_first)
        q_rows.append(q_first)
    tree = DraftTree(tuple(tokens), tuple(parents))
    return verify_probabilistic(tree, torch.stack(p_rows), torch.stack(q_rows), source, without_replacement).tokens


def _point_mass_tree() -> tuple[DraftTree, list[int]]:
    """Three root children (tokens 0, 1, 2) with two grandchildren each: a deterministic draft tree."""
    tokens, parents = [0, 1, 2], [-1, -1, -1]
    for parent in range(3):
        for child in (3, 4):
            tokens.append(child)
            parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents)), [0, 1, 2]


def test_deterministic_tree_sampling_is_exact():
    """Node-by-node sampling of a point-mass draft tree gives p(x1) p(x2 | x1)."""
    source = torch.Generator().manual_seed(4)
    p_first = random_distribution(source, VOCAB)
    p_next = torch.stack([random_distribution(source, VOCAB) for _ in range(VOCAB)])
    tree, _ = _point_mass_tree()
    rows = [p_first, *(p_next[token] for token in tree.tokens)]
    probabilities = torch.stack(rows).float()

    def verify(prefix):
        if prefix:
            return [int(torch.multinomial(p_next[prefix[0]], 1, generator=source))]
        return verify_sampled(tree, probabilities, source).tokens

    exact = (p_first[:, None] * p_next).flatten()
    assert_same_distribution(_decode_two_tokens(verify), exact)


def per_path_sampling(tree: DraftTree, probabilities: torch.Tensor, source: torch.Generator) -> list[int]:
    """The rule REST and ADED use: sample along each root-to-leaf path independently, keep the longest accepted
    path. Biased: tokens on several paths get several chances."""
    leaves = [node for node in range(len(tree)) if node not in tree.parents]
    best: list[int] = []
    for leaf in leaves:
        path = tree.path_to(leaf)
        emitted: list[int] = []
        row = 0
        for node in path:
            draw = int(torch.multinomial(probabilities[row], 1, generator=source))
            emitted.append(draw)
            if draw != tree.tokens[node]:
                break
            row = node + 1
        else:
            emitted.append(int(torch.multinomial(probabilities[row], 1, generator=source)))
        if len(emitted) > len(best):
            best = emitted
    return best


def test_per_path_sampling_fails_the_same_test():
    """The suite can tell: the per-path rule's first token is visibly biased on the same tree."""
    source = torch.Generator().manual_seed(5)
    p_first = torch.tensor([0.3, 0.05, 0.05, 0.2, 0.2, 0.2], dtype=torch.float64)
    tree = DraftTree.from_paths([[0, 0], [1, 3], [2, 4]])
    probabilities = torch.stack([p_first] * (len(tree) + 1)).float()
    first_tokens = [per_path_sampling(tree, probabilities, source)[0] for _ in range(SAMPLES)]
    counts = torch.bincount(torch.tensor(first_tokens), minlength=VOCAB).double()
    statistic, critical = chi_square(counts, p_first)
    assert statistic > critical, "the per-path rule should be detected as biased"
    exact_first = [verify_sampled(tree, probabilities, source).tokens[0] for _ in range(SAMPLES)]
    assert_same_distribution(exact_first, p_first)


# ---------------------------------------------------------------- transforms


def test_transforms_match_transformers_order():
    """Repetition penalty, temperature, top-k, top-p and min-p as transformers applies them, per row history."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    context = [1, 2, 3, 2]
    tree = DraftTree.from_paths([[4, 5], [6]])
    logits = torch.randn(len(tree) + 1, 10, generator=torch.Generator().manual_seed(6))
    ours = transform_logits(logits, params, context, tree)
    reference = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.3),
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(5),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ]
    )
    for row, history in enumerate(row_histories(context, tree)):
        expected = reference(torch.tensor([history]), logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1], expected)


#: The distribution paths: the compiled kernel (CPUs) and torch's operations (elsewhere).
DISTRIBUTION_PATHS = {"kernel": target_probabilities, "torch": _probabilities_by_sorting}
#: Option sets covering every transform alone and together.
TRANSFORM_OPTIONS = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.3, "top_p": 0.5},
    {"temperature": 0.8, "top_k": 7},
    {"temperature": 0.9, "top_k": 100},
    {"temperature": 0.7, "min_p": 0.05},
    {"temperature": 0.7, "top_k": 50, "top_p": 0.95, "min_p": 0.02},
]


def transformers_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return torch.softmax(transform_logits(logits, params, [0]), dim=-1)


def assert_same_distribution_rows(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """The same kept set (probabilities below 1e-30 count as dropped: exp underflows differently) and
    probabilities within float tolerance."""
    assert torch.equal(ours > 1e-30, reference > 1e-30), "a different set of tokens kept"
    assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-7), float((ours - reference).abs().max())


@pytest.fixture(params=list(DISTRIBUTION_PATHS))
def distribution_path(request):
    if request.param == "kernel":
        from draftwise.backend import native

        if native.load_kernels(warn=False) is None:
            pytest.skip(f"no kernels here: {native.unavailable_reason()}")
    return DISTRIBUTION_PATHS[request.param]


@pytest.mark.parametrize("options", TRANSFORM_OPTIONS, ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()))
@pytest.mark.parametrize("width", [5, 37, 1000, 49152])
def test_distribution_equals_transformers_warpers(distribution_path, options, width):
    """Temperature, top-k, top-p and min-p and the softmax of every row as transformers' warpers give them, on
    random logits of several spreads and widths (including ones no vector width divides)."""
    generator = torch.Generator().manual_seed(width)
    params = SamplingParams(**options)
    for spread in (0.5, 3.0, 12.0):
        logits = torch.randn(4, width, generator=generator) * spread
        assert_same_distribution_rows(distribution_path(logits, params), transformers_probabilities(logits, params))


def test_distribution_ties_at_the_top_p_boundary(distribution_path):
    """Tokens tied at the top-p boundary: as many are kept as transformers keeps, the lower ids first (transformers'
    own pick among them follows its unstable sort), and every other token as in transformers."""
    width = 49152
    logits = torch.full((1, width), -4.0)
    logits[0, [7, 300, 4000, 9000, 20000]] = 1.0  # five tied tokens
    logits[0, 123] = 3.0
    probabilities = torch.softmax(logits, -1)[0]
    for extra in (0.5, 1.5, 2.5, 3.5, 4.5):
        params = SamplingParams(temperature=1.0, top_p=float(probabilities[123] + extra * probabilities[7]))
        ours = distribution_path(logits, params)[0]
        reference = transformers_probabilities(logits, params)[0]
        tied = torch.tensor([7, 300, 4000, 9000, 20000])
        assert int((ours[tied] > 0).sum()) == int((reference[tied] > 0).sum()) == int(extra) + 1
        assert torch.equal(ours[tied] > 0, torch.arange(5) < int(extra) + 1)
        others = torch.ones(width, dtype=torch.bool)
        others[tied] = False
        assert torch.equal(ours[others] > 0, reference[others] > 0)
        assert torch.allclose(ours[ours > 0].sum(), torch.tensor(1.0))


def test_distribution_of_a_row_is_bitwise_alone_or_in_a_batch(distribution_path):
    """A row's distribution is computed from that row alone: bitwise the same in a call of one row or of nine, and
    from bfloat16 logits the same as from their float32 values."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 4099, generator=generator) * 4).bfloat16()
    for options in TRANSFORM_OPTIONS:
        params = SamplingParams(**options)
        together = distribution_path(logits, params)
        for row in range(9):
            assert torch.equal(distribution_path(logits[row : row + 1], params)[0], together[row])
        assert torch.equal(distribution_path(logits.float(), params), together)


def test_distribution_refuses_greedy():
    with pytest.raises(ValueError, match="greedy"):
        target_probabilities(torch.zeros(1, 4), SamplingParams())


# ---------------------------------------------------------------- end to end on a tiny model

SMALL_VOCAB = 12
PROMPT = [1, 5, 7, 5, 7, 3]


class RandomPointMassDrafter(Drafter):
    """Random trees over a small vocabulary: often right, often wrong, always a different shape."""

    name = "random-tree"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def propose(self, context, budget):
        paths = [[self.rng.randrange(SMALL_VOCAB) for _ in range(self.rng.randint(1, 3))] for _ in range(3)]
        return DraftTree.from_paths(paths, budget)


class SampledDraftDrafter(Drafter):
    """Stands in for a draft model: at the root two children drawn from a draft distribution q without replacement,
    below each a chain of one more draw; the tree carries q at every row, so sampling verifies by rejection."""

    name = "sampled-draft"

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def _q(self, path: tuple[int, ...]) -> torch.Tensor:
        source = torch.Generator().manual_seed(hash(path) % (2**31))
        return random_distribution(source, SMALL_VOCAB, zeros=2).float()

    def propose(self, context, budget):
        root_path = tuple(context[-2:])
        q_root = self._q(root_path)
        first = torch.multinomial(q_root, 2, replacement=False, generator=self.generator).tolist()
        tokens, parents, rows = [], [], [q_root]
        for token in first:
            tokens.append(token)
            parents.append(-1)
            rows.append(self._q((*root_path, token)))
        for node in range(2):
            tokens.append(int(torch.multinomial(rows[node + 1], 1, generator=self.generator)))
            parents.append(node)
            rows.append(self._q((*root_path, first[node], tokens[-1])))
        return DraftTree(tuple(tokens), tuple(parents), draft_probs=torch.stack(rows))


@pytest.fixture(scope="module")
def small_model():
    return make_tiny_model("llama", seed=3, vocab=SMALL_VOCAB, scale=1.5)


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.3},
        {"temperature": 1.3, "top_k": 6, "min_p": 0.05},
    ],
)
@pytest.mark.parametrize("method", ["ar", "tree", "sampled-draft"])
def test_speculative_sampling_matches_plain_distribution(small_model, options, method):
    """The first three tokens' marginals equal plain sampling's, tokens 2 and 3 out of the verification walk
    (accepted drafts, corrections, bonus tokens)."""
    drafter = {"ar": "ar", "tree": RandomPointMassDrafter(seed=7), "sampled-draft": SampledDraftDrafter(seed=7)}[method]
    accepted = check_speculative_sampling(small_model, small_model, PROMPT, drafter, options)
    assert method == "ar" or accepted > 100, "the drafts were never verified"


def test_sampling_statistics_and_reproducibility(small_model):
    # (every row priced alike: with costs measured on the running machine, a slow first forward could price the
    # random drafts out before any was accepted)
    drafter = RandomPointMassDrafter(seed=1)
    one = draftwise.generate(small_model, None, prompt_ids=PROMPT, method=drafter, max_new_tokens=30, temperature=0.8,
                             seed=11, latency=FixedCosts(prior={1: 1.0, 64: 1.0}))
    two = draftwise.generate(
        small_model, None, prompt_ids=PROMPT, method=RandomPointMassDrafter(seed=1), max_new_tokens=30,
        temperature=0.8, seed=11, latency=FixedCosts(prior={1: 1.0, 64: 1.0}),
    )
    assert one.token_ids == two.token_ids
    assert one.stats.accepted_tokens > 0 and one.stats.mean_accepted_tokens > 1
    assert all(0 <= rate <= 1 for rate in one.stats.acceptance_per_position)
    other = [
        draftwise.generate(small_model, None, prompt_ids=PROMPT, method="pld", max_new_tokens=30, temperature=0.8,
                           seed=seed).token_ids
        for seed in range(4)
    ]
    assert len({tuple(ids) for ids in other}) > 1
