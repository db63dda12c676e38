"""Task modules: the contract they are written against (`contract`), their discovery (`discovery`), the
helpers they use (`groups`, `input_file`, `input_keys`, `chat_format`) and the built-in tasks (`builtin/`,
`*_generator.py`).

May import `wire` only: a task module, and so this folder, knows nothing of the service around it.
"""
