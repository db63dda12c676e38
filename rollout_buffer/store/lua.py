"""Lua scripts for the multi-key updates that must be atomic (see `rollout_buffer.store.keys` for the layout).

Every script touches only keys of one run, all declared in KEYS (legal on a Redis Cluster: one run, one
hash slot). Group ids are `"{epoch}:{instance_id}"`; a group's members are the fields `"{gid}|{k}"` of the
members hash. A batch read with a lease keeps its groups' records until it is acknowledged; an expired
lease puts its groups back at the head of the ready list.

Staleness (see `rollout_buffer.wire.versions`): every write carries its record's policy version, and the group
keeps the oldest in `gversion`. A read knows the trainer's policy version; a group older than the run's
`max_staleness` is not handed over: it is dropped, or rolled out again (`rollout_buffer.store.stream_lua`), as the
run's `stale_policy` says ("keep" hands it over; the reader counts it). Every group that leaves the buffer
for good (handed over, acknowledged, dropped, requeued, timed out) counts in `groups_consumed`, the other
half of the runtime's admission rule (`rollout_buffer.runtime.taskqueue`).
"""

from rollout_buffer.store.stream_lua import EXTEND_GROUPS, TASK_FUNCTIONS

__all__ = ["ACK_BATCH", "EXPIRE_GROUPS", "EXPIRE_LEASES", "EXTEND_GROUPS", "INCR_STATS", "READ_READY",
           "SET_LEASE_OUTCOME", "SET_POLICY_VERSION", "WRITE_RECORD"]

# Shared functions, prepended to the scripts that need them.
_GROUP_FUNCTIONS = """
local function member_fields(gid, n)
  local fields = {}
  for k = 1, n do fields[k] = gid .. '|' .. k end
  return fields
end
-- {uid1, blob1, uid2, blob2, ...} of a group (a blob is false if its record is missing)
local function group_pairs(k_gsize, k_members, k_records, gid)
  local n = tonumber(redis.call('HGET', k_gsize, gid) or '0')
  if n == 0 then return {} end
  local uids = redis.call('HMGET', k_members, unpack(member_fields(gid, n)))
  local present = {}
  for _, uid in ipairs(uids) do if uid then present[#present + 1] = uid end end
  if #present == 0 then return {} end
  local blobs = redis.call('HMGET', k_records, unpack(present))
  local out = {}
  for i = 1, #present do
    out[2 * i - 1] = present[i]
    out[2 * i] = blobs[i]
  end
  return out
end
-- deletes a group's records, membership and version; returns how many members it had
local function delete_group(k_gsize, k_members, k_records, k_gversion, gid)
  local n = tonumber(redis.call('HGET', k_gsize, gid) or '0')
  if n > 0 then
    local fields = member_fields(gid, n)
    local uids = redis.call('HMGET', k_members, unpack(fields))
    local present = {}
    for _, uid in ipairs(uids) do if uid then present[#present + 1] = uid end end
    if #present > 0 then redis.call('HDEL', k_records, unpack(present)) end
    redis.call('HDEL', k_members, unpack(fields))
  end
  redis.call('HDEL', k_gsize, gid)
  redis.call('HDEL', k_gversion, gid)
  return n
end
-- records the trainer's policy version; a new one also records how many groups were consumed before it
-- (the admission rule counts the current version's batch as not consumed yet: it is being trained on)
local function set_version(k_meta, k_stats, version)
  if redis.call('HGET', k_meta, 'policy_version') ~= version then
    redis.call('HSET', k_meta, 'policy_version', version, 'consumed_before_version',
               redis.call('HGET', k_stats, 'groups_consumed') or '0')
  end
end
-- groups consumed without being trained on (dropped, requeued, filtered, timed out) free admission at once:
-- they are not part of the batch of the current policy version
local function release_groups(k_meta, n)
  if n > 0 and redis.call('HEXISTS', k_meta, 'consumed_before_version') == 1 then
    redis.call('HINCRBY', k_meta, 'consumed_before_version', n)
  end
end
local function wake(k_wake)
  redis.call('RPUSH', k_wake, '1')
  redis.call('LTRIM', k_wake, -64, -1)
end
-- Puts the groups of leases due by `now` back at the head of the ready list (batch order kept) and
-- remembers the batch as expired (negative score in `settled`). Returns how many leases ended.
local function expire_leases(k_leases, k_lease_data, k_ready, k_stats, k_wake, k_settled, now, limit, counter)
  local due = redis.call('ZRANGEBYSCORE', k_leases, '-inf', now, 'LIMIT', 0, limit)
  for _, bid in ipairs(due) do
    local raw = redis.call('HGET', k_lease_data, bid)
    if raw then
      local groups = cjson.decode(raw)['groups']
      for i = #groups, 1, -1 do redis.call('LPUSH', k_ready, groups[i]) end
      redis.call('HINCRBY', k_stats, counter, 1)
      redis.call('HINCRBY', k_stats, counter .. '_groups', #groups)
      wake(k_wake)
    end
    redis.call('HDEL', k_lease_data, bid)
    redis.call('ZREM', k_leases, bid)
    redis.call('ZADD', k_settled, -now, bid)
  end
  redis.call('ZREMRANGEBYRANK', k_settled, 0, -10001)
  return #due
end
"""

