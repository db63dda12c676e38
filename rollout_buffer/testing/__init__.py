"""Test fixtures the package ships for its users and its own tests: the SGLang test engine (`engine/`,
`rollout-buffer test-engine`) and the offline Qwen tokenizer with its chat templates (`tokenizer`).

May import `runtime`, `tasks` and `wire`; nothing in the product imports it but the CLI and the demo.
"""
