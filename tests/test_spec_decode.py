"""Speculative decoding in the engine (``engine/spec``): greedy output token-identical to decoding without it, on
llama and qwen2, in a batch mixed with requests that are never speculated; KV slots of rejected proposals freed
at once (every live table exactly as long as a non-speculative run's); the draft-model proposer, and a draft with
another tokenizer refused at start.

Tiny checkpoints on CPU with 4-token blocks, so that proposals often straddle block boundaries.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tinymodel.checkpoint import build_tokenizer, write_tiny_checkpoint

PROMPTS = ["a b c d a b c d a b c", "The server runs the model. The server runs", "hello", "def f(x): return x"]


def _engine(model: Path, spec: SpeculativeConfig | None) -> LLM:
    return LLM(str(model), block_size=4, num_kv_blocks=256, num_threads=1, speculative=spec)


def _mixed_params() -> list[SamplingParams]:
    """Greedy requests (speculated) beside a greedy one with logprobs and a seeded one with a repetition penalty
    (neither speculated), so a step's batch mixes verified and ordinary rows."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    return [greedy, greedy, SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=37, temperature=0.9, seed=7, repetition_penalty=1.3, ignore_eos=True)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ngram_greedy_output_equals_non_speculative_in_a_mixed_batch(checkpoint: Callable[[str], Path],
                                                                     arch: str) -> None:
    """Every request's tokens equal the run without speculation; proposals were both accepted and rejected; the
    pool's free count returns to where it started and nothing leaks."""
    model = checkpoint(arch)
    params = _mixed_params()
    base = _engine(model, None).generate(PROMPTS, params)
    # 1-grams: rejections too; K fixed (not adaptive) so that every proposal is verified whatever steps cost here
    spec = _engine(model, SpeculativeConfig("ngram", 4, ngram_min=1, adaptive=False))
    free0 = spec.engine.pool.num_free_blocks
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert [[lp.token_id for lp in o.logprobs] for o in outs] == [[lp.token_id for lp in o.logprobs] for o in base]
    stats = spec.engine.spec.stats  # type: ignore[union-attr]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.mean_accepted_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    assert spec.engine.pool.num_free_blocks == free0
    spec.engine.check_block_accounting()


def test_rejected_proposals_blocks_are_freed_in_the_same_step(checkpoint: Callable[[str], Path]) -> None:
    """After every step, each live request holds exactly the blocks its tokens need (those reserved for rejected
    positions are back in the pool), and at the end every block is free again."""
    llm = _engine(checkpoint("llama"), SpeculativeConfig("ngram", 6, ngram_min=1, adaptive=False))
    eng = llm.engine
    free0 = eng.pool.num_free_blocks
    for prompt in PROMPTS:
        eng.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    # sampled requests are verified by rejection sampling (the distribution is checked in test_spec_rejection.py)
    sampled = eng.add_request("hello", SamplingParams(max_tokens=30, temperature=0.3, seed=5, ignore_eos=True))
    sampled_len = 0
    steps = 0
    while eng.has_unfinished():
        sampled_len += sum(len(o.new_token_ids) for o in eng.step() if o.request_id == sampled)
        steps += 1
        for req in eng.scheduler.running:
            held = len(eng.kv.block_ids(req.request_id))
            assert held == eng.kv.blocks_needed(req.num_computed_tokens), req.request_id
            assert req.num_computed_tokens == req.num_tokens - 1
    stats = eng.spec.stats  # type: ignore[union-attr]
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # rejections happened
    assert steps < 30 + 1  # and acceptances shortened the run
    assert sampled_len == 30
    assert eng.pool.num_free_blocks == free0
    eng.check_block_accounting()


