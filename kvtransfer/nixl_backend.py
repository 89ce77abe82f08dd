"""NIXL backend: one-sided RDMA-style WRITE from prefill into decode's reserved blocks, one transfer per layer.

Why WRITE, layer by layer: the prefill side knows when a layer is ready, so it pushes that layer the moment
``send_layer`` is called and the transfer overlaps the remaining layers' compute. Decode's CPU is not involved in
moving bytes at all; it only watches notifications. A READ from decode would need a per-layer "ready" signal first
and add a round trip per layer.

Handshake: the receiver registers its K/V tensors with its agent once; ``reserve`` puts the agent metadata, the
agent name and every layer's (K, V) base address into :class:`DestinationInfo` (JSON, no pickle: NIXL's own
``get_serialized_descs`` pickles, so it is not used). ``start`` adds the receiver as a remote agent and sends a
HELLO notification carrying the sender's own metadata, so that the receiver can answer ACK/FAIL notifications.

Per layer the sender posts one WRITE over that layer's block-run descriptors (one per contiguous run for K and for
V; per token row when TP differs and only a head slice moves), with a DATA notification that NIXL delivers only
after the layer's bytes are in place. Every layer's WRITE is prepared (``prep_xfer_dlist`` once per leg,
``make_prepped_xfer`` per layer) when the first layer is posted, so a later layer costs one ``transfer`` call.
``send_layer`` only queues the layer and wakes the progress thread, which posts it at once; the last layer of a
DRAM transfer is posted by the caller itself (it is on the critical path, and nothing computes after it). Between
layers, with nothing in flight, that thread backs off instead of polling (and taking the GIL) every few tens of
microseconds.
The receiver counts landed bytes per layer from those notifications and is DONE when every layer landed; it then
sends ACK, which makes the sender DONE.

Waking the receiver: NIXL has no blocking wait for notifications, so the receiver's watcher polls on a schedule
that spares decode's CPU (sleeps of up to 20 ms). The receiver's endpoint is a UDP doorbell (``host:port``); the
sender rings it once a leg's last WRITE is complete (and after a FAIL), so the watcher wakes from its sleep at
once (:mod:`kvtransfer.doorbell`). The ring is a hint only: a lost datagram costs latency, never correctness.

Leases: both ends expire unfinished transfers and notify each other. A one-sided WRITE cannot be stopped by the
target, so on expiry the sender stops posting and the receiver reports FAILED; the sender's deadline is the earlier
of its own and the receiver's lease, so it does not post after the receiver gave up on time.

UCX stays on loopback here: ``TransferConfig.ucx_net_devices`` (default ``lo``) is written to ``UCX_NET_DEVICES``
before the agent is created (UCX reads only its environment). UCX picks the transports unless
``TransferConfig.ucx_tls`` names them: on one host, shared memory, where the sender's process performs the copy
and the receiver's CPU is not involved (see :func:`kvtransfer.nixl_agent.ucx_environment`).

CUDA tensors register as VRAM; the sender waits on an event recorded at ``send_layer`` before posting,
from its progress thread, so the forward pass never blocks.
"""

from __future__ import annotations

from kvtransfer.nixl_agent import make_agent, piece_offsets
from kvtransfer.nixl_receiver import NixlReceiver
from kvtransfer.nixl_sender import NixlSender

__all__ = ["NixlReceiver", "NixlSender", "make_agent", "piece_offsets"]
