"""TCP backend: framed messages over one persistent connection per (sender, receiver) pair.

Lifecycle per request: the sender opens (or reuses) a connection to the receiver's ``host:port`` at ``start`` and
sends HELLO with its layout; each ``send_layer`` queues that layer, and a single worker thread streams one DATA
frame per (piece, K/V) whose payload is a memoryview of the source blocks (no copies for full-head pieces);
``finish`` queues FINISH. The worker gathers everything already queued into one ``sendmsg`` run per connection
(headers and payloads side by side in one iovec list), so a layer of many pieces, or a short request's HELLO,
layers and FINISH, costs a few syscalls instead of two per frame, and small headers never go out as segments of
their own. The receiver reads each header, validates it against the reservation, and
``recv_into``s the payload straight into the reserved blocks (``MSG_WAITALL`` on a blocking socket: one call per
payload, the kernel copies into the tensor). When every layer has landed it answers ACK, and only then is the
sender DONE.

Failure semantics: a dropped connection (peer killed, closed, reset) fails every unfinished request on it at once, on
whichever side is still alive; a FAIL frame carries the other side's reason (compatibility, lease expiry, release); a
silent stall is caught by the lease (:mod:`kvtransfer.book`), and a sender stalled *inside* a payload past its lease has
its connection cut by the receiver's watchdog, so no read blocks forever. Writes are bounded by the earliest deadline
among the requests in the batch (``sendmsg`` with that timeout). CUDA tensors are staged through host memory (the sender
waits on an event recorded at ``send_layer``).
"""

from __future__ import annotations

from kvtransfer.tcp_receiver import TcpReceiver
from kvtransfer.tcp_sender import TcpSender

__all__ = ["TcpReceiver", "TcpSender"]
