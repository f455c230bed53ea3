-- Store the finished answer if the caller still owns the key.
-- KEYS[1] record key; ARGV[1] owner token (16 bytes); ARGV[2] the encoded
-- finished record; ARGV[3] ttl in ms.
-- Returns 1 stored (or the caller's record is finished already), 2 stored
-- although the lease had expired (nobody else held the key), 0 refused
-- (another owner holds it). Safe to send twice: a finished record of the
-- caller's is final, never replaced, not by a repeat and not by the small
-- record that says an answer was not kept (sent after an attempt whose write
-- landed but whose reply came too late).
-- Only the first 18 bytes are read: the state and the owner token.
local cur = redis.call('GETRANGE', KEYS[1], 0, 17)
if cur ~= '' and string.sub(cur, 3, 18) ~= ARGV[1] then
  return 0
end
if string.sub(cur, 2, 2) == 'F' then
  return 1
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if cur ~= '' then
  return 1
end
return 2
