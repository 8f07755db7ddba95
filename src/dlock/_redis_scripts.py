"""The Redis backends' server-side scripts, written once for both faces and for Redlock.

Every script touches only the keys of one lock name, and those keys share one hash tag,
so each script runs unchanged on a single server, on a Redis Cluster and on each
Redlock master. Keys of a name (``P`` is the configured prefix)::

    P:{n:NAME}:lease   "owner count fence holder", PEXPIRE = the lease (a string, not a
                       hash: one SET NX PX takes a free lock)
    P:{n:NAME}:fence   the fencing counter; never falls behind the server's clock in
                       microseconds, so tokens never go back even after a restart that
                       lost the data or a failover to a lagging replica; and so it can
                       expire a day after the name's last grant (``FENCE_KEPT_MS``):
                       names used once leave nothing behind for long
    P:{n:NAME}:queue   zset of waiting owner tokens, scored by arrival
    P:{n:NAME}:qexp    zset of the same tokens, scored by when their place lapses
    P:{n:NAME}:info    hash token -> "lease_ms attempt holder": what a grant on the
                       waiter's behalf needs; once it was granted so (handed the lease
                       by a release), "h attempt fence": the only lease its leave
                       may give back
                       (the queue's three keys expire twice a place's length after
                       the latest join, so a name's dead waiters leave nothing behind)
    P:{n:NAME}:wake:T  the pub/sub channel of waiter T (a channel, not a key)

Leases live on the server's clock (PEXPIRE), never on the client's. Waiters queue so a
releaser that re-grabs in a tight loop cannot starve them: a free lock goes to the head
of the queue, and a newcomer only gets it when nobody is queued. A release hands the
lease straight to the head of the queue and tells it so on its own channel, so a
hand-off costs the next holder no round trip and wakes no other waiter. A queued waiter
that vanishes without leaving (killed) loses its place when its entry lapses, and a
lease handed to it lasts no longer than its place would have (``lease_ms``).
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


#: How long a name's fencing counter outlives its last grant. Its tokens are at most
#: the clock of their time (a name is taken at most once per microsecond, give or take
#: a burst), so once the counter is gone the clock alone keeps the next token larger,
#: unless the server's clock goes back by more than this.
FENCE_KEPT_MS = 86_400_000

# Lua runs every ``local function`` statement on every call, so the uncontended paths
# (nobody queued) come first and define only ``mint``; the queue's helpers (``_QUEUE``)
# are spliced into the branches that need them.
_MINT = f"""
-- The fencing counter never falls behind the server's clock in microseconds, so tokens
-- keep increasing after a restart that lost the data or a failover to a lagging replica,
-- or once the counter of a name unused for long has expired.
local function mint(fence)
    local t = redis.call('TIME')
    local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local f = redis.call('INCR', fence)
    if f < clock then
        f = string.format('%.0f', clock)
        redis.call('SET', fence, f, 'PX', {FENCE_KEPT_MS})
        return f
    end
    redis.call('PEXPIRE', fence, {FENCE_KEPT_MS})
    return string.format('%.0f', f)
end
"""

#: The lease's value: owner token, entry count, fencing token, holder (JSON).
_PARSE = """
local function parse(value)
    local owner, count, f, holder = string.match(value, '^(%S+) (%d+) (%d+) (.*)$')
    return owner, tonumber(count), f, holder
end
"""

_QUEUE = """
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function leave(queue, qexp, info, tokens)
    redis.call('ZREM', queue, unpack(tokens))
    redis.call('ZREM', qexp, unpack(tokens))
    redis.call('HDEL', info, unpack(tokens))
end
local function prune(queue, qexp, info)
    local dead = redis.call('ZRANGEBYSCORE', qexp, '-inf', now_ms(), 'LIMIT', 0, 100)
    if #dead > 0 then leave(queue, qexp, info, dead) end
end
local function grant(lease, fence, token, ttl_ms, holder)
    local f = mint(fence)
    redis.call('SET', lease, token .. ' 1 ' .. f .. ' ' .. holder, 'PX', ttl_ms)
    return f