# KEYS: 1 records 2 pending 3 ready 4 stats 5 since 6 wake 7 skip 8 closed 9 meta 10 since_groups 11 uids
#       12 gsize 13 members 14 gversion 15 ggen
# ARGV: 1 uid 2 blob 3 instance_id 4 epoch (-1: first epoch whose group is still open) 5 now 6 reward 7 status
#       8 policy version ('' unversioned) 9 group generation ('' not checked: writers outside the runtime)
# Returns {outcome, gid_or_reason}; outcome is stored | completed | duplicate | dropped (reasons: unknown_run,
# run_superseded, skipped_group, epoch_out_of_range, stale_generation, late_write, group_overflow).
# Epochs past num_epoch are accepted up to `epoch_limit` (groups the prompt stream added for a group filter).
WRITE_RECORD = _GROUP_FUNCTIONS + """
local run = redis.call('HMGET', KEYS[9], 'group_size', 'num_epoch', 'status', 'epoch_limit')
if not run[1] or run[3] == 'deleted' then
  return {'dropped', 'unknown_run'}
end
if run[3] == 'superseded' then
  redis.call('HINCRBY', KEYS[4], 'drop:run_superseded', 1)
  return {'dropped', 'run_superseded'}
end
local uid = ARGV[1]
if redis.call('SISMEMBER', KEYS[11], uid) == 1 then
  redis.call('HINCRBY', KEYS[4], 'duplicate_writes', 1)
  return {'duplicate', ''}
end
local iid = ARGV[3]
local group_size = tonumber(run[1])
local num_epoch = tonumber(run[2])
local epoch = tonumber(ARGV[4])
local gid
if epoch < 0 then
  epoch = 0
  gid = epoch .. ':' .. iid
  while epoch < num_epoch - 1 and (redis.call('SISMEMBER', KEYS[8], gid) == 1
        or redis.call('SISMEMBER', KEYS[7], gid) == 1
        or tonumber(redis.call('HGET', KEYS[12], gid) or '0') >= group_size) do
    epoch = epoch + 1
    gid = epoch .. ':' .. iid
  end
else
  if epoch >= (tonumber(run[4] or '') or num_epoch) then
    redis.call('HINCRBY', KEYS[4], 'drop:epoch_out_of_range', 1)
    return {'dropped', 'epoch_out_of_range'}
  end
  gid = epoch .. ':' .. iid
end
if redis.call('SISMEMBER', KEYS[7], gid) == 1 then
  redis.call('HINCRBY', KEYS[4], 'drop:skipped_group', 1)
  return {'dropped', 'skipped_group'}
end
if ARGV[9] ~= '' and tonumber(ARGV[9]) ~= tonumber(redis.call('HGET', KEYS[15], gid) or '0') then
  redis.call('HINCRBY', KEYS[4], 'drop:stale_generation', 1)
  return {'dropped', 'stale_generation'}
end
if redis.call('SISMEMBER', KEYS[8], gid) == 1 then
  redis.call('HINCRBY', KEYS[4], 'drop:late_write', 1)
  return {'dropped', 'late_write'}
end
local size = tonumber(redis.call('HGET', KEYS[12], gid) or '0')
if size >= group_size then
  redis.call('HINCRBY', KEYS[4], 'drop:group_overflow', 1)
  return {'dropped', 'group_overflow'}
end
redis.call('HSET', KEYS[1], uid, ARGV[2])
redis.call('SADD', KEYS[11], uid)
size = size + 1
redis.call('HSET', KEYS[12], gid, size)
redis.call('HSET', KEYS[13], gid .. '|' .. size, uid)
if ARGV[8] ~= '' then
  local oldest = tonumber(redis.call('HGET', KEYS[14], gid) or '')
  if not oldest or tonumber(ARGV[8]) < oldest then redis.call('HSET', KEYS[14], gid, ARGV[8]) end
end
if size == 1 then
  redis.call('ZADD', KEYS[2], ARGV[5], gid)
end
redis.call('HINCRBY', KEYS[4], 'records_written', 1)
redis.call('HINCRBY', KEYS[4], 'status:' .. ARGV[7], 1)
redis.call('HINCRBY', KEYS[5], 'total_samples', 1)
redis.call('HINCRBYFLOAT', KEYS[5], 'reward_sum', ARGV[6])
redis.call('HINCRBY', KEYS[5], 'status:' .. ARGV[7], 1)
redis.call('SADD', KEYS[10], gid)
if size == group_size then
  redis.call('ZREM', KEYS[2], gid)
  redis.call('SADD', KEYS[8], gid)
  redis.call('RPUSH', KEYS[3], gid)
  redis.call('HINCRBY', KEYS[4], 'groups_completed', 1)
  wake(KEYS[6])
  return {'completed', gid}
end
return {'stored', gid}
"""

