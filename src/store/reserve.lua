-- Reserve a key, or return what holds it: one round trip either way.
-- KEYS[1] record key; ARGV[1] the encoded `processing` record; ARGV[2] lease in ms.
-- Returns false (nil) when reserved, else {current value, remaining ms}.
-- Sent twice (a client retry after a reconnect), the second call returns the
-- caller's own reservation, which the caller recognises by its owner token.
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return false
end
return {cur, redis.call('PTTL', KEYS[1])}
