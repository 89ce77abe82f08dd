"""Paged attention over the per-layer contiguous KV cache, in plain torch.

KV layout, per layer: ``k_cache`` and ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
One request's blocks for one layer are therefore a handful of contiguous runs, which is what lets the KV transfer
describe and send a layer as soon as it is computed.

A step's tokens arrive flattened (``[num_tokens, heads, head_dim]``, requests back to back). Sequences are split
into two groups that are padded separately, so a long prefill does not pad every decode:

- decode group: one new token per sequence, attending over its whole context;
- prefill group: several new tokens per sequence (a chunk), causal within the chunk and full over the cached prefix.

For each group :class:`AttentionMetadata` precomputes, once per step, where to read keys from and the boolean mask
(causal, context length and optional sliding window); every layer reuses them. Three cases need no gather or mask:

- a group of one sequence whose blocks are one contiguous run reads K/V as a zero-copy view of the cache;
- fresh prefills (no cached prefix, no sliding window) use the kernel's own causal mask;
- decodes over equal-length contexts see every key, so they need no mask.

Padded query rows attend to key 0 so that no row is fully masked (their output is dropped). In bf16, batched
decode attention runs in float32: the CPU SDPA kernel is about 4x slower in bf16 for single query rows, and fp32 is
more accurate. A lone sequence keeps the bf16 kernel, which is cheap at batch 1 and matches transformers bit for bit.

Native path. On CPU, when the C kernel in ``engine/kernels`` builds, a step instead carries a :class:`NativePlan`
(the flat batch's query offsets, context lengths and block tables) and one kernel call per layer reads every
sequence's keys in place through its block table: no gathers, no masks, no padding, decodes and prefills in one
call. The groups above are then not built. The torch path stays for CUDA, for hosts without a compiler, and for
bf16 steps that the bf16 rule above keeps on SDPA (prefills and lone sequences). In bf16 on CPUs with AVX512-BF16
the kernel scores with VDPBF16PS on the cached keys (exact products, fp32 sums, scaled afterwards as SDPA scales).

A lone sequence's decode over one contiguous run of blocks (the common case: blocks are handed out in order) gets
its metadata from :func:`_lone_decode`, which builds the same group as the general path without its array
arithmetic; at batch 1 the step is short enough for that to show.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import kv_writer, paged_attention_kernel


@dataclass(slots=True)
class AttentionGroup:
    token_index: torch.Tensor | None  # [B * max_q] rows of the flat batch (padded rows → 0); None: identity
    key_blocks: torch.Tensor | None  # [B * max_blocks] cache blocks to gather; None when ``key_run`` is set
    key_run: tuple[int, int] | None  # (first slot, length): K/V are a contiguous slice of the cache
    mask: torch.Tensor | None  # [B, 1, max_q, max_ctx] bool; None when ``causal`` or nothing needs masking
    causal: bool  # fresh prefills: the kernel's own (top-left) causal mask
    batch: int
    max_q: int
    max_ctx: int
    out_index: torch.Tensor | None  # [n] positions in the padded layout of each real token; None: all rows real
    rows: torch.Tensor | None  # [n] rows of the flat batch this group owns; None: all rows, in order


@dataclass(slots=True)
class NativePlan:
    """The native kernel's view of a step: numpy arrays it reads through raw pointers (kept alive here)."""

    cu_q: np.ndarray  # [B + 1] int64: sequence b's queries are flat rows cu_q[b]:cu_q[b+1]
    ctx: np.ndarray  # [B] int64 context length after this step
    tables: np.ndarray  # [B, width] int64 block ids, C-contiguous
    window: int  # sliding window, 0 for none
    args: tuple[int, int, int, int, int]  # (cu_q ptr, ctx ptr, tables ptr, table stride, B)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token's K/V is written to
    groups: list[AttentionGroup]
    num_tokens: int
    cos: torch.Tensor | None = None  # [num_tokens, 1, head_dim] rotary tables gathered once per step
    sin: torch.Tensor | None = None
    native: NativePlan | None = None  # set: every layer's attention goes through the native kernel


