"""Tests for :mod:`engine.sampler` and :mod:`engine.sampling_params` on hand-made logits."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, _apply_penalties, filtered_probs
from engine.sampling_params import SamplingParams

VOCAB = 64


def _request(params: SamplingParams, rid: str = "r", prompt: tuple[int, ...] = (1, 2, 3),
             output: tuple[int, ...] = ()) -> Request:
    """A request with the given params, prompt and already generated output tokens."""
    req = Request(rid, list(prompt), params)
    for t in output:
        req.append_token(t)
    return req


def _logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Deterministic float32 logits of shape [rows, vocab]."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def _support(probs: torch.Tensor) -> set[int]:
    """Indices with non-zero probability."""
    return set(torch.nonzero(probs).flatten().tolist())


def _logits_from_probs(probs: list[float], order: list[int]) -> torch.Tensor:
    """Logits whose softmax puts ``probs[i]`` at index ``order[i]``."""
    out = torch.empty(len(probs))
    for p, idx in zip(probs, order, strict=True):
        out[idx] = math.log(p)
    return out


# ---- greedy and seeded sampling --------------------------------------------------------------------------------


def test_greedy_picks_the_argmax_of_each_row() -> None:
    """temperature=0 returns argmax per row."""
    logits = _logits(4, seed=0)
    reqs = [_request(SamplingParams(temperature=0.0), rid=f"r{i}") for i in range(4)]
    result = Sampler()(logits, reqs)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 4


def test_greedy_rows_in_a_mixed_batch_still_pick_the_argmax() -> None:
    """Greedy rows batched with sampled rows are still argmax."""
    logits = _logits(3, seed=1)
    reqs = [_request(SamplingParams(temperature=0.0), rid="g0"), _request(SamplingParams(seed=3), rid="s"),
            _request(SamplingParams(temperature=0.0), rid="g1")]
    tokens = Sampler()(logits, reqs).token_ids
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[2] == int(logits[2].argmax())


def _seeded_run(batch_params: list[SamplingParams], target: int, steps: int = 20) -> list[int]:
    """Sample ``steps`` tokens for a batch and return row ``target``'s; its logits depend only on the step."""
    reqs = [_request(p, rid=f"r{i}") for i, p in enumerate(batch_params)]
    sampler = Sampler(torch.Generator().manual_seed(len(batch_params)))
    out = []
    for step in range(steps):
        logits = _logits(len(reqs), seed=1000 + step) * 0.5
        logits[target] = _logits(1, seed=step)[0] * 0.5
        tokens = sampler(logits, reqs).token_ids
        for r, t in zip(reqs, tokens, strict=True):
            r.append_token(t)
        out.append(tokens[target])
    return out


def test_seeded_sampling_is_reproducible() -> None:
    """The same seed on the same logits gives the same 20 tokens; a different seed gives different ones."""
    first = _seeded_run([SamplingParams(temperature=1.0, seed=11)], target=0)
    again = _seeded_run([SamplingParams(temperature=1.0, seed=11)], target=0)
    other = _seeded_run([SamplingParams(temperature=1.0, seed=12)], target=0)
    assert first == again
    assert first != other
    assert len(set(first)) > 1  # really sampled, not a collapsed distribution


def test_seeded_sampling_is_independent_of_the_batch() -> None:
    """A seeded request samples the same tokens alone and in a batch with other seeded, unseeded and greedy rows."""
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=11)
    alone = _seeded_run([mine], target=0)
    batch = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=5),
        SamplingParams(temperature=0.7),
        mine,
        SamplingParams(temperature=1.0, seed=99, top_p=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ]
    assert _seeded_run(batch, target=3) == alone


def test_unseeded_sampling_follows_the_engine_generator() -> None:
    """Unseeded rows draw from the sampler's generator, so equal generator seeds give equal tokens."""
    logits = _logits(8, seed=2)
    reqs = [_request(SamplingParams(), rid=f"r{i}") for i in range(8)]
    a = Sampler(torch.Generator().manual_seed(5))(logits, reqs).token_ids
    b = Sampler(torch.Generator().manual_seed(5))(logits, reqs).token_ids
    assert a == b