def test_draft_model_greedy_output_equals_non_speculative(checkpoint: Callable[[str], Path],
                                                          tmp_path: Path) -> None:
    """A draft of the same size and tokenizer (another seed's weights) proposes; the output is unchanged. The
    target drafting for itself has every proposal accepted."""
    model = checkpoint("llama")
    draft = write_tiny_checkpoint(tmp_path / "draft", arch="llama", seed=1)
    params = _mixed_params()
    base = _engine(model, None).generate(PROMPTS, params)
    other = _engine(model, SpeculativeConfig("draft", 3, draft_model=str(draft)))
    assert [o.token_ids for o in other.generate(PROMPTS, params)] == [o.token_ids for o in base]
    other.engine.check_block_accounting()
    same = _engine(model, SpeculativeConfig("draft", 3, draft_model=str(model), adaptive=False))
    greedy = [p for p in params if p.greedy and p.logprobs is None]
    assert [o.token_ids for o in same.generate(PROMPTS[:2], greedy)] == [o.token_ids for o in base[:2]]
    stats = same.engine.spec.stats  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_draft_with_another_tokenizer_is_refused_at_start(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A draft whose tokenizer differs (the small size's 8192-token vocabulary; or two vocabulary ids swapped)
    stops the engine from starting, naming the draft."""
    model = checkpoint("llama")
    small = tmp_path / "small"  # the check runs before the draft's weights load: its tokenizer is enough
    shutil.copytree(model, small)
    build_tokenizer(8192).save(str(small / "tokenizer.json"))
    with pytest.raises(ValueError, match="different tokenizer"):
        _engine(model, SpeculativeConfig("draft", 3, draft_model=str(small)))
    edited = tmp_path / "edited"
    shutil.copytree(model, edited)
    doc = json.loads((edited / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.__getitem__)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same strings, other ids
    (edited / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=str(edited)):
        _engine(model, SpeculativeConfig("draft", 3, draft_model=str(edited)))


def test_a_disaggregated_decode_engine_speculates_after_its_kv_lands(checkpoint: Callable[[str], Path]) -> None:
    """A prefill engine and a speculating decode engine joined by the decode and prefill connectors over the
    in-process fake transport: the decode side's tokens equal colocated decoding without speculation, proposals
    were verified there, and both pools end full."""
    from decode_worker.connector import DecodeConnector
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import Tokenizer
    from kvtransfer.fake import FakeReceiver, FakeSender
    from prefill_worker.connector import PrefillConnector
    from worker.server import kv_layout_for

    model = checkpoint("llama")
    prompt = Tokenizer(model).encode("hello")  # the tiny model answers with a repeated token: proposals
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def engine(spec: SpeculativeConfig | None) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model), num_threads=1, speculative=spec,
                                      cache=CacheConfig(block_size=4, num_blocks=32)))

    want = _engine(model, None).generate([prompt], greedy)[0].token_ids
    pre, dec = engine(None), engine(SpeculativeConfig("ngram", 4, ngram_min=1, adaptive=False))  # 1-grams: rejections
    layout = kv_layout_for(pre)
    sender, receiver = FakeSender(), FakeReceiver()
    pc, dc = PrefillConnector(sender, layout, wake=lambda: None), DecodeConnector(receiver, layout, wake=lambda: None)
    pre.attach_connector(pc)
    dec.attach_connector(dc)
    try:
        dc.expect("r", time.time() + 20)
        assert dec.add(dec.make_request(prompt, greedy, "r"))
        dc.forget("r")
        where = dc.destination("r")
        assert where is not None
        pre.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), "r")
        pc.expect("r", where[0], where[0].deadline_s)
        (first,) = pre.step()
        deadline = time.monotonic() + 30
        while pre.has_unfinished():
            assert time.monotonic() < deadline
            pre.step()
            time.sleep(0.002)
        assert dc.deliver("r", first.token_ids[0], None) is None
        tokens: list[int] = []
        while dec.has_unfinished():
            assert time.monotonic() < deadline
            tokens += [t for o in dec.step() for t in o.new_token_ids]
            time.sleep(0.002)
        assert tokens == want
        assert dec.spec is not None and dec.spec.stats.num_drafts > 0
        pre.check_block_accounting()
        dec.check_block_accounting()
    finally:
        sender.close()
        receiver.close()
