"""LoRA adapters changed at run time, in-process (worker/lora_admin.py over engine/lora/manager.py): an engine
started without adapters takes one (and then generates exactly as one started with it), unloads it (then refuses
it as unknown), refuses to unload an adapter an unfinished request runs under, refuses a bad directory naming it,
and refuses other content under a name it served (its cached KV is keyed by the name); content hashes and the
registry entry's adapter list."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from cli.main import main as tandem
from engine.llm import LLM
from engine.lora.config import LoRAConfig
from engine.lora.manager import UnknownAdapterError, content_hash
from engine.sampling_params import SamplingParams
from worker.lora_admin import AdapterInUse, AdaptersRefused, adapter_hashes, load_op, unload_op
from worker.redis_bus import WorkerAd
from worker.service import WorkerService

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 31, 2, 77, 19, 23, 101, 4]


@pytest.fixture(scope="module")
def adapters(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-runtime")
    for name, seed in (("a", 1), ("b", 2)):
        assert tandem(["model", "init-lora", str(base), str(root / name), "--targets", "q_proj,v_proj,o_proj",
                       "--seed", str(seed)]) == 0
    return {"a": root / "a", "b": root / "b"}


def test_load_use_unload_at_run_time_matches_an_engine_started_with_the_adapter(
        checkpoint: Callable[[str], Path], adapters: dict[str, Path]) -> None:
    base = str(checkpoint("llama"))
    started = LLM(base, num_kv_blocks=64, lora=LoRAConfig((("a", str(adapters["a"])),)))
    expected = started.generate([PROMPT], GREEDY, lora="a")[0].token_ids
    llm = LLM(base, num_kv_blocks=64)
    base_out = llm.generate([PROMPT], GREEDY)[0].token_ids
    svc = WorkerService(llm.engine)
    infos = load_op(svc, "a", str(adapters["a"]))(llm.engine)
    assert [(i.name, i.content_hash, i.resident) for i in infos] == [("a", content_hash(adapters["a"]), True)]
    assert llm.generate([PROMPT], GREEDY, lora="a")[0].token_ids == expected != base_out
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == base_out  # the base model is untouched
    assert load_op(svc, "a", str(adapters["a"]))(llm.engine) == infos  # the same content again: a no-op

    rid = llm.engine.add_request(PROMPT, GREEDY, lora="a")
    with pytest.raises(AdapterInUse, match="in use by 1 unfinished"):
        unload_op(svc, "a")(llm.engine)
    llm.engine.abort([rid])
    assert unload_op(svc, "a")(llm.engine) == []
    with pytest.raises(UnknownAdapterError, match="'a'"):
        llm.generate([PROMPT], GREEDY, lora="a")
    with pytest.raises(UnknownAdapterError, match="'a'"):
        unload_op(svc, "a")(llm.engine)
    with pytest.raises(ValueError, match="already served other content"):  # a's cached KV is keyed by its name
        load_op(svc, "a", str(adapters["b"]))(llm.engine)
    assert [i.name for i in load_op(svc, "a", str(adapters["a"]))(llm.engine)] == ["a"]  # its own content: fine
    assert llm.generate([PROMPT], GREEDY, lora="a")[0].token_ids == expected
    assert adapter_hashes(llm.engine) == {"a": content_hash(adapters["a"])}
    assert llm.engine.pool.num_used_blocks == 0  # the aborted request's blocks were freed too


def test_bad_loads_are_refused_naming_the_problem(checkpoint: Callable[[str], Path], adapters: dict[str, Path],
                                                  tmp_path: Path) -> None:
    llm = LLM(str(checkpoint("llama")), num_kv_blocks=32)
    svc = WorkerService(llm.engine)
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_op(svc, "x", str(missing))(llm.engine)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape("adapter_config.json")):
        load_op(svc, "x", str(tmp_path / "empty"))(llm.engine)
    with pytest.raises(ValueError, match="must be letters"):
        load_op(svc, "bad name", str(adapters["a"]))(llm.engine)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING", "r": 4}))
    (wrong / "adapter_model.safetensors").write_bytes((adapters["a"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="PREFIX_TUNING"):
        load_op(svc, "x", str(wrong))(llm.engine)
    assert adapter_hashes(llm.engine) == {}  # nothing was half added
    svc.replica = object()  # a worker with ranks (--tp/--pp/--ep)
    with pytest.raises(AdaptersRefused, match="single-rank"):
        load_op(svc, "a", str(adapters["a"]))(llm.engine)


def test_registry_entry_carries_the_adapters() -> None:
    ad = WorkerAd("w-1", "127.0.0.1:1", "both", "", loras={"a": "0123456789abcdef"})
    assert ad.to_dict()["loras"] == {"a": "0123456789abcdef"}
    assert json.loads(ad.to_json())["loras"] == {"a": "0123456789abcdef"}
