"""Lua for acknowledging and renewing leases, also after they ran out (see `rollout_buffer.lua`).

An expired lease puts its groups back at the head of the ready list and keeps its lease JSON in
`lease_expired`. Every read that takes a group from the ready list records in `glease` which lease took it
(or removes the entry for a read without a lease, a stale drop or requeue), so "nobody took these groups
since the lease ran out" is `glease[gid] == batch_id` for each of its groups: then the group is still in
the ready list, untouched, and the batch can be acknowledged late (or renewed) as if it had never expired.
"""

__all__ = ["ACK_BODY", "LEASE_FUNCTIONS", "RENEW_LEASE", "SET_LEASE_OUTCOME"]

# Shared functions, prepended (after `lua._GROUP_FUNCTIONS`) to the scripts that need them.
LEASE_FUNCTIONS = """
-- The lease JSON of expired batch `bid` if none of its groups was taken from the ready list since it
-- expired; its groups are then taken out of the ready list again. Otherwise nil, and nothing changes.
local function reclaim_expired(k_expired, k_glease, k_ready, bid)
  local raw = redis.call('HGET', k_expired, bid)
  if not raw then return nil end
  local groups = cjson.decode(raw)['groups']
  for _, gid in ipairs(groups) do
    if redis.call('HGET', k_glease, gid) ~= bid then return nil end
  end
  local removed = {}
  for _, gid in ipairs(groups) do
    -- expired groups sit at the head of the ready list: LREM finds them within the first few entries
    if redis.call('LREM', k_ready, 1, gid) == 0 then
      for i = #removed, 1, -1 do redis.call('LPUSH', k_ready, removed[i]) end
      return nil
    end
    removed[#removed + 1] = gid
  end
  redis.call('HDEL', k_expired, bid)
  return raw
end
"""

# KEYS: 1 leases 2 lease_data 3 settled 4 stats 5 lease_expired 6 glease 7 ready
# ARGV: 1 batch_id 2 now
# Extends a live lease by its own `lease_s` from now. An expired lease whose groups nobody took since is
# leased again (its groups leave the ready list). Returns {outcome, lease_s}: renewed | expired |
# already_acked | unknown.
RENEW_LEASE = LEASE_FUNCTIONS + """
local bid = ARGV[1]
local now = tonumber(ARGV[2])
local raw = redis.call('HGET', KEYS[2], bid)
if not raw then
  local settled = redis.call('ZSCORE', KEYS[3], bid)
  if not settled then return {'unknown', '0'} end
  if tonumber(settled) > 0 then return {'already_acked', '0'} end
  raw = reclaim_expired(KEYS[5], KEYS[6], KEYS[7], bid)
  if not raw then return {'expired', '0'} end
  redis.call('HSET', KEYS[2], bid, raw)
  redis.call('ZREM', KEYS[3], bid)
  redis.call('HINCRBY', KEYS[4], 'leases_reclaimed', 1)
end
local lease_s = tonumber(cjson.decode(raw)['lease_s'] or 0)
redis.call('ZADD', KEYS[1], now + lease_s, bid)
redis.call('HINCRBY', KEYS[4], 'lease_renewals', 1)
return {'renewed', tostring(lease_s)}
"""

# KEYS: 1 leases 2 lease_data 3 settled 4 records 5 gsize 6 members 7 handed 8 stats 9 gversion 10 meta
#       11 tasks 12 lines 13 skip 14 closed 15 lease_expired 16 glease 17 ready
# ARGV: 1 batch_id 2 now
# The body of `lua.ACK_BATCH` (after its shared functions). Ends a lease for good: its groups are deleted
# and marked handed over, what the reader decided for them (stored with the lease by SET_LEASE_OUTCOME:
# counters, groups a filter dropped) is counted now, those dropped groups are replaced from the prompt
# stream, and filtered groups free admission at once. A lease
# that ran out is acknowledged all the same when nobody took its groups from the ready list since
# (`reclaim_expired`, counted `late_acks_accepted`); otherwise the ack is refused (`expired`,
# counted `late_acks`). Returns {outcome, groups, groups added}: acked | already_acked | expired | unknown.
ACK_BODY = """
local bid = ARGV[1]
local raw = redis.call('HGET', KEYS[2], bid)
if not raw then
  local settled = redis.call('ZSCORE', KEYS[3], bid)
  if settled and tonumber(settled) > 0 then return {'already_acked', 0, 0} end
  if not settled then return {'unknown', 0, 0} end
  raw = reclaim_expired(KEYS[15], KEYS[16], KEYS[17], bid)
  if not raw then
    redis.call('HINCRBY', KEYS[8], 'late_acks', 1)
    return {'expired', 0, 0}
  end
  redis.call('HINCRBY', KEYS[8], 'late_acks_accepted', 1)
end
local lease = cjson.decode(raw)
local samples = 0
for _, gid in ipairs(lease['groups']) do
  samples = samples + delete_group(KEYS[5], KEYS[6], KEYS[4], KEYS[9], gid)
  redis.call('SADD', KEYS[7], gid)
  redis.call('HDEL', KEYS[16], gid)
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
