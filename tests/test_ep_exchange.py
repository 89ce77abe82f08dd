"""Expert-parallel dispatch and combine in :class:`engine.models.layers.SparseMoE`: with an exchange (all-gather or
all-to-all), EP ranks' MoE output is bit-identical to one rank holding every expert, in fp32 and bf16, for batches
from one token (a rank with an empty token slice) up, and when some experts receive no rows at all.

The ranks here are threads exchanging through :class:`engine.parallel.thread_group.ThreadGroup`; the same layer over
gloo between processes is ``tests/test_ep_parity.py`` (whole models) and :func:`test_gloo_exchange_matches_one_rank`.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.model_config import MoEConfig
from engine.models.layers import SparseMoE
from engine.parallel.process_group import GroupExchange, free_port
from engine.parallel.thread_group import ThreadGroup

HIDDEN = 64


def _moe(experts: int, top_k: int, dtype: torch.dtype, qwen: bool) -> MoEConfig:
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=48, norm_topk_prob=qwen,
                     weights_in_activation_dtype=qwen)


def _layers(moe: MoEConfig, dtype: torch.dtype, ep: int, seed: int) -> tuple[SparseMoE, list[SparseMoE]]:
    """One rank with every expert, and ``ep`` ranks holding a slice each, all from the same random weights."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(moe.num_experts, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(moe.num_experts, 2 * moe.intermediate_size, HIDDEN, generator=g) / 8).to(dtype)
    w2 = (torch.randn(moe.num_experts, HIDDEN, moe.intermediate_size, generator=g) / 8).to(dtype)
    local = moe.num_experts // ep

    def make(n: int, offset: int) -> SparseMoE:
        m = SparseMoE(HIDDEN, moe, dtype, num_local=n, expert_offset=offset)
        m.gate.data.copy_(gate)
        m.w13.data.copy_(w13[offset : offset + n])
        m.w2.data.copy_(w2[offset : offset + n])
        return m

    return make(moe.num_experts, 0), [make(local, r * local) for r in range(ep)]


def _run_threads(ranks: list[SparseMoE], x: torch.Tensor, dispatch: str) -> list[torch.Tensor]:
    group = ThreadGroup(len(ranks))
    outs: list[torch.Tensor | None] = [None] * len(ranks)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            ranks[r].exchange = group.exchange(r, dispatch)
            outs[r] = ranks[r].forward(x)
        except BaseException as e:
            errors.append(e)
            group.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return [o for o in outs if o is not None]


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("experts", "top_k", "ep", "qwen"),
                         [(8, 2, 2, False), (8, 2, 4, True), (6, 3, 3, True), (8, 4, 2, True)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 33])
def test_exchange_output_bit_identical_to_one_rank(dispatch: str, dtype: torch.dtype, experts: int, top_k: int,
                                                   ep: int, qwen: bool, tokens: int) -> None:
    moe = _moe(experts, top_k, dtype, qwen)
    one, ranks = _layers(moe, dtype, ep, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(7 + tokens)).to(dtype)
    want = one.forward(x)
    outs = _run_threads(ranks, x, dispatch)
    assert len(outs) == ep
    for r, got in enumerate(outs):
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want), f"rank {r}: differs from one rank by {float((got - want).abs().max()):.3g}"


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_exchange_with_idle_experts_and_an_idle_rank(dispatch: str) -> None:
    """Every token routed to experts 0 and 1 (rank 0's): rank 1 runs no expert and receives no row, yet it
    returns the same output."""
    moe = _moe(4, 2, torch.float32, qwen=False)
    one, ranks = _layers(moe, torch.float32, 2, seed=3)
    for m in (one, *ranks):
        m.gate.data[2:] = -m.gate.data[:2].abs().sum(0, keepdim=True) * 10  # experts 2, 3 never win
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1)).abs()
    want = one.forward(x)
    experts = torch.topk(torch.softmax(torch.nn.functional.linear(x, one.gate), -1), 2).indices
    assert set(experts.flatten().tolist()) == {0, 1}
    for got in _run_threads(ranks, x, dispatch):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summed_partials_are_exact_only_up_to_two_experts_per_token_and_the_exchange_always(dtype: torch.dtype) -> None:
    """Why the exchange: without one, each rank returns its experts' partial sum (the ``all_reduce`` baseline).
    Adding those in rank order matches one rank while a token has at most two experts (``0 + a + b``, every other
    term zero: Mixtral's top-2), but not with three or more (Qwen3-MoE checkpoints route to eight): ``a + (b + c)``
    is not ``(a + b) + c``. The exchange is exact in both cases."""
    x = torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    for experts, top_k, ep, exact in ((8, 2, 4, True), (6, 3, 3, False), (8, 4, 2, False)):
        one, ranks = _layers(_moe(experts, top_k, dtype, qwen=True), dtype, ep, seed=5)
        want = one.forward(x)
        parts = [m.forward(x) for m in ranks]
        assert not torch.equal(parts[0], want)  # rank 0 alone holds only its experts' share
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        bf16 = dtype is torch.bfloat16  # a last-bit difference of a bf16 value near 1 is 0.0078
        torch.testing.assert_close(total, want, rtol=1.6e-2 if bf16 else 1.3e-6, atol=1e-2 if bf16 else 1e-5)
        assert torch.equal(total, want) is exact, f"top-{top_k} over {ep} ranks"
        assert all(torch.equal(got, want) for got in _run_threads(ranks, x, "all_gather"))


def _gloo_rank(rank: int, port: int, dispatch: str, dtype: torch.dtype, tokens: int, q: mp.SimpleQueue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        moe = _moe(8, 2, dtype, qwen=dtype is torch.bfloat16)
        one, ranks = _layers(moe, dtype, 2, seed=11)
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        layer = ranks[rank]
        layer.exchange = GroupExchange(None, rank, 2, dispatch)
        got = layer.forward(x)
        q.put((rank, torch.equal(got, one.forward(x))))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gloo_exchange_matches_one_rank(dispatch: str, dtype: torch.dtype) -> None:
    """The same layer split over two processes joined by gloo (all_gather_single, all_to_all_single with
    uneven splits, bf16 included): both ranks' outputs equal the one-rank output, for one token and for 21."""
    for tokens in (1, 21):
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        port = free_port()
        procs = [ctx.Process(target=_gloo_rank, args=(r, port, dispatch, dtype, tokens, q)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert codes == [0, 0], f"rank exit codes {codes}"
        results = sorted(q.get() for _ in range(2))
        assert results == [(0, True), (1, True)], f"{tokens} tokens: {results}"
