-- Delete a `processing` reservation the caller still owns (so a retry re-executes).
-- KEYS[1] record key; ARGV[1] owner token. Returns 1 or 0.
local cur = redis.call('GETRANGE', KEYS[1], 0, 17)
if string.sub(cur, 2, 2) == 'P' and string.sub(cur, 3, 18) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