def build_metadata(
    q_lens: np.ndarray,
    ctx_lens: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    native: bool = False,
) -> AttentionMetadata:
    """One step's metadata.

    ``q_lens[i]`` new tokens for sequence ``i``, whose context ends at ``ctx_lens[i]``; ``tables[i]`` its block ids,
    padded on the right. ``native``: plan for the native kernel (CPU only) instead of building torch groups.
    """
    n = len(q_lens)
    if n == 1 and not native and q_lens[0] == 1:
        lone = _lone_decode(int(ctx_lens[0]), tables[0], block_size, sliding_window, device)
        if lone is not None:
            return lone
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    num_tokens = int(starts[-1])
    seq_of = np.repeat(np.arange(n), q_lens)
    pos = np.arange(num_tokens) - starts[seq_of] + (ctx_lens - q_lens)[seq_of]
    slot_mapping = tables[seq_of, pos // block_size] * block_size + pos % block_size
    if native:
        tab = np.ascontiguousarray(tables, dtype=np.int64)
        ctx = np.ascontiguousarray(ctx_lens, dtype=np.int64)
        plan = NativePlan(cu_q=starts, ctx=ctx, tables=tab, window=sliding_window or 0,
                          args=(starts.ctypes.data, ctx.ctypes.data, tab.ctypes.data, tab.shape[1], n))
        slots = torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64))
        return AttentionMetadata(slot_mapping=slots, groups=[], num_tokens=num_tokens, native=plan)
    decode = q_lens == 1
    groups = []
    if decode.all() or not decode.any():
        groups.append(_group(np.arange(n), True, q_lens, ctx_lens, starts, tables, block_size,
                             sliding_window, device))
    else:
        for members in (np.flatnonzero(decode), np.flatnonzero(~decode)):
            groups.append(_group(members, False, q_lens, ctx_lens, starts, tables, block_size,
                                 sliding_window, device))
    return AttentionMetadata(slot_mapping=torch.from_numpy(slot_mapping).to(device), groups=groups,
                             num_tokens=num_tokens)


