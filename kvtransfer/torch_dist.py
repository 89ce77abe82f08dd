"""torch.distributed backend: a 2-rank process group per (sender, receiver) pair, point-to-point sends of block runs.

Handshake: the receiver hosts a ``TCPStore`` (its ``host:port`` is the endpoint in :class:`DestinationInfo`). The
first ``start`` towards a receiver claims a pair index with ``store.add`` and both sides build a 2-rank group
(gloo on CPU, NCCL on CUDA) over a ``PrefixStore`` for that pair; later requests reuse the group.

Control goes through the store, payloads through the group. For each layer the sender writes one store message
listing that layer's DATA headers (wire frames), then ``send``s each piece as a contiguous ``uint8`` view of the
source blocks. The receiver reads the message, validates every header against the reservation, and ``recv``s each
payload straight into the reserved blocks (head-sliced pieces through a staging tensor). ACK/FAIL travel back on a
second store queue.

Why the store and not a standing ``recv`` for headers: a gloo ``wait`` that times out closes the pair, and a
blocked ``wait`` cannot be interrupted, so a thread parked on an idle ``recv`` could never be stopped by
``close()``. Store waits time out harmlessly; payload ``recv``s are only posted when bytes are known to be coming.

Failures: a peer killed mid-payload surfaces as a gloo error at once; the receiver's death also breaks the
sender's store connection at once; a sender that dies between layers is caught by the lease.
"""

from __future__ import annotations

from kvtransfer.torch_group import make_group
from kvtransfer.torch_receiver import TorchReceiver
from kvtransfer.torch_sender import TorchSender

__all__ = ["TorchReceiver", "TorchSender", "make_group"]
