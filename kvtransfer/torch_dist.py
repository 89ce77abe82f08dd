"""torch.distributed backend: a 2-rank process group per (sender, receiver) pair, point-to-point sends of block runs.

Handshake: the receiver hosts a ``TCPStore`` (its ``host:port`` is the endpoint in :class:`DestinationInfo`) and a
control listener whose address it publishes in that store. The first ``start`` towards a receiver claims a pair
index with ``store.add``, opens a control connection whose first message is that index, and both sides build a
2-rank group (gloo on CPU, NCCL on CUDA) over a ``PrefixStore`` for that pair; later requests reuse both.

Control goes through the control connection, payloads through the group. For everything queued when its worker
wakes (a layer; or a short request's HELLO, layers and FINISH together) the sender writes one control message of
wire frames per pair, then ``send``s each DATA frame's piece as a contiguous ``uint8`` view of the source blocks.
The receiver handles a message's frames in order: it validates each run of DATA headers against the reservation
and ``recv``s those payloads together, straight into the reserved blocks (head-sliced pieces through a staging
tensor). ACK/FAIL come back on the same connection. A connection whose first message names a pair index not
claimed in the store, or one already connected, is cut.

Why a socket for control and not a standing ``recv`` for headers: a gloo ``wait`` that times out closes the pair,
and a blocked ``wait`` cannot be interrupted, so a thread parked on an idle ``recv`` could never be stopped by
``close()``; a socket read ends when ``close()`` shuts the socket down. Why not the store (as before): a store
queue is polled, and each message cost a check, a get and a delete on top of the poll's sleep (5 ms of a 1 MiB
request's 7). Payload ``recv``s are only posted when bytes are known to be coming.

Failures: a peer killed mid-payload surfaces as a gloo error at once; a killed peer's kernel closes its control
connection, so either side sees EOF at once, between layers too; a sender alive but stalled is caught by the lease.
"""

from __future__ import annotations

from kvtransfer.torch_group import make_group
from kvtransfer.torch_receiver import TorchReceiver
from kvtransfer.torch_sender import TorchSender

__all__ = ["TorchReceiver", "TorchSender", "make_group"]