def test_near_zero_temperature_sampling_picks_the_argmax() -> None:
    """Sampling with a tiny temperature concentrates all mass on the argmax."""
    logits = _logits(5, seed=3)
    reqs = [_request(SamplingParams(temperature=1e-4, seed=i), rid=f"r{i}") for i in range(5)]
    assert Sampler()(logits, reqs).token_ids == logits.argmax(dim=-1).tolist()


def test_sampled_tokens_stay_inside_the_top_k_support() -> None:
    """Every draw with top_k=3 is one of the 3 largest logits."""
    logits = _logits(1, seed=4)[0]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    req = _request(SamplingParams(temperature=2.0, top_k=3, seed=0))
    sampler = Sampler()
    seen = {sampler(logits.unsqueeze(0), [req]).token_ids[0] for _ in range(100)}
    assert seen <= top3
    assert len(seen) > 1


# ---- filters ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_support_is_exactly_the_k_largest(k: int) -> None:
    """top_k keeps exactly the k largest logits and renormalises."""
    logits = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(k)).float() / 4
    probs = filtered_probs(logits, k, 1.0, 0.0)
    assert _support(probs) == set(torch.topk(logits, k).indices.tolist())
    assert float(probs.sum()) == pytest.approx(1.0)


def test_top_k_zero_or_vocab_sized_keeps_everything() -> None:
    """top_k=0 and top_k >= vocab disable the filter."""
    logits = _logits(1, seed=5)[0]
    full = torch.softmax(logits, dim=-1)
    assert torch.allclose(filtered_probs(logits, 0, 1.0, 0.0), full)
    assert torch.allclose(filtered_probs(logits, VOCAB, 1.0, 0.0), full)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {0}),
        (0.49, {0}),
        (0.6, {0, 1}),
        (0.74, {0, 1}),
        (0.76, {0, 1, 2}),
        (0.89, {0, 1, 2}),
        (0.95, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, kept: set[int]) -> None:
    """With probs 0.5/0.25/0.15/0.1 (shuffled positions), top_p keeps the fewest top tokens whose mass reaches p."""
    probs = [0.5, 0.25, 0.15, 0.1]
    order = [2, 0, 3, 1]  # rank r lives at index order[r]
    out = filtered_probs(_logits_from_probs(probs, order), 0, top_p, 0.0)
    assert _support(out) == {order[r] for r in kept}
    mass = sum(probs[r] for r in kept)
    for r in kept:
        assert float(out[order[r]]) == pytest.approx(probs[r] / mass, rel=1e-5)


@pytest.mark.parametrize("top_p", [1e-6, 0.01, 0.2])
def test_top_p_always_keeps_the_top_token(top_p: float) -> None:
    """Even a top_p below the top token's probability keeps that token (and only it)."""
    logits = _logits(1, seed=6)[0]
    out = filtered_probs(logits, 0, top_p, 0.0)
    assert _support(out) == {int(logits.argmax())}
    assert float(out.max()) == pytest.approx(1.0)


@pytest.mark.parametrize(("min_p", "kept"), [(0.1, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.4, {0, 1}), (0.9, {0})])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p: float, kept: set[int]) -> None:
    """min_p keeps tokens with probability >= min_p * max probability."""
    probs = [0.5, 0.25, 0.15, 0.1]
    order = [1, 3, 0, 2]
    out = filtered_probs(_logits_from_probs(probs, order), 0, 1.0, min_p)
    assert _support(out) == {order[r] for r in kept}


def test_top_k_then_top_p_apply_in_sequence() -> None:
    """top_p is computed over the distribution already renormalised by top_k."""
    # Ranks 0..4 with probs 0.4/0.3/0.2/0.06/0.04. top_k=3 renormalises to 0.444/0.333/0.222;
    # top_p=0.7 then needs two tokens (0.444 < 0.7 <= 0.777).
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    out = filtered_probs(_logits_from_probs(probs, [0, 1, 2, 3, 4]), 3, 0.7, 0.0)
    assert _support(out) == {0, 1}