# KEYS: 1 ready 2 records 3 handed 4 stats 5 since 6 since_groups 7 timed_out 8 gsize 9 members
#       10 leases 11 lease_data 12 settled 13 wake 14 meta 15 gversion 16 ggen 17 tasks 18 closed
# ARGV: 1 max_samples (-1: no limit) 2 lease_s (0: no lease) 3 batch_id ('' with no lease) 4 now
#       5 the reader's policy version ('' none: the run's last known one) 6 groups the reader asked for (0: -)
# First ends due leases. A batch_id whose lease is live is a retry: the same groups, lease renewed
# ({'retry', lease JSON, groups...}); an acknowledged one answers {'acked', ''}. Otherwise records the
# reader's policy version and batch size, then pops whole groups from the head of the ready list while
# they fit in max_samples: a group staler than `max_staleness` is dropped or requeued on the way
# (`stale_policy`; not with "keep"; a group requeued `max_requeues` times already is dropped) and takes
# no room. Resets the since-previous-read counters. With a
# lease the groups stay stored under the batch ({'leased', lease JSON, groups...}); without, they are
# deleted and marked handed over ({'handed', info JSON, groups...}). Each group is {gid, {uid, blob, ...}}.
# Nothing to hand over: {'empty', info JSON or ''} (the info names stale groups dealt with on the way).
READ_READY = _GROUP_FUNCTIONS + TASK_FUNCTIONS + """
local now = tonumber(ARGV[4])
local lease_s = tonumber(ARGV[2])
local bid = ARGV[3]
local status = redis.call('HGET', KEYS[14], 'status')
if not status or status == 'deleted' then return {'empty', ''} end
expire_leases(KEYS[10], KEYS[11], KEYS[1], KEYS[4], KEYS[13], KEYS[12], now, 1000, 'lease_expired')
if bid ~= '' then
  local raw = redis.call('HGET', KEYS[11], bid)
  if raw then
    if lease_s > 0 then redis.call('ZADD', KEYS[10], now + lease_s, bid) end
    redis.call('HINCRBY', KEYS[4], 'batch_retries', 1)
    local out = {'retry', raw}
    for _, gid in ipairs(cjson.decode(raw)['groups']) do
      out[#out + 1] = {gid, group_pairs(KEYS[8], KEYS[9], KEYS[2], gid)}
    end
    return out
  end
  local settled = redis.call('ZSCORE', KEYS[12], bid)
  if settled and tonumber(settled) > 0 then return {'acked', ''} end
end
if ARGV[5] ~= '' then set_version(KEYS[14], KEYS[4], ARGV[5]) end
local run = redis.call('HMGET', KEYS[14], 'policy_version', 'max_staleness', 'stale_policy', 'groups_per_read',
                       'max_requeues')
local version = tonumber(run[1] or '')
local bound = tonumber(run[2] or '')
local policy = run[3] or 'requeue'
local max_requeues = tonumber(run[5] or '') or 3
if policy == 'keep' or not version then bound = nil end
local max_samples = tonumber(ARGV[1])
local taken = 0
local gids = {}
local groups = {}
local requeued = {}
local dropped = {}
while true do
  local gid = redis.call('LINDEX', KEYS[1], 0)
  if not gid then break end
  local oldest = bound and tonumber(redis.call('HGET', KEYS[15], gid) or '')
  if oldest and version - oldest > bound then
    redis.call('LPOP', KEYS[1])
    local n = delete_group(KEYS[8], KEYS[9], KEYS[2], KEYS[15], gid)
    local again = policy ~= 'drop' and tonumber(redis.call('HGET', KEYS[16], gid) or '0') < max_requeues
    if not again then
      if policy ~= 'drop' then redis.call('HINCRBY', KEYS[4], 'drop:stale_requeue_limit', 1) end
      dropped[#dropped + 1] = gid
      redis.call('HINCRBY', KEYS[4], 'stale_dropped_groups', 1)
      redis.call('HINCRBY', KEYS[4], 'stale_dropped_samples', n)
    else
      requeued[#requeued + 1] = gid
      requeue_group(KEYS[17], KEYS[14], KEYS[4], KEYS[16], KEYS[18], gid)
      redis.call('HINCRBY', KEYS[4], 'stale_requeued_groups', 1)
      redis.call('HINCRBY', KEYS[4], 'stale_requeued_samples', n)
    end
    redis.call('HINCRBY', KEYS[4], 'groups_consumed', 1)
    release_groups(KEYS[14], 1)
  else
    local n = tonumber(redis.call('HGET', KEYS[8], gid) or '0')
    if max_samples >= 0 and taken + n > max_samples then break end
    redis.call('LPOP', KEYS[1])
    groups[#groups + 1] = {gid, group_pairs(KEYS[8], KEYS[9], KEYS[2], gid)}
    gids[#gids + 1] = gid
    taken = taken + n
  end
end
local asked = tonumber(ARGV[6])
if asked <= 0 then asked = #gids end
if asked > (tonumber(run[4] or '') or 0) then redis.call('HSET', KEYS[14], 'groups_per_read', asked) end
local stale = {policy_version = version or false, requeued = requeued, dropped = dropped}
if #groups == 0 then
  if #requeued + #dropped == 0 then return {'empty', ''} end
  return {'empty', cjson.encode(stale)}
end
local info = {groups = gids, since = redis.call('HGETALL', KEYS[5]), num_since_groups = redis.call('SCARD', KEYS[6]),
              timed_out = redis.call('LRANGE', KEYS[7], 0, -1), created = now, policy_version = version or false,
              requeued = requeued, dropped = dropped}
-- UNLINK: the since-groups set may hold a whole backlog's group ids; free it off the main thread
redis.call('UNLINK', KEYS[5], KEYS[6], KEYS[7])
local kind = 'handed'
if lease_s > 0 then
  kind = 'leased'
  info['lease_s'] = lease_s
  redis.call('HSET', KEYS[11], bid, cjson.encode(info))
  redis.call('ZADD', KEYS[10], now + lease_s, bid)
  redis.call('ZREM', KEYS[12], bid)
  redis.call('HINCRBY', KEYS[4], 'batches_leased', 1)
else
  for _, gid in ipairs(gids) do
    delete_group(KEYS[8], KEYS[9], KEYS[2], KEYS[15], gid)
    redis.call('SADD', KEYS[3], gid)
  end
  redis.call('HINCRBY', KEYS[4], 'groups_handed', #gids)
  redis.call('HINCRBY', KEYS[4], 'samples_handed', taken)
  redis.call('HINCRBY', KEYS[4], 'groups_consumed', #gids)
end
local out = {kind, cjson.encode(info)}
for i = 1, #groups do out[#out + 1] = groups[i] end
return out
"""

