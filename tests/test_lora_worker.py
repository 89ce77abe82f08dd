"""A real ``tandem worker --role both --lora NAME=DIR`` process: a Generate names its adapter in ``lora``, concurrent
streams of two adapters and the base model each equal the in-process engine (itself token-exact with transformers +
peft, tests/test_lora.py), an unknown adapter is refused with INVALID_ARGUMENT, and a multi-rank worker refuses
--lora at start (exit 2). Prefill and decode workers with adapters: tests/test_lora_disaggregated.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from cli.main import main as tandem
from engine.llm import LLM
from engine.lora.config import LoRAConfig
from engine.sampling_params import SamplingParams
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
MAX_NEW = 10
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [9, 81, 12, 33], [200, 1, 54, 76, 18]]


def test_worker_serves_adapters_by_name_and_refuses_unknown_ones(checkpoint: Callable[[str], Path],
                                                                  tmp_path: Path) -> None:
    base = checkpoint("llama")
    for name, targets, seed in (("a", "q_proj,v_proj", 1), ("b", "o_proj,down_proj", 2)):
        assert tandem(["model", "init-lora", str(base), str(tmp_path / name), "--targets", targets,
                       "--seed", str(seed)]) == 0
    adapters = (("a", str(tmp_path / "a")), ("b", str(tmp_path / "b")))
    names = ["a", "", "b"]
    llm = LLM(str(base), num_kv_blocks=64, lora=LoRAConfig(adapters))
    expected = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                           ignore_eos=True),
                                                  lora=[n or None for n in names])]
    w = start_worker("both", str(base), "tcp", ["--num-kv-blocks", "256", "--threads", "1",
                                                "--lora", f"a={tmp_path / 'a'}", "--lora", f"b={tmp_path / 'b'}"])
    try:
        async def run() -> tuple[list[list[int]], grpc.StatusCode]:
            async with grpc.aio.insecure_channel(w.address) as ch:
                stub = pb_grpc.WorkerStub(ch)
                params = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

                async def one(i: int) -> list[int]:
                    req = pb.GenerateRequest(request_id=f"lora-{i}", prompt_token_ids=PROMPTS[i], params=params,
                                             lora=names[i])
                    return [t async for chunk in stub.Generate(req, timeout=300) for t in chunk.token_ids]

                got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
                try:
                    bad = pb.GenerateRequest(request_id="nope", prompt_token_ids=PROMPTS[0], params=params, lora="c")
                    async for _ in stub.Generate(bad, timeout=60):
                        pass
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                return list(got), code

        got, code = asyncio.run(run())
    finally:
        w.stop()
    assert got == expected
    assert expected[0] != expected[1] or expected[2] != expected[1]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    refused = subprocess.run([sys.executable, "-m", "cli.main", "worker", "--role", "decode", "--model", str(base),
                              "--port", "0", "--kv-backend", "tcp", "--tp", "2", "--lora", f"a={tmp_path / 'a'}"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--lora runs on a single-rank worker" in refused.stderr, refused.stderr