# ---- penalties -------------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    """HF rule over prompt and output tokens: seen positive logits are divided, seen negative ones multiplied."""
    row = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    req = _request(SamplingParams(repetition_penalty=2.0), prompt=(0, 1, 0), output=(2, 2))
    _apply_penalties(row, req)
    assert row.tolist() == [1.0, -4.0, 0.5, -1.0, 0.5, 3.0]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    """Presence subtracts once per seen output token, frequency once per occurrence; prompt tokens are exempt."""
    row = torch.zeros(6)
    req = _request(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(0, 5), output=(1, 1, 2, 1))
    _apply_penalties(row, req)
    assert row.tolist() == [0.0, -1.25, -0.75, 0.0, 0.0, 0.0]


def test_negative_presence_penalty_raises_seen_tokens() -> None:
    """A negative presence penalty adds to the logits of tokens already generated."""
    row = torch.zeros(4)
    _apply_penalties(row, _request(SamplingParams(presence_penalty=-1.0), output=(3,)))
    assert row.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_sampler_applies_penalties_before_greedy_argmax() -> None:
    """A repeated token loses the greedy pick to the runner-up once the repetition penalty applies."""
    logits = torch.tensor([[0.0, 4.0, 3.0, 0.0]])
    plain = _request(SamplingParams(temperature=0.0), prompt=(0,), output=(1,))
    penalised = _request(SamplingParams(temperature=0.0, repetition_penalty=2.0), rid="p", prompt=(0,), output=(1,))
    assert Sampler()(logits, [plain]).token_ids == [1]
    assert Sampler()(logits, [penalised]).token_ids == [2]
    assert logits.tolist() == [[0.0, 4.0, 3.0, 0.0]]  # caller's logits are not modified


# ---- logprobs --------------------------------------------------------------------------------------------------


def test_sampled_token_logprob_is_log_softmax_of_the_raw_logits() -> None:
    """The reported logprob is that of the raw logits, before penalties and temperature."""
    logits = _logits(2, seed=7)
    reqs = [
        _request(SamplingParams(temperature=0.7, seed=1, logprobs=2, repetition_penalty=1.5), rid="a"),
        _request(SamplingParams(temperature=0.0, logprobs=2, presence_penalty=1.0), rid="b", output=(4,)),
    ]
    result = Sampler()(logits, reqs)
    logp = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(result.logprobs):
        assert lp is not None
        assert lp.token_id == result.token_ids[i]
        assert lp.logprob == pytest.approx(float(logp[i, lp.token_id]), abs=1e-6)


def test_top_logprobs_are_sorted_and_match_the_top_of_the_distribution() -> None:
    """top-N alternatives are the N most likely tokens under the raw logits, in descending order."""
    logits = _logits(1, seed=8)
    result = Sampler()(logits, [_request(SamplingParams(temperature=0.0, logprobs=5))])
    (lp,) = result.logprobs
    assert lp is not None
    ids = [t for t, _ in lp.top]
    vals = [v for _, v in lp.top]
    expected = torch.topk(torch.log_softmax(logits[0], dim=-1), 5)
    assert ids == expected.indices.tolist()
    assert vals == pytest.approx(expected.values.tolist(), abs=1e-6)
    assert vals == sorted(vals, reverse=True)
    assert ids[0] == result.token_ids[0]


def test_logprobs_count_is_honoured_per_request() -> None:
    """Each request gets its own N alternatives; requests without logprobs get None."""
    logits = _logits(4, seed=9)
    counts = [1, 3, None, 0]
    reqs = [_request(SamplingParams(temperature=0.0, logprobs=n), rid=f"r{i}") for i, n in enumerate(counts)]
    result = Sampler()(logits, reqs)
    assert [None if lp is None else len(lp.top) for lp in result.logprobs] == counts
    zero = result.logprobs[3]
    assert zero is not None and zero.token_id == result.token_ids[3]


# ---- SamplingParams validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.5},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"logprobs": -1},
        {"logprobs": 21},
        {"stop": ("",)},
        {"stop": "abc"},
        {"stop_token_ids": 5},
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict[str, Any]) -> None:
    """Each out-of-range or mistyped SamplingParams field raises ValueError."""
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_valid_and_not_greedy() -> None:
    """Defaults sample at temperature 1 with no filters or penalties; temperature 0 is greedy."""
    p = SamplingParams()
    assert not p.greedy and not p.needs_penalties and not p.needs_filters
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=5).needs_filters
    assert SamplingParams(frequency_penalty=0.1).needs_penalties