end
-- The lock is free: hand it to the head of the queue. With hand_over = '1' the lease is
-- granted to the head here and its message carries the grant (attempt number, fencing
-- token, lease ms), saving it a round trip; otherwise (Redlock, where one master cannot
-- grant alone) the message only wakes it. Each waiter has its own channel: no herd.
-- ``releaser`` is not woken: a Redlock waiter keeps its place while it gives back a
-- minority's grant, and waking itself, it would retry at once, in a loop.
-- PUBLISH by pcall: an ACL user without channels (Redis 7's default for new users) is
-- refused it, and an error would end the script after the lease was freed and granted,
-- telling the caller its release failed; an unheard waiter finds its grant by polling.
local function hand_on(lease, fence, queue, qexp, info, wake, hand_over, releaser)
    prune(queue, qexp, info)
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then return end
    local entry = redis.call('HGET', info, head)
    if hand_over ~= '1' or not entry then
        if head ~= releaser then
            redis.pcall('PUBLISH', wake .. head, '')
            return head
        end
        return
    end
    local ttl_ms, attempt, holder = string.match(entry, '^(%d+) (%d+) (.*)$')
    -- No longer than the head's place would have lasted (pruned, it has time left): a
    -- waiter killed after its latest attempt keeps everyone out at most queue_ttl from
    -- that attempt. Still ttl_ms (at most a place's length) from the attempt, which the
    -- waiter counts from, as the place began no earlier.
    local px = tonumber(ttl_ms)
    local place_ends = redis.call('ZSCORE', qexp, head)
    if place_ends then px = math.max(1, math.min(px, tonumber(place_ends) - now_ms())) end
    local f = grant(lease, fence, head, px, holder)
    redis.call('ZREM', queue, head)
    redis.call('ZREM', qexp, head)
    redis.call('HSET', info, head, 'h ' .. attempt .. ' ' .. f)
    redis.pcall('PUBLISH', wake .. head, attempt .. ' ' .. f .. ' ' .. ttl_ms)
end
"""

#: KEYS lease fence queue qexp info; ARGV token ttl_ms holder reentrant place_ms
#: keep_place join attempt grant_ttl_ms. ``join`` (unless empty) first queues the token
#: with that arrival time ("now": the server's clock) and records what a grant on its
#: behalf needs (``info``: lease ms, the attempt's number, holder): a waiter joins the
#: queue with its first attempt inside the core's waiter, not with a round trip of its
#: own, and every later attempt passes ``join`` too, which refreshes its place (only
#: waiters are queued).
#: Returns {1, fence, count, left_queue} when granted, {0, ms_left} when busy (ms_left
#: -1: free, but not our turn). A grant takes the winner out of the queue, saving it a
#: round trip; Redlock keeps the place (keep_place=1) until a majority granted, since a
#: minority grant is given back and the waiter must still be first in line afterwards.
#: A lease already under ``token`` that is not re-entered was handed to it while it
#: waited (or is an orphan of its own attempt cut off mid-flight): granted afresh.
ACQUIRE = Script(
    _MINT
    + """
local lease, fence, queue = KEYS[1], KEYS[2], KEYS[3]
local token = ARGV[1]
local joining = ARGV[7] ~= ''
if redis.call('EXISTS', queue) == 0 then
    -- Nobody queued: one SET NX decides, and a waiter need not join. A token minted
    -- for a busy lock is skipped, which keeps tokens increasing.
    local f = mint(fence)
    if redis.call('SET', lease, token .. ' 1 ' .. f .. ' ' .. ARGV[3], 'NX', 'PX', ARGV[2]) then
        return {1, f, 1, joining and 1 or 0}
    end
end
"""
    + _PARSE
    + _QUEUE
    + """
local qexp, info = KEYS[4], KEYS[5]
if joining then
    local now = now_ms()
    local arrival = now
    if ARGV[7] ~= 'now' then arrival = tonumber(ARGV[7]) end
    redis.call('ZADD', queue, 'NX', arrival, token)
    redis.call('ZADD', qexp, now + tonumber(ARGV[5]), token)
    redis.call('HSET', info, token, ARGV[9] .. ' ' .. ARGV[8] .. ' ' .. ARGV[3])
    -- The queue's keys outlive every place in them, and go once every waiter is gone
    -- (killed with the holder): a name used once leaves nothing behind. Only lengthened,
    -- as another waiter's place may be longer (PEXPIRE GT needs Redis 7).
    local keep = 2 * tonumber(ARGV[5])
    for _, key in ipairs({queue, qexp, info}) do
        if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
    end
end
local value = redis.call('GET', lease)
local owner, count, f, holder
if value then owner, count, f, holder = parse(value) end
if owner == token and ARGV[4] == '1' then
    count = count + 1
    redis.call('SET', lease, token .. ' ' .. count .. ' ' .. f .. ' ' .. holder, 'PX', ARGV[2])
    return {1, f, count, 0}
end
if owner and owner ~= token then
    return {0, redis.call('PTTL', lease)}
end
local left_queue = 0
if joining or redis.call('EXISTS', queue) == 1 then
    if not owner then
        prune(queue, qexp, info)
        local head = redis.call('ZRANGE', queue, 0, 0)[1]
        if head and head ~= token then
            return {0, -1}
        end
    end
    if ARGV[6] ~= '1' then
        leave(queue, qexp, info, {token})
        left_queue = 1
    end
end
return {1, grant(lease, fence, token, ARGV[2], ARGV[3]), 1, left_queue}
"""
)

#: KEYS lease fence queue qexp info; ARGV token wake hand_over. Returns entries left,
#: or -1 if not held.
RELEASE = Script(
    """
local lease, queue, token = KEYS[1], KEYS[3], ARGV[1]
-- ARGV[4] = '1' (Redlock): answer {left, the waiter woken (or false)}, see
-- AsyncRedlockBackend.release.
local function answer(left, woke)
    if ARGV[4] == '1' then return {left, woke or false} end
    return left
end
local value = redis.call('GET', lease)
if not value or string.sub(value, 1, #token + 1) ~= token .. ' ' then
    return answer(-1)
end
local count, rest = string.match(value, '^(%d+) (.*)$', #token + 2)
count = tonumber(count)
if count > 1 then
    redis.call('SET', lease, token .. ' ' .. (count - 1) .. ' ' .. rest, 'KEEPTTL')
    return answer(count - 1)
end
redis.call('DEL', lease)
local woke
-- Every waiter queues before it waits, so with nobody queued there is nobody to wake.
if redis.call('EXISTS', queue) == 1 then
"""
    + _MINT
    + _QUEUE
    + """
    redis.call('HDEL', KEYS[5], token)  -- a hand-over's record, if it was handed the lease
    woke = hand_on(lease, KEYS[2], queue, KEYS[4], KEYS[5], ARGV[2], ARGV[3], token)
end
return answer(0, woke)
"""
)

#: ARGV channel. Redlock: wake a waiter on this master, where it listens; by pcall, as
#: hand_on's wake-up.
WAKE = Script("redis.pcall('PUBLISH', ARGV[1], '') return 1")

#: KEYS lease; ARGV token ttl_ms. Returns 1 if extended, 0 if not held by token.
EXTEND = Script(
    """
local value = redis.call('GET', KEYS[1])
if value and string.sub(value, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
"""
)

#: KEYS lease fence queue qexp info; ARGV token wake hand_over attempt. A waiter leaving
#: (timed out, cancelled) gives back a lease handed to it meanwhile, and leaving the head
#: of the queue while the lock is free hands the turn on, or the next waiter would sit
#: until its timer fires. Only the lease handed for this wait (its latest ``attempt``,
#: the fence of that grant): a leave that got no answer may still arrive after the
#: token's next hold was granted, which is not its to give back. Returns the waiter it
#: woke without handing it the lease (Redlock's masters), or nil.
DEQUEUE = Script(
    _MINT
    + _PARSE
    + _QUEUE
    + """
local lease, fence, queue, qexp, info = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local token = ARGV[1]
local handed = redis.call('HGET', info, token)
local head = redis.call('ZRANGE', queue, 0, 0)[1]
leave(queue, qexp, info, {token})
local value = redis.call('GET', lease)
local owner, count, f
if value then owner, count, f = parse(value) end
if ARGV[3] == '1' and owner == token and handed == 'h ' .. ARGV[4] .. ' ' .. f then
    redis.call('DEL', lease)
    owner = nil
end
if not owner and (head == token or ARGV[3] == '1') then
    return hand_on(lease, fence, queue, qexp, info, ARGV[2], ARGV[3])
end
"""
)

#: KEYS lease queue qexp info. Returns {fence, count, holder, ms_left, waiter holders...}
#: (the waiters whose places are live, in queue order), or an empty reply when free.
INSPECT = Script(
    _PARSE
    + """
local value = redis.call('GET', KEYS[1])
if not value then return {} end
local _, count, f, holder = parse(value)
local reply = {f, count, holder, redis.call('PTTL', KEYS[1])}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, token in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    local ends = redis.call('ZSCORE', KEYS[3], token)
    local entry = redis.call('HGET', KEYS[4], token)
    if ends and tonumber(ends) > now and entry then
        local waiting = string.match(entry, '^%d+ %d+ (.*)$')
        if waiting then reply[#reply + 1] = waiting end
    end
end
return reply
"""
)

#: KEYS lease fence queue qexp info; ARGV wake hand_over. Frees the lease whoever
#: holds it and hands it on; 1 if held.
FORCE_RELEASE = Script(
    _MINT
    + _QUEUE
    + """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
hand_on(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2])
return 1
"""
)

#: KEYS lease fence; ARGV token floor. Redlock: raise this master's counter (and the
#: lease's recorded token) to the token derived from the quorum. 1 if still held.
RAISE_FENCE = Script(
    _PARSE
    + f"""
local floor = tonumber(ARGV[2])
if tonumber(redis.call('GET', KEYS[2]) or '0') < floor then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', {FENCE_KEPT_MS})
end
local value = redis.call('GET', KEYS[1])
local owner, count, _, holder
if value then owner, count, _, holder = parse(value) end
if owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], owner .. ' ' .. count .. ' ' .. ARGV[2] .. ' ' .. holder, 'KEEPTTL')
return 1
"""
)
