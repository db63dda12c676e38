"""Lua for leases that outlive their expiry: late acknowledgements and renewals (see `rollout_buffer.lua`).

An expired lease puts its groups back at the head of the ready list and keeps its lease JSON in
`lease_expired`. Every read that takes a group from the ready list records in `glease` which lease took it
(or removes the entry for a read without a lease, a stale drop or requeue), so "nobody took these groups
since the lease ran out" is `glease[gid] == batch_id` for each of its groups: then the group is still in
the ready list, untouched, and the batch can be acknowledged late (or renewed) as if it had never expired.
"""

__all__ = ["LEASE_FUNCTIONS", "RENEW_LEASE"]

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
