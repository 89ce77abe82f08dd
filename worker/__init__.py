"""The worker process shared by every role: gRPC server, engine loop, health, load and KV events.

Role-specific request lifecycles live in :mod:`prefill_worker` and :mod:`decode_worker`; ``tandem worker --role``
picks one. ``both`` is the colocated mode (prefill and decode in one engine).
"""
