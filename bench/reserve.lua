-- The store's reserve until 2026-12-01, when it became two plain commands
-- (`SET NX PX`, `GETRANGE`: crates/store/src/redis.rs). Kept for bench/floor.py
-- (examples/hyper_floor) and bench/redis_ops.py, so their figures stay comparable.
-- Reserve a key, or say what holds it, in one round trip.
-- KEYS[1] record key; ARGV[1] the encoded `processing` record; ARGV[2] lease
-- in ms; ARGV[3] the largest value returned inline, in bytes.
-- Returns nil when reserved; otherwise {value, pttl} for a value of at most
-- ARGV[3] bytes, or {length, pttl} for a larger one (the caller fetches it
-- once it has room for it: a reply never brings more than it asked for).
-- Safe to send twice: the second finds the caller's own reservation.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return false
end
local ttl = redis.call('PTTL', KEYS[1])
local len = redis.call('STRLEN', KEYS[1])
if len <= tonumber(ARGV[3]) then
  return {redis.call('GET', KEYS[1]), ttl}
end
return {len, ttl}
