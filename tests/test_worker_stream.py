"""``worker.convert.chunk_from_outputs``: merged engine outputs become one wire chunk with exactly their tokens'
text and logprobs, even though the engine thread keeps appending to the request's live logprob list."""

from __future__ import annotations

from engine.llm_engine import RequestOutput
from engine.request import TokenLogprobs
from worker.convert import chunk_from_outputs


def _outputs(live: list[TokenLogprobs]) -> list[RequestOutput]:
    prompt = [1, 2, 3]
    return [RequestOutput("r", prompt, [], [10], "a", False, None, logprobs=live, num_cached_tokens=2),
            RequestOutput("r", prompt, [], [11, 12], "bc", False, None, logprobs=live, num_cached_tokens=2),
            RequestOutput("r", prompt, [], [13], "d", True, "stop", stop_reason="</s>", logprobs=live,
                          num_cached_tokens=2)]


def test_merged_chunk_joins_deltas_and_takes_the_last_outputs_state() -> None:
    chunk = chunk_from_outputs(_outputs([]), 0)
    assert list(chunk.token_ids) == [10, 11, 12, 13] and chunk.text == "abcd"
    assert chunk.finish_reason == "stop" and chunk.stop_reason == "</s>"
    assert chunk.num_cached_tokens == 2 and chunk.num_prompt_tokens == 3 and not chunk.logprobs


def test_logprobs_are_taken_by_position_not_up_to_the_live_lists_end() -> None:
    """Tokens 0-1 were sent already; the batch holds tokens 2-5, and the live list has grown to 8 entries."""
    live = [TokenLogprobs(100 + i, -float(i), [(100 + i, -float(i))]) for i in range(8)]
    outs = _outputs(live)
    chunk = chunk_from_outputs(outs, 2)
    assert [lp.token_id for lp in chunk.logprobs] == [102, 103, 104, 105]
    assert [lp.logprob for lp in chunk.logprobs] == [-2.0, -3.0, -4.0, -5.0]
    assert [(t.token_id, t.logprob) for t in chunk.logprobs[0].top] == [(102, -2.0)]
    single = chunk_from_outputs(outs[:1], 6)
    assert list(single.token_ids) == [10] and [lp.token_id for lp in single.logprobs] == [106]
    assert not single.finish_reason
