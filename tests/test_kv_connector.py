"""The engine's KV connector seam (engine/kv_connector.py), driven by a fake connector on a real engine.

The fake stands in for a role's transport (no second engine process is needed to see what the engine does): the
test says which prompts' KV comes from elsewhere, which finished requests still send, and when each transfer ends.
Block ids are exact (4-token blocks, a fresh 16-block pool hands out 0, 1, 2, ... in order), and every path ends
with the pool's free count back at the start and the engine's block accounting clean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.kv_connector import EngineKV, FinishedTransfers, KVConnector, LoadDone, LoadFailed
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

BLOCKS = 16
PROMPT = list(range(3, 13))  # 10 tokens: blocks 0, 1, 2 of a fresh pool
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class FakeConnector(KVConnector):
    """Remote prompts, sends and transfer ends as the test scripts them; records what the engine told it."""

    def __init__(self, remote: Sequence[str] = (), sends: Sequence[str] = ()) -> None:
        self.remote, self.sends = set(remote), set(sends)
        self.loading: dict[str, list[int]] = {}  # loads started, on these blocks
        self.held: dict[str, list[int]] = {}  # finished requests whose send still reads these blocks
        self.saved: list[tuple[str, int]] = []  # (request, layer) of every save_kv_layer
        self.report = FinishedTransfers()  # what the next step is told
        self.kv: EngineKV | None = None
        self._step: list[str] = []

    def num_remote_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens if request.request_id in self.remote else 0

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self.loading.pop(request.request_id, None)
        if request.request_id in self.sends:
            self.held[request.request_id] = block_ids
        return request.request_id in self.sends

    def has_pending(self) -> bool:
        return bool(self.held or self.loading)

    def register_kv_caches(self, kv: EngineKV) -> None:
        self.kv = kv

    def start_load_kv(self, request: Request, block_ids: list[int]) -> None:
        self.loading[request.request_id] = block_ids

    def bind_step(self, requests: Sequence[Request], num_new_tokens: Sequence[int]) -> None:
        self._step = [r.request_id for r in requests]

    def save_kv_layer(self, layer: int) -> None:
        self.saved += [(rid, layer) for rid in self._step]

    def get_finished(self) -> FinishedTransfers:
        report, self.report = self.report, FinishedTransfers()
        for rid in report.sent:
            del self.held[rid]
        for rid in [d.request_id for d in report.loaded] + [f.request_id for f in report.failed]:
            del self.loading[rid]
        return report


def _engine(path: Path, connector: KVConnector | None) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=str(path), num_threads=1, cache=CacheConfig(block_size=4, num_blocks=BLOCKS)))
    if connector is not None:
        eng.attach_connector(connector)
    return eng


def _run(eng: LLMEngine, max_steps: int = 50) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in range(max_steps):
        if not eng.scheduler.has_unfinished():
            break
        outs += eng.step()
    return outs


def _assert_all_free(eng: LLMEngine) -> None:
    assert eng.pool.num_free_blocks == BLOCKS
    eng.check_block_accounting()


@pytest.fixture(scope="module")
def llama(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


def test_a_sending_request_holds_its_exact_blocks_after_finishing_until_its_send_ends(llama: Path) -> None:
    fake = FakeConnector(sends=["p"])
    eng = _engine(llama, fake)
    assert fake.kv is not None and fake.kv.block_size == 4 and len(fake.kv.kv_caches) == fake.kv.num_layers
    eng.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), "p")
    (out,) = eng.step()
    assert out.finished and len(out.token_ids) == 1
    assert fake.saved == [("p", layer) for layer in range(fake.kv.num_layers)]  # every layer, in order
    assert fake.held == {"p": [0, 1, 2]} and eng.kv.held["p"][0].block_id == 0
    assert eng.pool.num_free_blocks == BLOCKS - 3 and "p" not in eng.scheduler.requests
    assert eng.has_unfinished() and not eng.has_runnable()  # a step still polls the send; nothing to compute
    assert eng.step() == [] and eng.pool.num_free_blocks == BLOCKS - 3  # still sending: still held
    with pytest.raises(AssertionError, match="still held"):
        eng.check_block_accounting()
    fake.report.sent.append("p")  # the send ended, DONE or FAILED alike: the blocks are free again
    assert eng.step() == []
    assert not eng.has_unfinished() and not eng.kv.held
    _assert_all_free(eng)
    # Freed in eviction order and still cached: the same prompt hits blocks 0 and 1 (the last token is computed).
    eng.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), "again")
    eng.step()
    assert fake.held == {} and eng.pool.hit_blocks == 2


def test_a_request_that_does_not_send_frees_its_blocks_at_once(llama: Path) -> None:
    fake = FakeConnector()
    eng = _engine(llama, fake)
    eng.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), "p")
    eng.step()
    assert fake.held == {} and not eng.has_unfinished()
    _assert_all_free(eng)


def test_a_remote_request_waits_on_its_reserved_blocks_until_loaded_then_decodes_exactly(llama: Path) -> None:
    """The prompt's KV is written into the reserved blocks from a colocated engine's cache (what a transport
    does), so the remote request's tokens must equal the colocated run's."""
    sender = FakeConnector(sends=["c"])
    local = _engine(llama, sender)
    local.add_request(PROMPT, GREEDY, "c")
    want = [t for o in _run(local) for t in o.new_token_ids]
    assert len(want) == GREEDY.max_tokens and sender.held == {"c": [0, 1, 2, 3]}  # 16 tokens' KV, held

    fake = FakeConnector(remote=["d"])
    eng = _engine(llama, fake)
    req = eng.make_request(PROMPT, GREEDY, "d")
    assert eng.add(req)
    assert fake.loading == {"d": [0, 1, 2]} and req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert eng.pool.num_free_blocks == BLOCKS - 3
    for _ in range(3):  # waiting: no step computes it
        assert eng.step() == []
    assert fake.saved == [] and eng.has_unfinished() and not eng.has_runnable()
    assert eng.idle_wait_s(0.005) == 0.005  # the fake sets no remote_wait_s: the loop's own interval

    for (dk, dv), (sk, sv) in zip(eng.kv_caches, local.kv_caches, strict=True):
        dk[fake.loading["d"]] = sk[sender.held["c"][:3]]
        dv[fake.loading["d"]] = sv[sender.held["c"][:3]]
    sender.report.sent.append("c")
    local.step()
    _assert_all_free(local)
    fake.report.loaded.append(LoadDone("d", want[0]))
    outs = _run(eng)
    assert outs[0].new_token_ids == [want[0]]  # the remote engine's first token, accepted as sampled
    assert [t for o in outs for t in o.new_token_ids] == want
    assert outs[-1].finished and fake.loading == {}
    _assert_all_free(eng)


def test_a_failed_load_ends_the_request_in_error_with_its_message_and_frees_its_blocks(llama: Path) -> None:
    fake = FakeConnector(remote=["d"])
    eng = _engine(llama, fake)
    assert eng.add(eng.make_request(PROMPT, GREEDY, "d"))
    assert eng.pool.num_free_blocks == BLOCKS - 3
    fake.report.failed.append(LoadFailed("d", "KV transfer failed: peer gone"))
    (out,) = eng.step()
    assert out.finished and out.finish_reason == "error" and out.new_text == "KV transfer failed: peer gone"
    _assert_all_free(eng)


def test_an_aborted_remote_request_frees_its_blocks_and_the_connector_hears_of_it(llama: Path) -> None:
    fake = FakeConnector(remote=["d"])
    eng = _engine(llama, fake)
    assert eng.add(eng.make_request(PROMPT, GREEDY, "d"))
    assert fake.loading == {"d": [0, 1, 2]}
    (out,) = eng.abort(["d"])
    assert out.finish_reason == "abort" and fake.loading == {}
    _assert_all_free(eng)


def test_remote_kv_without_the_blocks_for_it_is_refused_and_keeps_nothing(llama: Path) -> None:
    fake = FakeConnector(remote=["big"])
    eng = _engine(llama, fake)
    eng.add_request(list(range(3, 3 + 4 * (BLOCKS - 2))), GREEDY, "other")  # holds 14 blocks once scheduled
    eng.step()
    assert not eng.add(eng.make_request(PROMPT, GREEDY, "big"))
    assert "big" not in eng.scheduler.requests and fake.loading == {}
    eng.abort(["other"])
    _assert_all_free(eng)


def test_a_start_load_that_raises_refuses_the_request_and_frees_its_blocks(llama: Path) -> None:
    class Refusing(FakeConnector):
        def start_load_kv(self, request: Request, block_ids: list[int]) -> None:
            raise ValueError("no lease")

    eng = _engine(llama, Refusing(remote=["d"]))
    with pytest.raises(ValueError, match="no lease"):
        eng.add(eng.make_request(PROMPT, GREEDY, "d"))
    assert "d" not in eng.scheduler.requests
    _assert_all_free(eng)


def test_a_connector_is_attached_once(llama: Path) -> None:
    eng = _engine(llama, FakeConnector())
    with pytest.raises(RuntimeError, match="attached once"):
        eng.attach_connector(FakeConnector())
