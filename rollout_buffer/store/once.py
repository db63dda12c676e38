"""Scripts that must run once per call, whatever the client library re-sends.

redis-py's cluster client sends a command again when its connection failed under it, so a script whose
reply was lost may run twice. A script that adds to counters (or extends a stream) takes a fresh token per
call and a marker key named by it (`keys.once`): its first run sets the marker (`SET NX`, expiring after
`ONCE_TTL_S`), and a re-send finds it and changes nothing. The marker is in the run's hash slot.
"""

from __future__ import annotations

import uuid

ONCE_TTL_S = 3600  # far longer than any re-send: redis-py re-sends within seconds

# Lua: `first_call(marker_key)` is true the first time a call's marker is seen
ONCE_LUA = f"""
local function first_call(marker)
  return redis.call('SET', marker, '1', 'NX', 'EX', {ONCE_TTL_S}) ~= false
end
"""


def new_token() -> str:
    return uuid.uuid4().hex
