"""Tests for :mod:`tinymodel.checkpoint`: the built-in random-weight checkpoints load and behave in ``transformers``."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Any, cast

import pytest
import torch
from safetensors import safe_open

from tinymodel.checkpoint import (
    SUPPORTED_TINY_ARCHS,
    TinyModelConfig,
    build_tokenizer,
    parameter_count,
    tiny_model_config,
    write_tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
MOE_ARCHS = ("mixtral", "qwen3_moe")
# Long enough (> 64 tokens) to cross Mistral's sliding window and give well over 64 scored positions in total.
MARGIN_PROMPTS = (
    "The server runs the model. Every request waits for the scheduler, and the cache keeps the blocks "
    "that the engine wrote for each prompt in the batch, because memory is small and latency matters a lot.",
    "def forward(self, x: torch.Tensor) -> torch.Tensor:\n    return self.down_proj(self.act(x))",
    "héllo 世界 🙂 Once upon a time in a quiet city, the teacher said that the river was bright.",
)
GENERATE_PROMPTS = ("The server runs the model.", "héllo 世界 🙂", "def forward(self, x):")


def _file_hashes(directory: pathlib.Path) -> dict[str, str]:
    """SHA-256 of every file in ``directory``, keyed by file name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _read_json(path: pathlib.Path) -> Any:
    """Load one JSON file."""
    return json.loads(path.read_text(encoding="utf-8"))


def _safetensors_keys(directory: pathlib.Path) -> list[str]:
    """All tensor names stored in the safetensors files of ``directory``."""
    keys: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys.extend(f.keys())
    return keys


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Every tiny architecture written once (seed 0) under one module-wide directory."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    for arch in SUPPORTED_TINY_ARCHS:
        write_tiny_checkpoint(root / arch, arch=arch, size="tiny", seed=0)
    return root


@pytest.fixture(scope="module", params=SUPPORTED_TINY_ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    """One supported architecture name."""
    return str(request.param)


@pytest.fixture(scope="module")
def ckpt(checkpoint_root: pathlib.Path, arch: str) -> pathlib.Path:
    """The tiny checkpoint directory of ``arch``."""
    return checkpoint_root / arch


@pytest.fixture(scope="module")
def loaded(ckpt: pathlib.Path) -> tuple[Any, dict[str, Any], Any]:
    """``(model, loading_info, tokenizer)`` loaded by transformers from the tiny checkpoint, in eval mode."""
    torch.manual_seed(0)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), output_loading_info=True)
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    return model, info, tokenizer


def test_tiny_checkpoint_contains_exactly_the_hf_files(ckpt: pathlib.Path) -> None:
    """A tiny checkpoint holds the six HF files, with a single unsharded ``model.safetensors`` and no index."""
    assert {p.name for p in ckpt.iterdir()} == TINY_FILES


def test_config_json_uses_real_checkpoint_fields(ckpt: pathlib.Path, arch: str) -> None:
    """config.json carries the family's real keys (legacy rope fields, window, head_dim, experts) and special ids."""
    config = _read_json(ckpt / "config.json")
    cfg = tiny_model_config(arch)
    expected_class = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }[arch]
    assert config["architectures"] == [expected_class]
    assert config["model_type"] == arch
    assert config["torch_dtype"] == "float32"
    assert config["hidden_act"] == "silu"
    assert config["max_position_embeddings"] == 4096
    assert config["rms_norm_eps"] == (1e-6 if arch.startswith("qwen") else 1e-5)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert config["intermediate_size"] == 688
    assert config["vocab_size"] == 2048
    assert config["tie_word_embeddings"] is (arch == "qwen2")
    assert "rope_parameters" not in config
    if arch == "llama":
        assert config["rope_theta"] == 500000.0
        assert config["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
    else:
        assert config["rope_theta"] == 1000000.0
        assert config.get("rope_scaling") is None
    if arch == "qwen2":
        assert config["use_sliding_window"] is False
    if arch in ("qwen3", "qwen3_moe"):
        assert config["head_dim"] == 64 != config["hidden_size"] // config["num_attention_heads"]
        assert config["attention_bias"] is False
    if arch == "mistral":
        assert config["sliding_window"] == 64
    if arch == "mixtral":
        assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    if arch == "qwen3_moe":
        assert (config["num_experts"], config["num_experts_per_tok"]) == (8, 2)
        assert config["moe_intermediate_size"] == 128
        assert config["norm_topk_prob"] is True
        assert config["decoder_sparse_step"] == 1
        assert config["mlp_only_layers"] == [1]

    generation = _read_json(ckpt / "generation_config.json")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert generation[key] == config[key]
    assert config["bos_token_id"] == cfg.bos_token_id == 2044
    assert config["eos_token_id"] == config["pad_token_id"] == cfg.eos_token_id == 2045

    tok_config = _read_json(ckpt / "tokenizer_config.json")
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["model_max_length"] == 4096
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"]) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|end_of_text|>",
    )
    assert "<|im_start|>" in tok_config["chat_template"]