def _lone_decode(ctx: int, table: np.ndarray, block_size: int, sliding_window: int | None,
                 device: torch.device) -> AttentionMetadata | None:
    """The metadata :func:`_group` builds for one sequence decoding one token over a contiguous run of blocks,
    without its array arithmetic (a lone sequence's step is short enough for that to show), or None when the case
    needs more: a sliding window that hides keys, or blocks that are not one run."""
    if sliding_window is not None and sliding_window < ctx:
        return None
    num_blocks = -(-ctx // block_size)
    if not _contiguous_run(table, num_blocks):
        return None
    first = int(table[0])
    pos = ctx - 1
    slot = (first + pos // block_size) * block_size + pos % block_size
    group = AttentionGroup(token_index=None, key_blocks=None, key_run=(first * block_size, ctx), mask=None,
                           causal=False, batch=1, max_q=1, max_ctx=ctx, out_index=None, rows=None)
    return AttentionMetadata(slot_mapping=torch.tensor([slot], dtype=torch.int64, device=device), groups=[group],
                             num_tokens=1)


def _contiguous_run(table: np.ndarray, num_blocks: int) -> bool:
    """Whether the first ``num_blocks`` ids of ``table`` are consecutive (a Python list compare: a lone sequence's
    table is short, and array ops cost more than they save there)."""
    ids = table[:num_blocks].tolist()
    return num_blocks <= 1 or ids == list(range(ids[0], ids[0] + num_blocks))


def _group(
    members: np.ndarray,
    whole_batch: bool,
    q_lens: np.ndarray,
    ctx_lens: np.ndarray,
    starts: np.ndarray,
    tables: np.ndarray,
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
    q_off = np.arange(max_q)
    q_valid = q_off[None, :] < ql[:, None]  # [b, max_q]
    padded = not bool(q_valid.all())
    in_order = whole_batch and not padded

    key_run = None
    key_blocks = None
    if b == 1 and _contiguous_run(tables[members[0]], max_blocks):
        key_run = (int(tables[members[0], 0]) * block_size, max_ctx)
    else:
        # Whole blocks are gathered (a few KiB each, 4x faster than gathering token slots), then trimmed.
        key_blocks = torch.from_numpy(np.ascontiguousarray(tables[members][:, :max_blocks]).reshape(-1)).to(device)

    # Fresh prefills (no cached prefix) need no explicit mask: with right padding, top-left causal masking lets each
    # real query see exactly its own prefix.
    causal = max_q > 1 and sliding_window is None and bool((ql == cl).all())
    # Decodes over equal-length contexts (always so for one sequence) see every key.
    unmasked = max_q == 1 and bool((cl == max_ctx).all()) and (sliding_window is None or sliding_window >= max_ctx)
    mask_t = None
    if not causal and not unmasked:
        k_pos = np.arange(max_ctx)
        q_pos = (cl - ql)[:, None] + q_off[None, :]  # [b, max_q] absolute position of each query
        allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < cl[:, None, None])
        if sliding_window is not None:
            allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        allowed[:, :, 0] |= ~q_valid
        mask_t = torch.from_numpy(allowed[:, None]).to(device)

    token_index = rows = out_index = None
    if not in_order:
        idx = np.where(q_valid, starts[members][:, None] + q_off[None, :], 0)
        token_index = torch.from_numpy(idx.reshape(-1)).to(device)
        rows = torch.from_numpy(idx[q_valid]).to(device)
        out_index = torch.from_numpy(np.flatnonzero(q_valid.reshape(-1))).to(device)
    return AttentionGroup(token_index=token_index, key_blocks=key_blocks, key_run=key_run, mask=mask_t,
                          causal=causal, batch=b, max_q=max_q, max_ctx=max_ctx, out_index=out_index, rows=rows)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Scatter new tokens' K/V ([T, kv_heads, head_dim]) into their cache slots (``meta.slot_mapping``)."""
    nb, bs, h, d = k_cache.shape
    slot_mapping = meta.slot_mapping
    write = kv_writer() if k.device.type == "cpu" else None
    if write is not None and _rows_contiguous(k) and _rows_contiguous(v) and k_cache.is_contiguous() \
            and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous():
        # A plain byte copy per row, whichever attention path reads the cache afterwards.
        es = k.element_size()
        write(k.data_ptr(), k.stride(0) * es, v.data_ptr(), v.stride(0) * es, k_cache.data_ptr(), v_cache.data_ptr(),
              slot_mapping.data_ptr(), k.shape[0], h * d * es)
        return
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
    if meta.native is not None:
        return _attend_native(q, k_cache, v_cache, meta.native, scale)
    if len(meta.groups) == 1 and meta.groups[0].rows is None:
        return _attend(q, k_cache, v_cache, meta.groups[0], scale).reshape(t, heads * hd)
    out = q.new_empty(t, heads, hd)
    for g in meta.groups:
        qg = q if g.token_index is None else q.index_select(0, g.token_index)
        og = _attend(qg, k_cache, v_cache, g, scale).reshape(g.batch * g.max_q, heads, hd)
        if g.out_index is not None:
            og = og.index_select(0, g.out_index)
        if g.rows is None:
            out.copy_(og)
        else:
            out.index_copy_(0, g.rows, og)
    return out.reshape(t, heads * hd)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup,
            scale: float) -> torch.Tensor:
    heads, hd = q.shape[1], q.shape[2]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    if g.key_run is not None and k_cache.is_contiguous() and v_cache.is_contiguous():
        # One strided view per cache, [1, kvh, length, hd] over the run's slots (the strides of the view /
        # narrow / unsqueeze / transpose chain below, so SDPA takes the same path): a lone sequence's decode
        # pays this once per layer.
        first, length = g.key_run
        shape, stride = (1, kvh, length, hd), (length * kvh * hd, hd, kvh * hd, 1)
        kb = k_cache.as_strided(shape, stride, k_cache.storage_offset() + first * kvh * hd)
        vb = v_cache.as_strided(shape, stride, v_cache.storage_offset() + first * kvh * hd)
    elif g.key_run is not None:
        first, length = g.key_run
        nb = k_cache.shape[0]
        kb = k_cache.view(nb * bs, kvh, hd).narrow(0, first, length).unsqueeze(0).transpose(1, 2)
        vb = v_cache.view(nb * bs, kvh, hd).narrow(0, first, length).unsqueeze(0).transpose(1, 2)
    else:
        assert g.key_blocks is not None
        padded = g.key_blocks.shape[0] // g.batch * bs
        kb = k_cache.index_select(0, g.key_blocks).view(g.batch, padded, kvh, hd).narrow(1, 0, g.max_ctx)
        vb = v_cache.index_select(0, g.key_blocks).view(g.batch, padded, kvh, hd).narrow(1, 0, g.max_ctx)
        kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)  # [B, kvh, ctx, hd]
    qb = q.view(g.batch, g.max_q, heads, hd).transpose(1, 2)
    dtype = q.dtype
    if g.max_q == 1 and g.batch > 1 and dtype == torch.bfloat16 and q.device.type == "cpu":
        qb, kb, vb = qb.float(), kb.float(), vb.float()
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, is_causal=g.causal, scale=scale,
                                       enable_gqa=heads != kvh)
    o = o.transpose(1, 2)  # [B, max_q, heads, hd]
    return o if o.dtype == dtype else o.to(dtype)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, hd] with each token's heads back to back (token rows may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def native_attention_supported(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                               device: torch.device) -> bool:
    """Whether :func:`build_metadata` may plan for the native kernel for this layer shape (and the kernel built)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if kv_heads <= 0 or heads % kv_heads or heads // kv_heads > 16 or not 0 < head_dim <= 256:
        return False
    return paged_attention_kernel() is not None


def _attend_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: NativePlan,
                   scale: float) -> torch.Tensor:
    t, heads, hd = q.shape
    if not _rows_contiguous(q):
        q = q.contiguous()
    _, bs, kvh, _ = k_cache.shape
    out = torch.empty(t, heads * hd, dtype=q.dtype)
    kernel = paged_attention_kernel()
    assert kernel is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
    cu_q, ctx, tables, stride, b = plan.args
    rc = kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), cu_q, ctx, tables, stride, b,
                heads, kvh, hd, bs, plan.window, scale, q.dtype == torch.bfloat16, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native paged attention refused heads={heads} kv_heads={kvh} head_dim={hd}")
    return out
