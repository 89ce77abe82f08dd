"""Paged attention over the per-layer contiguous KV cache, in plain torch.

KV layout, per layer: ``k_cache`` and ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
One request's blocks for one layer are therefore a handful of contiguous runs, which is what lets the KV transfer
describe and send a layer as soon as it is computed.

A step's tokens arrive flattened (``[num_tokens, heads, head_dim]``, requests back to back). Sequences are split
into two groups that are padded separately, so a long prefill does not pad every decode:

- decode group: one new token per sequence, attending over its whole context;
- prefill group: several new tokens per sequence (a chunk), causal within the chunk and full over the cached prefix.

For each group :class:`AttentionMetadata` precomputes, once per step, the cache slots to gather keys from and the
boolean mask (causal, context length and optional sliding window). Every layer reuses them. Padded query rows
attend to key 0 so that no row is fully masked (their output is dropped). Fresh prefills without a cached prefix or
sliding window use the kernel's own causal mask instead of a mask tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    token_index: torch.Tensor  # [B * max_q] rows of the flat batch, padded rows point at row 0
    valid: torch.Tensor | None  # [B * max_q] bool, None when there is no padding
    key_slots: torch.Tensor  # [B, max_ctx] flat cache slots
    mask: torch.Tensor | None  # [B, 1, max_q, max_ctx] bool; None when ``causal`` or nothing needs masking
    causal: bool  # fresh prefills: the kernel's own (top-left) causal mask
    batch: int
    max_q: int
    max_ctx: int
    out_index: torch.Tensor  # [n_tokens_in_group] positions in the padded layout of each real token
    rows: torch.Tensor  # [n_tokens_in_group] rows of the flat batch this group owns


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token's K/V is written to
    groups: list[AttentionGroup]
    num_tokens: int


def build_metadata(
    q_lens: np.ndarray,
    ctx_lens: np.ndarray,
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """Build one step's metadata. ``q_lens[i]`` new tokens for sequence ``i``, whose context ends at ``ctx_lens[i]``."""
    starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    num_tokens = int(starts[-1])
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    for i, table in enumerate(block_tables):
        pos = np.arange(ctx_lens[i] - q_lens[i], ctx_lens[i])
        tbl = np.asarray(table, dtype=np.int64)
        slot_mapping[starts[i] : starts[i + 1]] = tbl[pos // block_size] * block_size + pos % block_size
    decode = np.flatnonzero(q_lens == 1)
    prefill = np.flatnonzero(q_lens > 1)
    groups = []
    for members in (decode, prefill):
        if len(members):
            groups.append(_group(members, q_lens, ctx_lens, starts, block_tables, block_size, sliding_window, device))
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device), groups=groups, num_tokens=num_tokens
    )


def _group(
    members: np.ndarray,
    q_lens: np.ndarray,
    ctx_lens: np.ndarray,
    starts: np.ndarray,
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> AttentionGroup:
    b = len(members)
    ql = q_lens[members]
    cl = ctx_lens[members]
    max_q = int(ql.max())
    max_ctx = int(cl.max())
    max_blocks = -(-max_ctx // block_size)
    tables = np.zeros((b, max_blocks), dtype=np.int64)
    for j, m in enumerate(members):
        t = block_tables[m][:max_blocks]
        tables[j, : len(t)] = t
    k_pos = np.arange(max_ctx)
    key_slots = tables[:, k_pos // block_size] * block_size + k_pos % block_size
    q_off = np.arange(max_q)
    q_valid = q_off[None, :] < ql[:, None]  # [b, max_q]
    token_index = np.where(q_valid, starts[members][:, None] + q_off[None, :], 0)
    rows = token_index[q_valid]
    out_index = np.flatnonzero(q_valid.reshape(-1))
    # Fresh prefills (no cached prefix) need no explicit mask: with right padding, top-left causal masking lets each
    # real query see exactly its own prefix, and the flash kernel runs without a mask tensor.
    plain_causal = sliding_window is None and bool((ql == cl).all())
    # Decodes over equal-length contexts (always so for one sequence) see every key: no mask either.
    unmasked = max_q == 1 and bool((cl == max_ctx).all()) and (sliding_window is None or sliding_window >= max_ctx)
    mask_t: torch.Tensor | None = None
    if not plain_causal and not unmasked:
        q_pos = (cl - ql)[:, None] + q_off[None, :]  # [b, max_q] absolute position of each query
        allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < cl[:, None, None])
        if sliding_window is not None:
            allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        allowed[:, :, 0] |= ~q_valid
        mask_t = torch.from_numpy(allowed[:, None]).to(device)
    all_valid = bool(q_valid.all())
    return AttentionGroup(
        token_index=torch.from_numpy(token_index.reshape(-1)).to(device),
        valid=None if all_valid else torch.from_numpy(q_valid.reshape(-1)).to(device),
        key_slots=torch.from_numpy(np.ascontiguousarray(key_slots)).to(device),
        mask=mask_t,
        causal=plain_causal,
        batch=b,
        max_q=max_q,
        max_ctx=max_ctx,
        out_index=torch.from_numpy(out_index).to(device),
        rows=torch.from_numpy(rows).to(device),
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new tokens' K/V ([T, kv_heads, head_dim]) into their cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for flat queries ``[T, heads, head_dim]`` over the paged cache; returns ``[T, heads*hd]``."""
    t, heads, hd = q.shape
    nb, bs, kvh, _ = k_cache.shape
    k_flat = k_cache.view(nb * bs, kvh, hd)
    v_flat = v_cache.view(nb * bs, kvh, hd)
    gqa = heads != kvh
    if len(meta.groups) == 1 and meta.groups[0].valid is None:
        g = meta.groups[0]
        out = _attend(q, k_flat, v_flat, g, scale, gqa)
        return out.reshape(t, heads * hd)
    out = q.new_empty(t, heads, hd)
    for g in meta.groups:
        qg = q.index_select(0, g.token_index)
        og = _attend(qg, k_flat, v_flat, g, scale, gqa).reshape(g.batch * g.max_q, heads, hd)
        out.index_copy_(0, g.rows, og.index_select(0, g.out_index))
    return out.reshape(t, heads * hd)


def _attend(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, g: AttentionGroup, scale: float, gqa: bool
) -> torch.Tensor:
    heads, hd = q.shape[1], q.shape[2]
    qb = q.view(g.batch, g.max_q, heads, hd).transpose(1, 2)
    kvh = k_flat.shape[1]
    slots = g.key_slots.reshape(-1)
    kb = k_flat.index_select(0, slots).view(g.batch, g.max_ctx, kvh, hd).transpose(1, 2)  # [B, kvh, ctx, hd]
    vb = v_flat.index_select(0, slots).view(g.batch, g.max_ctx, kvh, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, is_causal=g.causal, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)  # [B, max_q, heads, hd]
