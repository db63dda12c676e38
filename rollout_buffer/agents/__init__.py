"""Unmodified agents as tasks: the `agent_command` task type (`task`, discovered as a built-in task through
`agent_command_generator.py`), its run options (`config`), the sandbox contract (`sandbox`) with its local
backend (`local`, `guard`), and verifiers (`verifiers`)."""
