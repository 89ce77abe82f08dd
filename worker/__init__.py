"""The worker process shared by every role: gRPC server, engine loop, health, load and KV events.

The roles' request lifecycles are KV connectors in :mod:`prefill_worker` and :mod:`decode_worker`, which import
nothing of this package; their gRPC faces are ``worker/prefill_service.py`` and ``worker/decode_service.py``.
``tandem worker --role`` picks one. ``both`` is the colocated mode (prefill and decode in one engine).
"""
