"""The TCP KV backend under mutual TLS (kvtransfer/tcp.py with TransferConfig's contexts).

A real sender and receiver on loopback, each with a certificate from a throwaway CA: two requests land bit-exact
in non-contiguous blocks, layer by layer, through the TLS path (``DuplexTLS`` in place of the socket; large
payloads decrypted straight into the reserved blocks). Refused: a sender with a certificate from another CA (its
transfer fails on both sides with the reason, and nothing lands) and a sender that speaks plaintext.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest

from auth.dev_certs import DevCA
from auth.tls import TLSFiles, client_context, server_context
from bench.kv_peer import digest, make_caches
from kvtransfer.base import TransferState
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout
from kvtransfer.tcp import TcpReceiver, TcpSender

LAYOUT = KVLayout("tiny-llama", "float16", num_layers=4, block_size=4, num_kv_heads=2, head_dim=64)
NUM_BLOCKS = 64
REQUESTS = {"req-a": ([0, 1, 2, 7, 8], [3, 4, 9, 10, 11], 18), "req-b": ([12, 13, 20, 21], [30, 5, 6, 7], 15)}


def _tls(files: TLSFiles) -> TransferConfig:
    return TransferConfig(tls_server=server_context(files), tls_client=client_context(files))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TLSFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = DevCA.create(d / "ca"), DevCA.create(d / "other", "other-ca")
    return {"prefill": ca.issue(d, "prefill"), "decode": ca.issue(d, "decode"),
            "foreign": dataclasses.replace(other.issue(d / "foreign", "intruder"), ca=ca.cert)}


@pytest.fixture
def receiver(pki: dict[str, TLSFiles]) -> Iterator[tuple[TcpReceiver, list]]:
    r = TcpReceiver(_tls(pki["decode"]))
    dst = make_caches(LAYOUT, NUM_BLOCKS, None)
    r.register(dst, LAYOUT)
    yield r, dst
    r.close()


def _wait(pred: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


def test_two_requests_land_bit_exact_over_mutual_tls(receiver: tuple[TcpReceiver, list],
                                                     pki: dict[str, TLSFiles]) -> None:
    r, dst = receiver
    src = make_caches(LAYOUT, NUM_BLOCKS, 7)
    s = TcpSender(_tls(pki["prefill"]))
    s.register(src, LAYOUT)
    try:
        for rid, (src_ids, dst_ids, ntok) in REQUESTS.items():
            d = r.reserve(rid, dst_ids, ntok, time.time() + 20)
            s.start(rid, d, src_ids, time.time() + 20)
            for layer in range(LAYOUT.num_layers):
                s.send_layer(rid, layer)
                assert _wait(lambda: r.poll(rid).layers_done > layer, 10), r.poll(rid)  # noqa: B023
            s.finish(rid)
            assert _wait(lambda: r.poll(rid).finished and s.poll(rid).finished, 10), (r.poll(rid), s.poll(rid))  # noqa: B023
            assert r.poll(rid).state == s.poll(rid).state == TransferState.DONE
            assert digest(src, src_ids) == digest(dst, dst_ids)
    finally:
        s.close()


@pytest.mark.parametrize("who", ["foreign certificate", "plaintext"])
def test_a_sender_without_the_clusters_certificate_is_refused(receiver: tuple[TcpReceiver, list],
                                                              pki: dict[str, TLSFiles], who: str) -> None:
    r, dst = receiver
    src = make_caches(LAYOUT, NUM_BLOCKS, 8)
    s = TcpSender(_tls(pki["foreign"]) if who == "foreign certificate" else TransferConfig())
    s.register(src, LAYOUT)
    try:
        d = r.reserve("x", [1, 2], 8, time.time() + 3)
        s.start("x", d, [3, 4], time.time() + 3)
        for layer in range(LAYOUT.num_layers):
            s.send_layer("x", layer)
        s.finish("x")
        assert _wait(lambda: s.poll("x").finished, 10), s.poll("x")
        assert s.poll("x").state == TransferState.FAILED and s.poll("x").error
        assert _wait(lambda: r.poll("x").finished, 10), r.poll("x")  # its lease runs out: nothing landed
        assert r.poll("x").state == TransferState.FAILED and r.poll("x").layers_done == 0
        assert not any(k[1:3].any() or v[1:3].any() for k, v in dst)
    finally:
        s.close()