# KEYS: 1 leases 2 lease_data 3 settled 4 records 5 gsize 6 members 7 handed 8 stats 9 gversion 10 meta
#       11 tasks 12 lines 13 skip 14 closed
# ARGV: 1 batch_id 2 now
# Ends a lease for good: its groups are deleted and marked handed over, what the reader decided for them
# (stored with the lease by SET_LEASE_OUTCOME: counters, groups a filter dropped) is counted now, those
# dropped groups are replaced from the prompt stream, and filtered groups free admission at once. Returns {outcome, groups, groups added}: acked |
# already_acked | expired | unknown.
ACK_BATCH = _GROUP_FUNCTIONS + TASK_FUNCTIONS + """
local bid = ARGV[1]
local raw = redis.call('HGET', KEYS[2], bid)
if not raw then
  local settled = redis.call('ZSCORE', KEYS[3], bid)
  if settled and tonumber(settled) > 0 then return {'already_acked', 0, 0} end
  if settled then
    redis.call('HINCRBY', KEYS[8], 'late_acks', 1)
    return {'expired', 0, 0}
  end
  return {'unknown', 0, 0}
end
local lease = cjson.decode(raw)
local samples = 0
for _, gid in ipairs(lease['groups']) do
  samples = samples + delete_group(KEYS[5], KEYS[6], KEYS[4], KEYS[9], gid)
  redis.call('SADD', KEYS[7], gid)
end
redis.call('HINCRBY', KEYS[8], 'groups_handed', #lease['groups'])
redis.call('HINCRBY', KEYS[8], 'samples_handed', samples)
redis.call('HINCRBY', KEYS[8], 'groups_consumed', #lease['groups'])
redis.call('HINCRBY', KEYS[8], 'batches_acked', 1)
local filtered = tonumber(lease['filtered'] or 0)
if filtered > 0 then
  redis.call('HINCRBY', KEYS[8], 'groups_filtered', filtered)
  redis.call('HINCRBY', KEYS[8], 'drop:filtered_group', filtered)
end
local hook_errors = tonumber(lease['hook_errors'] or 0)
if hook_errors > 0 then
  redis.call('HINCRBY', KEYS[8], 'drop:hook_error', hook_errors)
end
if type(lease['counts']) == 'table' then
  for name, amount in pairs(lease['counts']) do redis.call('HINCRBY', KEYS[8], name, amount) end
end
local added = extend_stream(KEYS[10], KEYS[8], KEYS[11], KEYS[12], KEYS[13], KEYS[14], tonumber(lease['extend'] or 0))
release_groups(KEYS[10], filtered + tonumber(lease['extend'] or 0))
redis.call('HDEL', KEYS[2], bid)
redis.call('ZREM', KEYS[1], bid)
redis.call('ZADD', KEYS[3], tonumber(ARGV[2]), bid)
redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -10001)
return {'acked', #lease['groups'], added}
"""

