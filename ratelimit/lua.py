"""The two Lua scripts the Redis backend runs: admission and release, each one atomic round trip.

They mirror `ratelimit.buckets` (`TokenBucket`, `decide`) and `ratelimit.memory`
line for line; the tests run the same scenarios against both backends to keep
them in step.

Per tenant, five keys share the `{tenant}` hash tag (one cluster slot):

    <prefix>{tenant}:req     HASH l=level t=updated_ms   requests bucket
    <prefix>{tenant}:tok     HASH l=level t=updated_ms   tokens bucket
    <prefix>{tenant}:flight  ZSET request_id -> lease expiry (ms)          live leases
    <prefix>{tenant}:seqs    HASH request_id -> sequences                  only leases of > 1 sequence
    <prefix>{tenant}:done    ZSET request_id -> expiry (ms)                released before admitted

Bucket math (times in ms, from Redis' own clock so replicas' clocks don't matter;
tests may pass their own clock as `now_ms`):

    level(now) = min(capacity, l + (now - t) * capacity / 60000)     no key = full

    capacity ┤      ╭────────
             │    ╱   slope capacity/60000 per ms
           l ┤──●
             └──┴──────────▶ now
                t

    wait(amount)  = (amount - level) * 60000 / capacity              retry-after
    reset         = (capacity - level) * 60000 / capacity            x-ratelimit-reset-*

Because no key means a full bucket, every write sets PEXPIRE to `reset` (+1 s):
the key vanishes exactly when forgetting it changes nothing.

Concurrency counts sequences: in_flight = ZCARD(flight) + sum(seqs[id] - 1).
A lease ends at its release or its expiry, whichever comes first; expired
members are purged by every admission, so a replica that dies holding slots
leaks them for at most one lease. The flight, seqs and done keys expire a
lease after their last write.

Exactly once by request id: a release that finds no lease (its admission's
reply was lost and the admission has not reached Redis yet, or it is a second
release) leaves a `done` tombstone for one lease, and an admission of a
tombstoned id charges nothing; an admission of an id already in flight charges
nothing again. So a timed-out admit can be rolled back by id before or after
its script runs, and a release may be retried.
"""

from __future__ import annotations

