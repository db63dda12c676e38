"""Redis: the clients (`redis_client`: one server or a Cluster), the embedded server (`embedded`), the one key
layout (`keys`), the store (`store`), hand-over of groups to readers with leases and acks (`handover`),
script batching (`batching`) and the Lua the store runs (`lua`, `stream_lua`).

May import `wire` only.
"""
