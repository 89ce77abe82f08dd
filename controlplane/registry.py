"""Whether a worker is registered in the Redis registry: the lease its worker writes (worker/redis_bus.py, under
the key wire/redis_keys.py defines, holding its address), signed with the cluster token (auth/signing.py). A replica
of a controller given a Redis URL is READY only once routers, which discover workers there and ignore entries
whose signature does not check, can see it."""

from __future__ import annotations

import asyncio
import json
import time

import redis.asyncio as aioredis

from auth.signing import BadSignature, verify
from wire.redis_keys import worker_pattern


async def registered(client: aioredis.Redis, address: str, token: str | None) -> bool:
    """A lease for ``address`` is there (with a good signature when there is a ``token``)."""
    async for key in client.scan_iter(match=worker_pattern(), count=500):
        raw = await client.get(key)
        if not raw:
            continue
        try:
            entry = json.loads(raw) if token is None else verify(raw, token)
        except (ValueError, BadSignature):
            continue
        if entry.get("address") == address:
            return True
    return False


async def wait_registered(url: str, address: str, timeout_s: float, token: str | None = None) -> None:
    """Return once a lease for ``address`` is in the registry at ``url``; TimeoutError after ``timeout_s``."""
    client = aioredis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while not await registered(client, address, token):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {address} not registered in {url} within {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()
