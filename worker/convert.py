"""Translation between the wire messages and the engine's types, in one place."""

from __future__ import annotations

from engine.llm_engine import RequestOutput
from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from proto.tandem.v1 import worker_pb2 as pb


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (from SamplingParams validation) for out-of-range values."""
    return SamplingParams(
        max_tokens=p.max_tokens or 16,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty or 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=not p.keep_special_tokens,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        structured=structured_from_proto(p.structured) if p.HasField("structured") else None,
    )


def structured_from_proto(s: pb.StructuredOutput) -> StructuredOutput:
    return StructuredOutput(kind=s.kind, spec=s.spec, strict=s.strict, num_replay_tokens=s.num_replay_tokens,
                            after_reasoning=s.after_reasoning)


def structured_to_proto(s: StructuredOutput) -> pb.StructuredOutput:
    return pb.StructuredOutput(kind=s.kind, spec=s.spec, strict=s.strict, num_replay_tokens=s.num_replay_tokens,
                               after_reasoning=s.after_reasoning)


def params_to_proto(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output, keep_special_tokens=not s.skip_special_tokens,
        logit_bias=dict(s.logit_bias),
    )
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(s.structured))
    return msg


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(lp: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])


def chunk_from_outputs(outs: list[RequestOutput], sent_tokens: int) -> pb.TokenChunk:
    """Consecutive outputs of one request (oldest first) as one wire chunk: their deltas joined, the last's state.

    ``sent_tokens`` is how many output tokens the stream already sent. ``RequestOutput.logprobs`` is the request's
    live list (the engine thread keeps appending), so the chunk takes exactly its own tokens' entries by position
    rather than "everything after what was sent", which would race with the next step.
    """
    last = outs[-1]
    token_ids = outs[0].new_token_ids if len(outs) == 1 else [t for out in outs for t in out.new_token_ids]
    lps = last.logprobs[sent_tokens:sent_tokens + len(token_ids)]
    chunk = pb.TokenChunk(token_ids=token_ids, text="".join(out.new_text for out in outs),
                          logprobs=[logprob_to_proto(lp) for lp in lps],
                          num_cached_tokens=last.num_cached_tokens, num_prompt_tokens=len(last.prompt_token_ids))
    if not sent_tokens and last.prompt_logprobs:  # the request's first chunk
        chunk.prompt_logprobs.extend(logprob_to_proto(lp) for lp in last.prompt_logprobs)
    if last.finished:
        chunk.finish_reason = last.finish_reason or ""
        if last.stop_reason is not None:
            chunk.stop_reason = str(last.stop_reason)
    return chunk
