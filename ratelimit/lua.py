"""The two Lua scripts the Redis backend runs: admission and release, each one atomic round trip.

They mirror `ratelimit.buckets` (`TokenBucket`, `decide`) line for line; the
tests run the same scenarios against both backends to keep them in step.

Per tenant, three keys share the `{tenant}` hash tag (one cluster slot):

    <prefix>{tenant}:req     HASH l=level t=updated_ms   requests bucket
    <prefix>{tenant}:tok     HASH l=level t=updated_ms   tokens bucket
    <prefix>{tenant}:flight  ZSET request_id -> lease expiry (ms)

Bucket math (times in ms, from Redis' own clock so replicas' clocks don't matter):

    level(now) = min(capacity, l + (now - t) * capacity / 60000)     no key = full

    capacity ┤      ╭────────
             │    ╱   slope capacity/60000 per ms
           l ┤──●
             └──┴──────────▶ now
                t

    wait(amount)  = (amount - level) * 60000 / capacity              retry-after
    reset         = (capacity - level) * 60000 / capacity            x-ratelimit-reset-*

Because no key means a full bucket, every write sets PEXPIRE to `reset` (+1 s):
the key vanishes exactly when forgetting it changes nothing. The in-flight
ZSET expires a lease after its last admission, and expired members are purged
by every admission, so a replica that dies holding slots leaks them for at
most one lease.
"""

from __future__ import annotations

# KEYS: req, tok, flight.  ARGV: rpm, tpm, max_concurrent (-1 = unlimited), tokens,
# request_id, lease_ms, concurrency_retry_ms.
# Returns {refused, never, retry_after_ms, requests_remaining, requests_reset_ms,
#          tokens_remaining, tokens_reset_ms}; refused: 0 allowed, 1 requests, 2 tokens, 3 concurrency.
ADMIT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local rid = ARGV[5]
local lease_ms = tonumber(ARGV[6])
local concurrency_retry_ms = tonumber(ARGV[7])

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

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local in_flight = redis.call('ZCARD', KEYS[3])
local rl = 0
if rpm >= 0 then rl = level_at(KEYS[1], rpm) end
local tl = 0
if tpm >= 0 then tl = level_at(KEYS[2], tpm) end

-- buckets.decide: "never" cases first, then the first short limit names the
-- refusal and the longest wait among short limits is the retry-after.
local refused, never, retry = 0, 0, 0
if rpm >= 0 and rpm < 1 then
  refused, never = 1, 1
elseif tpm >= 0 and tokens > tpm then
  refused, never = 2, 1
elseif cap >= 0 and cap < 1 then
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
  if cap >= 0 and in_flight >= cap then
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
end

local r_reset, t_reset = 0, 0
if rpm >= 0 then r_reset = reset_ms(rl, rpm) end
if tpm >= 0 then t_reset = reset_ms(tl, tpm) end
return {refused, never, math.ceil(retry), math.floor(rl + 1e-9), math.ceil(r_reset),
        math.floor(tl + 1e-9), math.ceil(t_reset)}
"""

# KEYS: tok, flight.  ARGV: tpm (-1 = unlimited), refund, request_id.
# Returns 1 if the reservation was live and is now released, 0 otherwise
# (released twice, or its lease ran out: the slot was already given back, refund nothing).
RELEASE = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000
local tpm = tonumber(ARGV[1])
local refund = math.max(0, tonumber(ARGV[2]))

local expiry = redis.call('ZSCORE', KEYS[2], ARGV[3])
if not expiry then return 0 end
redis.call('ZREM', KEYS[2], ARGV[3])
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
