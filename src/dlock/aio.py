"""The asyncio face of dlock: same behaviour as the sync face, awaitable.

async with dlock.aio.connect() as client:
    async with client.lock("nightly-report", ttl=30, timeout=10) as lock:
        ...
"""

from ._async.client import AsyncClient, connect
from ._async.lock import AsyncLock

__all__ = ["AsyncClient", "AsyncLock", "connect"]