# KEYS: 1 lease_data. ARGV: 1 batch_id 2 filtered groups 3 hook-error groups 4 counters (JSON object:
# name -> amount) 5 groups to replace from the prompt stream.
# Stores what the read decided for its groups, to be counted (and replaced) when the batch is acknowledged.
SET_LEASE_OUTCOME = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local lease = cjson.decode(raw)
lease['filtered'] = tonumber(ARGV[2])
lease['hook_errors'] = tonumber(ARGV[3])
lease['counts'] = cjson.decode(ARGV[4])
lease['extend'] = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(lease))
return 1
"""

# KEYS: 1 leases 2 lease_data 3 ready 4 stats 5 wake 6 settled. ARGV: 1 now 2 limit 3 counter name.
# Ends leases due by `now` (a huge `now` releases them all, e.g. when a new trainer session starts).
EXPIRE_LEASES = _GROUP_FUNCTIONS + """
return expire_leases(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], tonumber(ARGV[1]),
                     tonumber(ARGV[2]), ARGV[3])
"""

# KEYS: 1 pending 2 ready 3 closed 4 stats 5 wake 6 records 7 timed_out 8 gsize 9 members 10 meta 11 gversion
# ARGV: 1 cutoff (first-write time) 2 policy (hand_over | drop) 3 limit
# Closes incomplete groups whose first write is older than the cutoff. Returns the number closed.
EXPIRE_GROUPS = _GROUP_FUNCTIONS + """
if redis.call('EXISTS', KEYS[10]) == 0 then return 0 end
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, gid in ipairs(expired) do
  redis.call('ZREM', KEYS[1], gid)
  redis.call('SADD', KEYS[3], gid)
  if ARGV[2] == 'hand_over' then
    redis.call('RPUSH', KEYS[2], gid)
    redis.call('HINCRBY', KEYS[4], 'groups_timed_out_handed', 1)
    wake(KEYS[5])
  else
    local n = delete_group(KEYS[8], KEYS[9], KEYS[6], KEYS[11], gid)
    redis.call('HINCRBY', KEYS[4], 'groups_consumed', 1)
    release_groups(KEYS[10], 1)
    redis.call('HINCRBY', KEYS[4], 'drop:group_timeout', 1)
    redis.call('HINCRBY', KEYS[4], 'drop:group_timeout_samples', n)
    redis.call('RPUSH', KEYS[7], gid)
  end
end
return #expired
"""

# KEYS: 1 meta 2 stats. ARGV: (name, amount) pairs. Adds to the run's counters unless the run is gone
# (a counter must not re-create the keys of a deleted run).
INCR_STATS = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'deleted' then return 0 end
for i = 1, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
"""


# KEYS: 1 meta 2 stats. ARGV: 1 version. Sets the trainer's policy version of a live run.
# Returns {1 (live) or 0, previous version or ''}.
SET_POLICY_VERSION = _GROUP_FUNCTIONS + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'deleted' then return {0, ''} end
local previous = redis.call('HGET', KEYS[1], 'policy_version') or ''
set_version(KEYS[1], KEYS[2], ARGV[1])
return {1, previous}
"""
