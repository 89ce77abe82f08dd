"""Tandem's non-protobuf wire formats: what the router and the workers must agree on byte for byte.

A leaf component: it imports nothing else of Tandem, so the router, the workers and the controller may all import
it, and a format has exactly one definition.

- :mod:`wire.framing`: length-prefixed frames, the plain-TCP ``Session`` transport between router and worker.
- :mod:`wire.redis_keys`: the Redis registry's keys and the KV event stream's key and fields.
"""