# KEYS: req, tok, flight, seqs, done.  ARGV: rpm, tpm, max_concurrent (-1 = unlimited), tokens,
# request_id, lease_ms, concurrency_retry_ms, sequences, now_ms (-1 = Redis' clock).
# Returns {refused, never, retry_after_ms, requests_remaining, requests_reset_ms,
#          tokens_remaining, tokens_reset_ms};
# refused: 0 allowed, 1 requests, 2 tokens, 3 concurrency, 4 released already (nothing charged).
ADMIT = """
local now = tonumber(ARGV[9])
if now < 0 then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000
end

local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local rid = ARGV[5]
local lease_ms = tonumber(ARGV[6])
local concurrency_retry_ms = tonumber(ARGV[7])
local sequences = tonumber(ARGV[8])

local function level_at(key, capacity)
  local s = redis.call('HMGET', key, 'l', 't')
  if not s[1] then return capacity end
  -- a clock stepping backwards never drains a bucket
  local elapsed = math.max(0, now - tonumber(s[2]))
  return math.min(capacity, tonumber(s[1]) + elapsed * capacity / 60000)
end

local function wait_ms(level, amount, capacity)
  if level >= amount then return 0 end
  return (amount - level) * 60000 / capacity
end

local function reset_ms(level, capacity)
  if capacity <= 0 then return 0 end
  return math.max(0, (capacity - level) * 60000 / capacity)
end

local function store(key, level, capacity)
  redis.call('HSET', key, 'l', string.format('%.17g', level), 't', string.format('%.17g', now))
  redis.call('PEXPIRE', key, math.ceil(reset_ms(level, capacity)) + 1000)
end

-- expired leases (with their sequence counts) and expired tombstones
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  redis.call('HDEL', KEYS[4], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)

local rl = 0
if rpm >= 0 then rl = level_at(KEYS[1], rpm) end
local tl = 0
if tpm >= 0 then tl = level_at(KEYS[2], tpm) end

local refused, never, retry = 0, 0, 0
if redis.call('ZSCORE', KEYS[5], rid) then
  refused = 4
elseif redis.call('ZSCORE', KEYS[3], rid) then
  -- admitted already: allowed, charged once
else
  local in_flight = 0
  if cap >= 0 then
    in_flight = redis.call('ZCARD', KEYS[3])
    for _, n in ipairs(redis.call('HVALS', KEYS[4])) do in_flight = in_flight + tonumber(n) - 1 end
  end
  -- buckets.decide: "never" cases first, then the first short limit names the
  -- refusal and the longest wait among short limits is the retry-after.
  if rpm >= 0 and rpm < 1 then
    refused, never = 1, 1
  elseif tpm >= 0 and tokens > tpm then
    refused, never = 2, 1
  elseif cap >= 0 and sequences > cap then
    refused, never = 3, 1
  else
    if rpm >= 0 and rl < 1 then
      refused = 1
      retry = wait_ms(rl, 1, rpm)
    end
    if tpm >= 0 and tl < tokens then
      if refused == 0 then refused = 2 end
      retry = math.max(retry, wait_ms(tl, tokens, tpm))
    end
    if cap >= 0 and in_flight + sequences > cap then
      if refused == 0 then refused = 3 end
      retry = math.max(retry, concurrency_retry_ms)
    end
  end

  if refused == 0 then
    if rpm >= 0 then
      rl = rl - 1
      store(KEYS[1], rl, rpm)
    end
    if tpm >= 0 then
      tl = tl - tokens
      store(KEYS[2], tl, tpm)
    end
    redis.call('ZADD', KEYS[3], now + lease_ms, rid)
    redis.call('PEXPIRE', KEYS[3], lease_ms + 1000)
    if sequences > 1 then redis.call('HSET', KEYS[4], rid, sequences) end
    redis.call('PEXPIRE', KEYS[4], lease_ms + 1000)
  end
end

local r_reset, t_reset = 0, 0
if rpm >= 0 then r_reset = reset_ms(rl, rpm) end
if tpm >= 0 then t_reset = reset_ms(tl, tpm) end
return {refused, never, math.ceil(retry), math.floor(rl + 1e-9), math.ceil(r_reset),
        math.floor(tl + 1e-9), math.ceil(t_reset)}
"""

# KEYS: tok, flight, seqs, done.  ARGV: tpm (-1 = unlimited), refund, request_id, lease_ms,
# now_ms (-1 = Redis' clock).
# Returns 1 if the reservation was live and is now released, 0 otherwise: released already, its
# lease ran out (the slot was already given back: refund nothing), or not admitted yet (tombstone).
RELEASE = """
local now = tonumber(ARGV[5])
if now < 0 then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000
end
local tpm = tonumber(ARGV[1])
local refund = math.max(0, tonumber(ARGV[2]))
local rid = ARGV[3]
local lease_ms = tonumber(ARGV[4])

local expiry = redis.call('ZSCORE', KEYS[2], rid)
if not expiry then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  redis.call('ZADD', KEYS[4], now + lease_ms, rid)
  redis.call('PEXPIRE', KEYS[4], lease_ms + 1000)
  return 0
end
redis.call('ZREM', KEYS[2], rid)
redis.call('HDEL', KEYS[3], rid)
if tonumber(expiry) <= now then return 0 end
if tpm <= 0 then return 1 end

local level = tpm
local s = redis.call('HMGET', KEYS[1], 'l', 't')
if s[1] then
  level = math.min(tpm, tonumber(s[1]) + math.max(0, now - tonumber(s[2])) * tpm / 60000)
end
level = math.min(tpm, level + refund)
redis.call('HSET', KEYS[1], 'l', string.format('%.17g', level), 't', string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((tpm - level) * 60000 / tpm) + 1000)
return 1
"""
