"""What crosses HTTP: the pydantic schema (`schema`), policy versions (`versions`), the packed record form
(`packing`), the packed read answer (`packed_read`), the packed write batch (`packed_batch`) and the write
path's fast parser (`record_parsing`).

Imports nothing else of the package, so that `slime_adapter` may import any of it (and only it, with
`security.auth` for the token) without pulling the service in.
"""
