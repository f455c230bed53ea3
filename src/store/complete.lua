-- Store the finished answer if the caller still owns the key.
-- KEYS[1] record key; ARGV[1] owner token (16 bytes); ARGV[2] the encoded
-- finished record; ARGV[3] ttl in ms.
-- Returns 1 stored, 2 stored although the lease had expired (nobody else held
-- the key), 0 refused (another owner holds it). Safe to send twice: the
-- finished record carries the same token, so a repeat overwrites it with itself.
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 3, 18) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if cur then
  return 1
end
return 2
