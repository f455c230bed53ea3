-- Take over the reservation of an owner that vanished (its proxy died): its
-- lease ran out, so no more than its afterlife is left of its time, and
-- nobody completed, released or renewed it since. What takes its place is a
-- finished record (the unknown outcome) or the taker's own reservation.
-- KEYS[1] record key; ARGV[1] the vanished owner's token (16 bytes); ARGV[2]
-- its afterlife in ms; ARGV[3] the value written in its place (the taker's
-- token at bytes 3 to 18); ARGV[4] that value's time to live in ms.
-- Returns 1 written, 0 refused (the key holds something else now, or the
-- lease runs again: its owner renewed it). Safe to send twice: a key that
-- holds the taker's token already answers 1 and is not written again.
local cur = redis.call('GETRANGE', KEYS[1], 0, 17)
if cur ~= '' and string.sub(cur, 3, 18) == string.sub(ARGV[3], 3, 18) then
  return 1
end
if string.sub(cur, 2, 2) ~= 'P' or string.sub(cur, 3, 18) ~= ARGV[1] then
  return 0
end
local left = redis.call('PTTL', KEYS[1])
if left < 0 or left > tonumber(ARGV[2]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
return 1
