"""Lua scripts for the multi-key updates that must be atomic (see `rollout_buffer.keys` for the layout).

Each script touches only keys of one run (one hash tag), so it is valid on Redis Cluster too. Group keys
are built inside the scripts from the run's group prefix; they share the run's hash tag.
"""

# KEYS: 1 records 2 pending 3 ready 4 stats 5 since 6 wake 7 skip 8 closed 9 meta 10 since_groups
# ARGV: 1 uid 2 blob 3 group_prefix 4 instance_id 5 epoch (-1: first epoch whose group is still open)
#       6 now 7 reward 8 status
# Returns {outcome, group_key_or_reason}; outcome is stored | completed | duplicate | dropped
# (reasons: unknown_run, skipped_instance, epoch_out_of_range, late_write, group_overflow).
WRITE_RECORD = """
local uid = ARGV[1]
if redis.call('HEXISTS', KEYS[1], uid) == 1 then
  redis.call('HINCRBY', KEYS[4], 'duplicate_writes', 1)
  return {'duplicate', ''}
end
local iid = ARGV[4]
if redis.call('SISMEMBER', KEYS[7], iid) == 1 then
  redis.call('HINCRBY', KEYS[4], 'drop:skipped_instance', 1)
  return {'dropped', 'skipped_instance'}
end
local run = redis.call('HMGET', KEYS[9], 'group_size', 'num_epoch')
if not run[1] then
  return {'dropped', 'unknown_run'}
end
local group_size = tonumber(run[1])
local num_epoch = tonumber(run[2])
local epoch = tonumber(ARGV[5])
local gkey
if epoch < 0 then
  epoch = 0
  gkey = ARGV[3] .. epoch .. ':' .. iid
  while epoch < num_epoch - 1 and (redis.call('SISMEMBER', KEYS[8], gkey) == 1
        or redis.call('HLEN', gkey) >= group_size) do
    epoch = epoch + 1
    gkey = ARGV[3] .. epoch .. ':' .. iid
  end
else
  if epoch >= num_epoch then
    redis.call('HINCRBY', KEYS[4], 'drop:epoch_out_of_range', 1)
    return {'dropped', 'epoch_out_of_range'}
  end
  gkey = ARGV[3] .. epoch .. ':' .. iid
end
if redis.call('SISMEMBER', KEYS[8], gkey) == 1 then
  redis.call('HINCRBY', KEYS[4], 'drop:late_write', 1)
  return {'dropped', 'late_write'}
end
local size = redis.call('HLEN', gkey)
if size >= group_size then
  redis.call('HINCRBY', KEYS[4], 'drop:group_overflow', 1)
  return {'dropped', 'group_overflow'}
end
redis.call('HSET', KEYS[1], uid, ARGV[2])
redis.call('HSET', gkey, uid, '1')
size = size + 1
if size == 1 then
  redis.call('ZADD', KEYS[2], ARGV[6], gkey)
end
redis.call('HINCRBY', KEYS[4], 'records_written', 1)
redis.call('HINCRBY', KEYS[4], 'status:' .. ARGV[8], 1)
redis.call('HINCRBY', KEYS[5], 'total_samples', 1)
redis.call('HINCRBYFLOAT', KEYS[5], 'reward_sum', ARGV[7])
redis.call('HINCRBY', KEYS[5], 'status:' .. ARGV[8], 1)
redis.call('SADD', KEYS[10], gkey)
if size == group_size then
  redis.call('ZREM', KEYS[2], gkey)
  redis.call('SADD', KEYS[8], gkey)
  redis.call('RPUSH', KEYS[3], gkey)
  redis.call('HINCRBY', KEYS[4], 'groups_completed', 1)
  redis.call('RPUSH', KEYS[6], '1')
  redis.call('LTRIM', KEYS[6], -64, -1)
  return {'completed', gkey}
end
return {'stored', gkey}
"""

# KEYS: 1 ready 2 records 3 handed 4 stats 5 since 6 since_groups 7 timed_out
# ARGV: 1 max_samples (-1: no limit) 2 group_prefix
# Pops whole groups from the head of the ready list while they fit in max_samples, deletes their
# records, and resets the since-previous-read counters when anything was handed over.
# Returns {since_flat, num_since_groups, timed_out_list, {gkey, {uid, blob, ...}}, ...}.
READ_READY = """
local max_samples = tonumber(ARGV[1])
local prefix_len = string.len(ARGV[2])
local taken = 0
local groups = {}
while true do
  local gkey = redis.call('LINDEX', KEYS[1], 0)
  if not gkey then break end
  local uids = redis.call('HKEYS', gkey)
  if max_samples >= 0 and taken + #uids > max_samples then break end
  redis.call('LPOP', KEYS[1])
  local pairs_out = {}
  if #uids > 0 then
    local blobs = redis.call('HMGET', KEYS[2], unpack(uids))
    for i = 1, #uids do
      pairs_out[2 * i - 1] = uids[i]
      pairs_out[2 * i] = blobs[i]
    end
    redis.call('HDEL', KEYS[2], unpack(uids))
  end
  redis.call('DEL', gkey)
  local rest = string.sub(gkey, prefix_len + 1)
  local sep = string.find(rest, ':', 1, true)
  redis.call('SADD', KEYS[3], string.sub(rest, sep + 1))
  taken = taken + #uids
  groups[#groups + 1] = {gkey, pairs_out}
end
if #groups == 0 then
  return {{}, 0, {}}
end
redis.call('HINCRBY', KEYS[4], 'groups_handed', #groups)
redis.call('HINCRBY', KEYS[4], 'samples_handed', taken)
local since = redis.call('HGETALL', KEYS[5])
local num_groups = redis.call('SCARD', KEYS[6])
-- UNLINK: the since-groups set may hold a whole backlog's group keys; free it off the main thread
redis.call('UNLINK', KEYS[5], KEYS[6])
local timed_out = redis.call('LRANGE', KEYS[7], 0, -1)
redis.call('DEL', KEYS[7])
local out = {since, num_groups, timed_out}
for i = 1, #groups do out[#out + 1] = groups[i] end
return out
"""

# KEYS: 1 pending 2 ready 3 closed 4 stats 5 wake 6 records 7 timed_out
# ARGV: 1 cutoff (first-write time) 2 policy (hand_over | drop) 3 limit 4 group_prefix
# Closes incomplete groups whose first write is older than the cutoff. Returns the number closed.
EXPIRE_GROUPS = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local prefix_len = string.len(ARGV[4])
for _, gkey in ipairs(expired) do
  redis.call('ZREM', KEYS[1], gkey)
  redis.call('SADD', KEYS[3], gkey)
  if ARGV[2] == 'hand_over' then
    redis.call('RPUSH', KEYS[2], gkey)
    redis.call('HINCRBY', KEYS[4], 'groups_timed_out_handed', 1)
    redis.call('RPUSH', KEYS[5], '1')
    redis.call('LTRIM', KEYS[5], -64, -1)
  else
    local uids = redis.call('HKEYS', gkey)
    if #uids > 0 then
      redis.call('HDEL', KEYS[6], unpack(uids))
    end
    redis.call('DEL', gkey)
    redis.call('HINCRBY', KEYS[4], 'drop:group_timeout', 1)
    redis.call('HINCRBY', KEYS[4], 'drop:group_timeout_samples', #uids)
    redis.call('RPUSH', KEYS[7], string.sub(gkey, prefix_len + 1))
  end
end
return #expired
"""