def test_safetensors_keys_follow_real_on_disk_layout(ckpt: pathlib.Path, arch: str) -> None:
    """Tensor names match real checkpoints: qkv biases, tied head absent, per-expert MoE keys, q/k norms."""
    keys = set(_safetensors_keys(ckpt))
    assert "model.embed_tokens.weight" in keys
    assert ("lm_head.weight" in keys) is (arch != "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) is (arch == "qwen2")
    assert ("model.layers.3.self_attn.q_norm.weight" in keys) is (arch in ("qwen3", "qwen3_moe"))
    if arch == "mixtral":
        assert "model.layers.2.block_sparse_moe.gate.weight" in keys
        for weight in ("w1", "w2", "w3"):
            assert f"model.layers.2.block_sparse_moe.experts.3.{weight}.weight" in keys
        assert not any(".mlp." in k for k in keys)
    elif arch == "qwen3_moe":
        assert "model.layers.0.mlp.gate.weight" in keys
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.0.mlp.experts.7.{proj}.weight" in keys
            assert f"model.layers.1.mlp.{proj}.weight" in keys  # the dense layer of mlp_only_layers
        assert not any(k.startswith("model.layers.1.mlp.experts") for k in keys)
    else:
        assert "model.layers.0.mlp.gate_proj.weight" in keys
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        q_proj = f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()
    head_dim = 64 if arch in ("qwen3", "qwen3_moe") else 32
    assert q_proj == [8 * head_dim, 256]


def test_transformers_loads_with_no_missing_unexpected_or_mismatched_keys(
    loaded: tuple[Any, dict[str, Any], Any], arch: str
) -> None:
    """AutoModelForCausalLM loads every weight: empty loading info and the same parameter count as the files."""
    model, info, _ = loaded
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), f"{arch}: {kind} = {info.get(kind)}"
    assert sum(p.numel() for p in model.parameters()) == parameter_count(tiny_model_config(arch))
    assert model.dtype == torch.float32
    if arch == "qwen2":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_transformers_keeps_on_disk_values_when_fusing_experts(
    loaded: tuple[Any, dict[str, Any], Any], arch: str, ckpt: pathlib.Path
) -> None:
    """Expert weights that transformers fuses into ``gate_up_proj``/``down_proj`` equal the per-expert files."""
    if arch not in MOE_ARCHS:
        pytest.skip("dense architecture")
    model, _, _ = loaded
    experts = model.model.layers[0].mlp.experts
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        if arch == "mixtral":
            prefix, gate, up, down = "model.layers.0.block_sparse_moe.experts.1", "w1", "w3", "w2"
        else:
            prefix, gate, up, down = "model.layers.0.mlp.experts.1", "gate_proj", "up_proj", "down_proj"
        gate_up = torch.cat([f.get_tensor(f"{prefix}.{gate}.weight"), f.get_tensor(f"{prefix}.{up}.weight")], dim=0)
        torch.testing.assert_close(experts.gate_up_proj[1].detach(), gate_up, rtol=0, atol=0)
        down_proj = f.get_tensor(f"{prefix}.{down}.weight")
        torch.testing.assert_close(experts.down_proj[1].detach(), down_proj, rtol=0, atol=0)


def test_transformers_config_reflects_rope_window_and_head_dim(
    loaded: tuple[Any, dict[str, Any], Any], arch: str
) -> None:
    """transformers 5 folds legacy rope_theta/rope_scaling into ``rope_parameters`` and keeps window and head_dim."""
    model, _, _ = loaded
    config = model.config
    rope = dict(config.rope_parameters)
    if arch == "llama":
        assert rope == {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
    else:
        assert rope == {"rope_type": "default", "rope_theta": 1000000.0}
    assert getattr(config, "sliding_window", None) == (64 if arch == "mistral" else None)
    attn = model.model.layers[0].self_attn
    head_dim = 64 if arch in ("qwen3", "qwen3_moe") else 32
    assert attn.head_dim == head_dim
    assert attn.q_proj.out_features == 8 * head_dim
    assert attn.k_proj.out_features == 4 * head_dim
    assert (attn.q_proj.bias is not None) is (arch == "qwen2")
    if arch == "mixtral":
        assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    if arch == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.mlp_only_layers) == (8, 2, [1])
        assert config.norm_topk_prob is True
        assert hasattr(model.model.layers[0].mlp, "experts")
        assert not hasattr(model.model.layers[1].mlp, "experts")


