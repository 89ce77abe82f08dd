"""The speculative sampler (``engine/spec/rejection.py``) leaves the target's distribution unchanged, and the n-gram
proposer finds the latest recurrence.

Statistical checks on a 6-token vocabulary with fixed seeds: the first emitted token is distributed as the
target's first row, and, given the first proposal was accepted, the second as the target's second row; for a
deterministic proposal and for one drawn from a proposer distribution q. The bound is a total-variation distance
well above the sampling noise of the sample counts used (and far below the distortion of accepting proposals
unconditionally), plus a chi-square goodness-of-fit p-value from scipy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig, parse_speculative
from engine.spec.ngram import NgramProposer
from engine.spec.rejection import target_probs, verify_greedy, verify_sampled

V = 6
N = 6_000


def _dist(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * 1.5, dim=-1)


def _check(counts: np.ndarray, p: torch.Tensor) -> None:
    n = counts.sum()
    freq = counts / n
    expected = p.double().numpy()
    expected /= expected.sum()
    assert 0.5 * np.abs(freq - expected).sum() < 0.04, (freq, expected)
    assert chisquare(counts, expected * n).pvalue > 1e-4


@pytest.mark.parametrize("proposer", ["deterministic", "distribution"])
def test_emitted_tokens_follow_the_target_distribution(proposer: str) -> None:
    """Token 1 ~ p[0]; token 2 given token 1 was the accepted proposal ~ p[1]: what sampling p alone gives."""
    p = _dist(1, 3)
    q = _dist(2, 2) if proposer == "distribution" else None
    gen = torch.Generator().manual_seed(3)
    guess = [int(p[0].argmax()), int(p[1].argmax())]  # a fixed guess, as the n-gram proposer makes
    first = np.zeros(V)
    second = np.zeros(V)
    for _ in range(N):
        drafts = guess if q is None else [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = verify_sampled(p, drafts, q, gen)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) > 1 and out[0] == drafts[0]:
            second[out[1]] += 1
    _check(first, p[0])
    assert second.sum() > N * 0.1
    _check(second, p[1])
    # the check has teeth: always accepting the fixed proposals would give a point mass, far from p[0]
    assert 0.5 * np.abs(np.eye(V)[guess[0]] - p[0].numpy()).sum() > 0.3


def test_greedy_verification_keeps_the_prefix_matching_the_argmax_then_the_targets_token() -> None:
    logits = torch.full((4, V), -5.0)
    for row, tok in enumerate([3, 1, 5, 0]):
        logits[row, tok] = 5.0
    params = SamplingParams(temperature=0.0)
    assert verify_greedy(logits, [3, 1, 5], params) == [3, 1, 5, 0]
    assert verify_greedy(logits, [3, 2, 5], params) == [3, 1]
    assert verify_greedy(logits, [0, 1, 5], params) == [3]
    biased = SamplingParams(temperature=0.0, logit_bias=((2, 20.0),))
    assert verify_greedy(logits, [2, 2], biased) == [2, 2, 2]


def test_target_probs_apply_temperature_and_top_k_as_the_sampler_does() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    p = target_probs(logits, SamplingParams(temperature=0.5, top_k=2))
    want = torch.softmax(torch.tensor([4.0, 2.0]), dim=-1)
    assert torch.allclose(p[0, :2], want) and float(p[0, 2:].sum()) == 0.0


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    ng = NgramProposer(SpeculativeConfig("ngram", 4, ngram_min=1, ngram_max=3))
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ng.propose(seq, 3) == [7, 8, 5]  # the latest earlier [1, 2, 3] is followed by 7, 8, 5
    assert ng.propose([4, 5, 6, 4], 2) == [5, 6]  # only a 1-gram recurs
    assert ng.propose([1, 2, 3], 2) == []
    assert ng.propose([5, 6, 5], 5) == [6, 5]  # what follows runs to the end


def test_speculative_flag_values_are_parsed_or_refused_by_name() -> None:
    assert parse_speculative(None, 4) is None
    assert parse_speculative("ngram", 3) == SpeculativeConfig("ngram", 3)
    assert parse_speculative("draft:/m", 2) == SpeculativeConfig("draft", 2, draft_model="/m")
    with pytest.raises(ValueError, match="'eagle'"):
        parse_speculative("eagle", 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)
