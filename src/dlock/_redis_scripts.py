"""The Redis backends' server-side scripts, written once for both faces and for Redlock.

Every script touches only the keys of one lock name, and those keys share one hash tag,
so each script runs unchanged on a single server, on a Redis Cluster and on each
Redlock master. Keys of a name (``P`` is the configured prefix)::

    P:{n:NAME}:lease   hash owner/count/fence/holder, PEXPIRE = the lease
    P:{n:NAME}:fence   the fencing counter; never expires, and never falls behind the
                       server's clock in microseconds, so tokens never go back even after
                       a restart that lost the data or a failover to a lagging replica
    P:{n:NAME}:queue   zset of waiting owner tokens, scored by arrival
    P:{n:NAME}:qexp    zset of the same tokens, scored by when their place lapses

Leases live on the server's clock (PEXPIRE), never on the client's. Waiters queue so a
releaser that re-grabs in a tight loop cannot starve them: a free lock goes to the head
of the queue, and a newcomer only gets it when nobody is queued. A queued waiter that
vanishes without leaving (killed) loses its place when its entry lapses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Script:
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# Shared preamble. The server's clock is read where it is needed: by queue operations and
# by every grant (the fencing counter's floor); an uncontended release never reads it.
_PRELUDE = """
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function prune(queue, qexp, now)
    local dead = redis.call('ZRANGEBYSCORE', qexp, '-inf', now, 'LIMIT', 0, 100)
    if #dead > 0 then
        redis.call('ZREM', qexp, unpack(dead))
        redis.call('ZREM', queue, unpack(dead))
    end
end
local function wake(queue, channel)
    local head = redis.call('ZRANGE', queue, 0, 0)
    redis.call('PUBLISH', channel, head[1] or '')
end
"""

#: KEYS lease fence queue qexp; ARGV token ttl_ms holder reentrant place_ms keep_place
#: join. ``join`` (unless empty) first queues the token with that arrival time ("now":
#: the server's clock): a waiter joins the queue with its first attempt inside the core's
#: waiter, not with a round trip of its own, and every later attempt passes ``join``
#: too, which refreshes its place (only waiters are queued).
#: Returns {1, fence, count, left_queue} when granted, {0, ms_left} when busy (ms_left
#: -1: free, but not our turn). A grant takes the winner out of the queue, saving it a
#: round trip; Redlock keeps the place (keep_place=1) until a majority granted, since a
#: minority grant is given back and the waiter must still be first in line afterwards.
ACQUIRE = Script(
    _PRELUDE
    + """
local lease, fence, queue, qexp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token = ARGV[1]
local left_queue = 0
if ARGV[7] ~= '' then
    local now = now_ms()
    local arrival = now
    if ARGV[7] ~= 'now' then arrival = tonumber(ARGV[7]) end
    redis.call('ZADD', queue, 'NX', arrival, token)
    redis.call('ZADD', qexp, now + tonumber(ARGV[5]), token)
end
local owner = redis.call('HGET', lease, 'owner')
if owner then
    if owner == token and ARGV[4] == '1' then
        local count = redis.call('HINCRBY', lease, 'count', 1)
        redis.call('PEXPIRE', lease, ARGV[2])
        return {1, tonumber(redis.call('HGET', lease, 'fence')), count, 0}
    end
    return {0, redis.call('PTTL', lease)}
end
if redis.call('EXISTS', queue) == 1 then
    local now = now_ms()
    prune(queue, qexp, now)
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if head and head ~= token then
        return {0, -1}
    end
    if head and ARGV[6] ~= '1' then
        redis.call('ZREM', queue, token)
        redis.call('ZREM', qexp, token)
        left_queue = 1
    end
end
-- The counter never falls behind the server's clock in microseconds, so tokens keep
-- increasing after a restart that lost the data or a failover to a lagging replica.
local t = redis.call('TIME')
local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
local f = redis.call('INCR', fence)
if f < clock then
    redis.call('SET', fence, string.format('%.0f', clock))
    f = clock
end
redis.call('HSET', lease, 'owner', token, 'count', 1, 'fence', string.format('%.0f', f),
    'holder', ARGV[3])
redis.call('PEXPIRE', lease, ARGV[2])
return {1, f, 1, left_queue}
"""
)

#: KEYS lease queue qexp; ARGV token channel. Returns entries left, or -1 if not held.
RELEASE = Script(
    _PRELUDE
    + """
local lease, queue, qexp = KEYS[1], KEYS[2], KEYS[3]
local held = redis.call('HMGET', lease, 'owner', 'count')
if held[1] ~= ARGV[1] then
    return -1
end
if tonumber(held[2]) > 1 then
    return redis.call('HINCRBY', lease, 'count', -1)
end
redis.call('DEL', lease)
-- Every waiter queues before it waits, so with nobody queued there is nobody to wake.
if redis.call('EXISTS', queue) == 1 then
    prune(queue, qexp, now_ms())
    wake(queue, ARGV[2])
end
return 0
"""
)

#: KEYS lease; ARGV token ttl_ms. Returns 1 if extended, 0 if not held by token.
EXTEND = Script(
    """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
"""
)

#: KEYS lease queue qexp; ARGV token channel. Leaving the head of the queue while the
#: lock is free hands the turn on, or the next waiter would sit until its timer fires.
DEQUEUE = Script(
    _PRELUDE
    + """
local lease, queue, qexp = KEYS[1], KEYS[2], KEYS[3]
local head = redis.call('ZRANGE', queue, 0, 0)[1]
redis.call('ZREM', queue, ARGV[1])
redis.call('ZREM', qexp, ARGV[1])
if head == ARGV[1] and redis.call('EXISTS', lease) == 0 then
    prune(queue, qexp, now_ms())
    if redis.call('ZCARD', queue) > 0 then wake(queue, ARGV[2]) end
end
return 1
"""
)

#: KEYS lease. Returns {fence, count, holder, ms_left} or an empty reply when free.
INSPECT = Script(
    """
local v = redis.call('HMGET', KEYS[1], 'fence', 'count', 'holder', 'owner')
if not v[4] then return {} end
return {tonumber(v[1]), tonumber(v[2]), v[3], redis.call('PTTL', KEYS[1])}
"""
)

#: KEYS lease queue qexp; ARGV channel. Frees the lease whoever holds it; 1 if held.
FORCE_RELEASE = Script(
    _PRELUDE
    + """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
prune(KEYS[2], KEYS[3], now_ms())
wake(KEYS[2], ARGV[1])
return 1
"""
)

#: KEYS lease fence; ARGV token floor. Redlock: raise this master's counter (and the
#: lease's recorded token) to the token derived from the quorum. 1 if still held.
RAISE_FENCE = Script(
    """
local floor = tonumber(ARGV[2])
if tonumber(redis.call('GET', KEYS[2]) or '0') < floor then
    redis.call('SET', KEYS[2], ARGV[2])
end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[2])
return 1
"""
)
