"""The HTTP service: the app factory (`app`), its kit (`state`, `errors`, `bodies`, `responses`), the upkeep
loop (`upkeep`) and the routes, one `APIRouter` per concern (`routes/`).

The top of the house: it may import every other folder (`runs`, `runtime`, `remote`, `metrics`, `store`,
`tasks`, `wire`, `security`) and the root's `settings` and `logs`; nothing imports it but the entry points.
"""
