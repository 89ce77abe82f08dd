"""Step metadata for the torch attention path: the lone-sequence decode shortcut builds what the general path
builds, and steps outside its case fall through to the general path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine.attention as attention
from engine.attention import AttentionMetadata, build_metadata, paged_attention

CPU = torch.device("cpu")
BS = 4


def _general(ctx: int, row: list[int], window: int | None, monkeypatch: pytest.MonkeyPatch) -> AttentionMetadata:
    with monkeypatch.context() as m:
        m.setattr(attention, "_lone_decode", lambda *a: None)
        return build_metadata(np.array([1]), np.array([ctx]), np.array([row]), BS, window, CPU)


@pytest.mark.parametrize("ctx", [1, 4, 5, 13])
def test_lone_decode_metadata_equals_the_general_paths(ctx: int, monkeypatch: pytest.MonkeyPatch) -> None:
    row = [7, 8, 9, 10]  # one contiguous run of blocks
    fast = build_metadata(np.array([1]), np.array([ctx]), np.array([row]), BS, None, CPU)
    slow = _general(ctx, row, None, monkeypatch)
    assert fast.slot_mapping.tolist() == slow.slot_mapping.tolist() == [7 * BS + ctx - 1]
    (f,), (s,) = fast.groups, slow.groups
    assert (f.key_run, f.batch, f.max_q, f.max_ctx, f.causal) == (s.key_run, s.batch, s.max_q, s.max_ctx, s.causal)
    assert f.key_run == (7 * BS, ctx)
    assert f.mask is s.mask is None and f.key_blocks is s.key_blocks is None
    assert f.token_index is s.token_index is None and f.rows is s.rows is None and f.out_index is s.out_index is None

    g = torch.Generator().manual_seed(ctx)
    k = torch.randn(16, BS, 2, 8, generator=g)
    v = torch.randn(16, BS, 2, 8, generator=g)
    q = torch.randn(1, 4, 8, generator=g)
    assert torch.equal(paged_attention(q, k, v, fast, 0.3), paged_attention(q, k, v, slow, 0.3))


def test_lone_decode_over_scattered_blocks_takes_the_general_path() -> None:
    meta = build_metadata(np.array([1]), np.array([9]), np.array([[3, 11, 4]]), BS, None, CPU)
    (group,) = meta.groups
    assert group.key_run is None and group.key_blocks is not None
    assert group.key_blocks.tolist() == [3, 11, 4]
    assert meta.slot_mapping.tolist() == [4 * BS]


def test_lone_decode_whose_window_hides_keys_gets_a_mask() -> None:
    meta = build_metadata(np.array([1]), np.array([12]), np.array([[0, 1, 2]]), BS, 5, CPU)
    (group,) = meta.groups
    assert group.mask is not None
    assert group.mask[0, 0, 0].tolist() == [False] * 7 + [True] * 5


def test_lone_decode_reads_a_cache_that_starts_inside_its_storage() -> None:
    """Per-layer caches can be slices of one allocation: the key run's view must honour the storage offset."""
    g = torch.Generator().manual_seed(0)
    whole_k = torch.randn(40, BS, 2, 8, generator=g)
    whole_v = torch.randn(40, BS, 2, 8, generator=g)
    k, v = whole_k[20:36], whole_v[20:36]  # contiguous, storage offset 20 blocks
    q = torch.randn(1, 4, 8, generator=g)
    meta = build_metadata(np.array([1]), np.array([10]), np.array([[5, 6, 7]]), BS, None, CPU)
    assert meta.groups[0].key_run == (5 * BS, 10)
    keys = k.reshape(-1, 2, 8)[5 * BS : 5 * BS + 10].repeat_interleave(2, dim=1).transpose(0, 1)  # [4, 10, 8]
    values = v.reshape(-1, 2, 8)[5 * BS : 5 * BS + 10].repeat_interleave(2, dim=1).transpose(0, 1)
    ref = torch.softmax(q[0].unsqueeze(1) @ keys.transpose(1, 2) * 0.3, dim=-1) @ values  # [4, 1, 8]
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.3), ref.reshape(1, 32))
