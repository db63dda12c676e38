"""Unmodified agents as tasks: the `agent_command` task type (`task`), its run options (`config`), the
sandbox contract (`sandbox`) with its local backend (`local`, `guard`), and verifiers (`verifiers`)."""
