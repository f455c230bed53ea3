-- Write one piece of a finished record too large to send in one command, in
-- place of the caller's reservation (pieces are sent in order, from offset 0).
-- KEYS[1] record key; ARGV[1] owner token (16 bytes); ARGV[2] offset of the
-- piece; ARGV[3] the piece; ARGV[4] a lease in ms that the record keeps at
-- least while it is being written; ARGV[5] its ttl in ms on the last piece,
-- '' before.
-- Until the last piece the record's state byte stays 'P': a reader sees a
-- reservation in progress, never half an answer. The last piece turns it
-- into 'F' and gives it its ttl.
-- Returns 1 written, 2 written where the key had gone (first piece only),
-- 0 refused (another owner holds the key), 3 nothing written: the caller's
-- record is finished already (an earlier attempt whose answer was lost, or
-- the small record that says the answer was not kept), -1 out of step (the
-- key went or changed length mid-way: the caller starts again from offset 0).
-- Safe to send twice: a repeat from offset 0 rewrites the caller's own
-- record while it is in progress, and never turns a finished one back into
-- a reservation (a piece delivered late, after its attempt was given up).
local head = redis.call('GETRANGE', KEYS[1], 0, 17)
local offset = tonumber(ARGV[2])
local result = 1
if head == '' then
  if offset ~= 0 then
    return -1
  end
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
  result = 2
elseif string.sub(head, 3, 18) ~= ARGV[1] then
  return 0
elseif string.sub(head, 2, 2) == 'F' then
  return 3
elseif offset == 0 then
  redis.call('SET', KEYS[1], ARGV[3], 'KEEPTTL')
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
  end
elseif redis.call('STRLEN', KEYS[1]) ~= offset then
  return -1
else
  redis.call('APPEND', KEYS[1], ARGV[3])
end
if ARGV[5] ~= '' then
  redis.call('SETRANGE', KEYS[1], 1, 'F')
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
return result