def test_tokenizer_round_trips_unicode_and_prepends_bos(loaded: tuple[Any, dict[str, Any], Any]) -> None:
    """AutoTokenizer prepends bos, round-trips accented/CJK/emoji text and knows the special tokens."""
    _, _, tokenizer = loaded
    assert len(tokenizer) == 2048
    assert tokenizer.bos_token_id == 2044
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2045
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2046, 2047]
    assert tokenizer("hi").input_ids[0] == tokenizer.bos_token_id
    for text in ("héllo 世界 🙂", "  leading spaces\tand\nnewlines  ", "def f(x):\n    return x ** 2", "Ærø 👍🏽 ∑"):
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids[1:]) == text
    im = tokenizer("<|im_start|>user\nhi<|im_end|>").input_ids
    assert im[:2] == [2044, 2046] and im[-1] == 2047


def test_tokenizer_is_trained_and_sized_per_size() -> None:
    """The BPE has merges (common words are single tokens) and 2048/8192 tokens for tiny/small."""
    tiny = build_tokenizer(2048)
    assert tiny.get_vocab_size() == 2048
    assert len(tiny.encode("The server runs the model.", add_special_tokens=False).ids) <= 6
    small = build_tokenizer(8192)
    assert small.get_vocab_size() == 8192
    assert small.token_to_id("<|begin_of_text|>") == 8188
    assert small.decode(small.encode("héllo 世界 🙂").ids, skip_special_tokens=True) == "héllo 世界 🙂"


def test_chat_template_renders_chatml_with_generation_prompt(loaded: tuple[Any, dict[str, Any], Any]) -> None:
    """apply_chat_template renders ChatML turns, adds the assistant header on request and tokenizes to the same ids."""
    _, _, tokenizer = loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    assert list(ids) == tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_rewrite_with_same_seed_is_byte_identical_and_other_seed_differs(
    ckpt: pathlib.Path, arch: str, tmp_path: pathlib.Path
) -> None:
    """Writing the same (arch, size, seed) again gives identical bytes; another seed changes only the weights."""
    reference = _file_hashes(ckpt)
    assert _file_hashes(write_tiny_checkpoint(tmp_path / "again", arch=arch, seed=0)) == reference
    other = _file_hashes(write_tiny_checkpoint(tmp_path / "seed1", arch=arch, seed=1))
    assert other["model.safetensors"] != reference["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in reference.items() if k != "model.safetensors"
    }


def test_checkpoints_are_byte_identical_across_processes_and_thread_counts(
    checkpoint_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A fresh interpreter with single-threaded rayon/torch writes byte-identical files for every architecture."""
    script = textwrap.dedent(
        """
        import hashlib, json, pathlib, sys
        from tinymodel.checkpoint import SUPPORTED_TINY_ARCHS, write_tiny_checkpoint
        root = pathlib.Path(sys.argv[1])
        out = {}
        for arch in SUPPORTED_TINY_ARCHS:
            d = write_tiny_checkpoint(root / arch, arch=arch)
            out[arch] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "12345"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO_ROOT), env.get("PYTHONPATH"))))
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    other = json.loads(result.stdout.strip().splitlines()[-1])
    assert other == {arch: _file_hashes(checkpoint_root / arch) for arch in SUPPORTED_TINY_ARCHS}


def test_greedy_generate_produces_varied_tokens(loaded: tuple[Any, dict[str, Any], Any], arch: str) -> None:
    """Greedy generation of 16 tokens runs and does not collapse into one repeated token."""
    model, _, tokenizer = loaded
    outputs: list[list[int]] = []
    with torch.no_grad():
        for prompt in GENERATE_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            generated = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            new = generated[0, ids.shape[1] :].tolist()
            assert len(new) == 16
            outputs.append(new)
    distinct = [len(set(out)) for out in outputs]
    print(f"{arch}: distinct ids in 16 greedy tokens per prompt: {distinct}")
    assert min(distinct) >= 4, f"{arch}: greedy output degenerate: {outputs}"
    assert len({tuple(out) for out in outputs}) == len(outputs)


