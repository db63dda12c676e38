"""Scripts that must run once per call, whatever the client library re-sends.

redis-py's cluster client sends a command again when its connection failed under it, so a script whose
reply was lost may run twice. A script that adds to counters (or extends a stream) takes a fresh token per
call, and its first run records the token in the run's `once` hash (`keys.once`, `HSETNX`): a re-send finds
it and changes nothing. One field per call that counts (a job's start, a read): the hash goes with its run.
"""

from __future__ import annotations

import uuid

# Lua: `first_call(k_once, token)` is true the first time a call's token is seen
ONCE_LUA = """
local function first_call(k_once, token)
  return redis.call('HSETNX', k_once, token, '1') == 1
end
"""


def new_token() -> str:
    return uuid.uuid4().hex
