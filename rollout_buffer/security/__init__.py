"""Who may call in and where the service may reach out: bearer-token auth, run capabilities and the ASGI
middleware (`auth`); input roots and outbound URL checks (`access`).

Imports nothing else of the package: the API, the runtime, the remote service, the CLI and `slime_adapter`
all use it.
"""
