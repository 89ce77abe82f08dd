"""Parsing of the OpenAI request surface (router/openai_protocol.py): every field either takes effect on the wire
sampling params or is refused with a 400 that names it; batched prompts, best_of, logit_bias, echo and prompt
logprobs; and the response pieces of router/openai_responses.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from router.api_error import APIError
from router.openai_protocol import UNSUPPORTED, GenerationRequest, parse_request
from router.openai_responses import (
    Choice,
    best_indexes,
    completion_logprobs,
    final_body,
    joined,
    new_choice,
    prompt_logprobs,
)

MODEL = "tiny"
VOCAB = 512


@pytest.fixture(scope="module")
def tok(checkpoint: Callable[[str], Path]) -> Tokenizer:
    return Tokenizer(checkpoint("llama"))


def parse(tok: Tokenizer, chat: bool = False, **body: Any) -> GenerationRequest:
    base: dict[str, Any] = {"model": MODEL}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Hello"})
    base.update(body)
    return parse_request(base, chat, tok, MODEL, 256, VOCAB)


def refused(tok: Tokenizer, field: str, chat: bool = False, **body: Any) -> APIError:
    with pytest.raises(APIError) as e:
        parse(tok, chat, **body)
    assert e.value.status == 400 and e.value.param == field, e.value.message
    assert field in e.value.message
    return e.value


@pytest.mark.parametrize(("field", "value"), [
    ("response_format", {"type": "json_schema", "json_schema": {}}),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("functions", [{"name": "f"}]),
    ("guided_whitespace_pattern", " *"), ("suffix", "tail"),
    ("use_beam_search", True), ("skip_special_tokens", False), ("allowed_token_ids", [1, 2]),
    ("truncate_prompt_tokens", 8), ("chat_template", "{{ x }}"), ("cache_salt", "s")])
def test_unsupported_fields_are_refused_with_a_400_naming_them(tok: Tokenizer, field: str, value: Any) -> None:
    refused(tok, field, **{field: value})
    refused(tok, field, chat=True, **{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("response_format", {"type": "text"}), ("response_format", None), ("tools", []), ("tool_choice", "none"),
    ("suffix", None), ("suffix", ""), ("use_beam_search", False), ("skip_special_tokens", True),
    ("user", "someone"), ("metadata", {"a": "b"}), ("store", False), ("a_field_nobody_defined", 3)])
def test_defaults_of_unsupported_fields_and_unknown_fields_are_accepted(tok: Tokenizer, field: str,
                                                                        value: Any) -> None:
    assert parse(tok, **{field: value}).params.max_tokens == 16


def test_every_unsupported_field_refuses_a_non_default_value(tok: Tokenizer) -> None:
    for field, refuse in UNSUPPORTED.items():
        assert refuse(object()), field  # any value that is not the field's default


def test_echo_on_chat_and_special_tokens_against_the_endpoint_default_are_refused(tok: Tokenizer) -> None:
    refused(tok, "echo", chat=True, echo=True)
    refused(tok, "add_special_tokens", add_special_tokens=False)
    refused(tok, "add_special_tokens", chat=True, add_special_tokens=True)
    assert parse(tok, add_special_tokens=True).prompt_token_ids == parse(tok).prompt_token_ids


def test_logit_bias_reaches_the_wire_params(tok: Tokenizer) -> None:
    req = parse(tok, logit_bias={"5": 10, "17": -100.0})
    assert dict(req.params.logit_bias) == {5: 10.0, 17: -100.0}
    for bad in ({"x": 1}, {"5": 101}, {"5": "1"}, {str(VOCAB): 1}, [1, 2], {"-1": 1}):
        refused(tok, "logit_bias", logit_bias=bad)


def test_include_stop_str_in_output_reaches_the_wire_params(tok: Tokenizer) -> None:
    assert parse(tok, stop=["x"], include_stop_str_in_output=True).params.include_stop_str_in_output
    assert not parse(tok, stop=["x"]).params.include_stop_str_in_output
    refused(tok, "include_stop_str_in_output", include_stop_str_in_output="yes")


def test_a_list_of_prompts_is_a_batch_of_strings_or_token_lists(tok: Tokenizer) -> None:
    req = parse(tok, prompt=["Hello", "two words", [7, 8, 9]], n=2)
    assert req.prompts == [tok.encode("Hello"), tok.encode("two words"), [7, 8, 9]]
    assert req.prompt_token_ids == req.prompts[0] and req.n == 2 and req.best_of == 2
    assert req.num_prompt_tokens == sum(len(p) for p in req.prompts)
    assert parse(tok, prompt=[7, 8, 9]).prompts == [[7, 8, 9]]  # one prompt of token ids, not a batch
    for bad in ([], ["ok", ""], ["ok", []], ["ok", [VOCAB]], ["ok", 5], [["x"]]):
        refused(tok, "prompt", prompt=bad)
    refused(tok, "prompt", prompt=["a"] * 65)


def test_the_longest_prompt_of_a_batch_bounds_max_tokens(tok: Tokenizer) -> None:
    with pytest.raises(APIError) as e:
        parse(tok, prompt=[[1] * 10, [1] * 250], max_tokens=10)
    assert e.value.code == "context_length_exceeded"


def test_best_of_ranks_by_logprob_and_refuses_what_it_cannot_do(tok: Tokenizer) -> None:
    req = parse(tok, n=2, best_of=4)
    assert req.best_of == 4 and req.params.HasField("logprobs") and not req.want_logprobs
    assert not parse(tok, n=2).params.HasField("logprobs")
    refused(tok, "best_of", n=3, best_of=2)
    refused(tok, "best_of", n=1, best_of=2, stream=True)
    refused(tok, "best_of", best_of=21)
    refused(tok, "best_of", prompt=["a"] * 20, best_of=20)
    assert parse(tok, n=2, best_of=2, stream=True).stream  # best_of == n streams: nothing to rank


def test_echo_with_logprobs_asks_the_workers_for_prompt_logprobs(tok: Tokenizer) -> None:
    assert parse(tok, echo=True, logprobs=2).params.prompt_logprobs == 2
    assert not parse(tok, echo=True).params.HasField("prompt_logprobs")
    assert not parse(tok, logprobs=2).params.HasField("prompt_logprobs")
    req = parse(tok, prompt_logprobs=3)
    assert req.prompt_logprobs == 3 and req.params.prompt_logprobs == 3
    assert parse(tok, chat=True, prompt_logprobs=0).params.prompt_logprobs == 0
    refused(tok, "prompt_logprobs", prompt_logprobs=21)
    refused(tok, "echo", echo="yes")


def test_chat_logprobs_must_be_a_boolean(tok: Tokenizer) -> None:
    refused(tok, "logprobs", chat=True, logprobs=3)
    assert parse(tok, chat=True, logprobs=True, top_logprobs=2).logprobs == 2


def _lp(token: int, value: float, *top: tuple[int, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token, logprob=value, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_completion_logprobs_hold_the_sampled_token_and_offsets_run_on() -> None:
    text = {1: "a", 2: "bc", 3: "def", 4: "g"}.__getitem__
    first, end = completion_logprobs(text, [_lp(2, -0.5, (3, -0.25))], 0, lead=1)
    assert first == {"tokens": ["a", "bc"], "token_logprobs": [None, -0.5],
                     "top_logprobs": [None, {"def": -0.25, "bc": -0.5}], "text_offset": [0, 1]}
    assert end == 3
    second, end = completion_logprobs(text, [_lp(3, -0.25, (3, -0.25)), _lp(4, -1.0)], end)
    assert second["text_offset"] == [3, 6] and end == 7
    assert second["top_logprobs"] == [{"def": -0.25}, {"g": -1.0}]
    assert joined(first, second)["tokens"] == ["a", "bc", "def", "g"]


def test_prompt_logprobs_take_vllms_shape_and_best_indexes_rank() -> None:
    text = {1: "a", 2: "bc", 3: "def"}.__getitem__
    assert prompt_logprobs(text, [_lp(2, -0.5, (3, -0.25), (2, -0.5))], 1) == [
        None, {"3": {"logprob": -0.25, "decoded_token": "def"}, "2": {"logprob": -0.5, "decoded_token": "bc"}}]
    assert best_indexes([-3.0, -1.0, -2.0, -1.0], 2) == [1, 3]


def test_poison_values_are_400s_not_exceptions(tok: Tokenizer) -> None:
    refused(tok, "stop_token_ids", stop_token_ids=[True])
    refused(tok, "messages[0].content", chat=True, messages=[{"role": "user",
                                                              "content": [{"type": "text", "text": 5}]}])


def _done(req: GenerationRequest, tok: Tokenizer, index: int, ids: list[int], values: list[float]) -> Choice:
    c = new_choice(req, index, tok)
    c.token_ids, c.text, c.finish_reason = ids, tok.decode(ids), "length"
    c.logprobs = [_lp(t, v) for t, v in zip(ids, values, strict=True)]
    c.prompt_logprobs = [_lp(t, -1.0) for t in c.prompt[1:]]
    return c


def test_best_of_shows_the_n_best_of_each_prompt_renumbered(tok: Tokenizer) -> None:
    req = parse(tok, prompt=["a b", "c d"], n=1, best_of=3)
    scores = [[-3.0, -1.0, -2.0], [-0.5, -4.0, -0.1]]
    choices = [_done(req, tok, p * 3 + j, [10 + j], [scores[p][j]]) for p in range(2) for j in range(3)]
    assert [c.prompt for c in choices] == [req.prompts[0]] * 3 + [req.prompts[1]] * 3
    body = final_body(req, choices, lambda t: tok.decode([t]), tok.decode)
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [(0, tok.decode([11])), (1, tok.decode([12]))]
    assert body["choices"][0]["logprobs"] is None  # ranked by logprob, not asked for
    assert body["usage"]["prompt_tokens"] == req.num_prompt_tokens and body["usage"]["completion_tokens"] == 6


def test_echo_with_logprobs_puts_the_prompt_first_with_a_null_and_offsets_from_zero(tok: Tokenizer) -> None:
    req = parse(tok, prompt="Hello there", echo=True, logprobs=1)
    c = _done(req, tok, 0, [40, 41], [-0.5, -0.25])
    piece = final_body(req, [c], lambda t: tok.decode([t], skip_special_tokens=False), tok.decode)["choices"][0]
    lp = piece["logprobs"]
    assert piece["text"] == tok.decode(c.prompt) + c.text
    assert lp["token_logprobs"] == [None] + [-1.0] * (len(c.prompt) - 1) + [-0.5, -0.25]
    assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert len(lp["tokens"]) == len(c.prompt) + 2
    assert lp["text_offset"] == sorted(lp["text_offset"])