def test_top1_top2_logit_margin_is_comfortable(
    loaded: tuple[Any, dict[str, Any], Any], arch: str, record_property: Any
) -> None:
    """Over 64+ prompt positions, float32 logits have a std of several units and no top-1/top-2 near-tie."""
    model, _, tokenizer = loaded
    margins: list[torch.Tensor] = []
    stds: list[torch.Tensor] = []
    with torch.no_grad():
        for prompt in MARGIN_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            logits = model(ids).logits[0].float()
            top2 = logits.topk(2, dim=-1).values
            margins.append(top2[:, 0] - top2[:, 1])
            stds.append(logits.std(dim=-1))
    margin = torch.cat(margins)
    std = torch.cat(stds)
    assert margin.numel() >= 64
    record_property("min_top2_margin", float(margin.min()))
    print(f"{arch}: {margin.numel()} positions, min top1-top2 margin {float(margin.min()):.4f}, "
          f"median {float(margin.median()):.3f}, mean logit std {float(std.mean()):.2f}")
    assert float(margin.min()) > 1e-3
    assert 3.0 < float(std.mean()) < 10.0


def test_moe_router_topk_selection_has_no_near_ties(
    loaded: tuple[Any, dict[str, Any], Any], arch: str, record_property: Any
) -> None:
    """In every MoE layer the k-th and (k+1)-th router logits are clearly apart, so expert choice is unambiguous."""
    if arch not in MOE_ARCHS:
        pytest.skip("dense architecture")
    model, _, tokenizer = loaded
    gaps: list[float] = []
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(routers) == (4 if arch == "mixtral" else 3)

    def hook(module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        ordered = output[0].float().sort(dim=-1, descending=True).values
        k = cast(int, module.top_k)
        gaps.append(float((ordered[:, k - 1] - ordered[:, k]).min()))

    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        with torch.no_grad():
            for prompt in MARGIN_PROMPTS:
                model(tokenizer(prompt, return_tensors="pt").input_ids)
    finally:
        for handle in handles:
            handle.remove()
    record_property("min_router_gap", min(gaps))
    print(f"{arch}: min router k/k+1 logit gap {min(gaps):.4f}")
    assert min(gaps) > 1e-4


def test_unknown_arch_or_size_raises_value_error(tmp_path: pathlib.Path) -> None:
    """Bad arch, size or seed raise ValueError naming the bad value, before anything is written."""
    with pytest.raises(ValueError, match="gpt2"):
        write_tiny_checkpoint(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="huge"):
        write_tiny_checkpoint(tmp_path / "x", arch="llama", size="huge")
    with pytest.raises(ValueError, match="-1"):
        write_tiny_checkpoint(tmp_path / "x", arch="llama", seed=-1)
    assert not (tmp_path / "x").exists()


def test_config_dataclass_validates_fields() -> None:
    """TinyModelConfig rejects inconsistent shapes in __post_init__ and is frozen."""
    good = tiny_model_config("qwen3_moe")
    fields = {name: getattr(good, name) for name in TinyModelConfig.__dataclass_fields__}
    for change, pattern in (
        ({"num_key_value_heads": 3}, "multiple"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": (7,)}, "mlp_only_layers"),
        ({"arch": "bert"}, "bert"),
    ):
        with pytest.raises(ValueError, match=pattern):
            TinyModelConfig(**{**fields, **change})
    with pytest.raises(AttributeError):
        good.hidden_size = 1  # type: ignore[misc]


@pytest.mark.slow
def test_small_checkpoint_is_sharded_with_consistent_index(tmp_path: pathlib.Path) -> None:
    """size=small writes >= 2 numbered shards plus an index that maps every tensor, at roughly 110M parameters."""
    out = write_tiny_checkpoint(tmp_path / "small", arch="llama", size="small")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 2
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", name) for name in shards)
    assert not (out / "model.safetensors").exists()
    index = _read_json(out / "model.safetensors.index.json")
    stored: dict[str, str] = {}
    total_bytes = 0
    for name in shards:
        with safe_open(str(out / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                stored[key] = name
                shape = f.get_slice(key).get_shape()
                total_bytes += 4 * int(torch.tensor(shape).prod())
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == total_bytes
    config = _read_json(out / "config.json")
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (768, 16, 8192)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (12, 4, 2048)
    assert index["metadata"]["total_parameters"] == parameter_count(tiny_model_config("llama", "small"))
    assert 100e6 < index["metadata"]["total_parameters"] < 130e6
    for arch in SUPPORTED_TINY_ARCHS:
        assert 100e6 < parameter_count(tiny_model_config(arch, "small")) < 200e6, arch
