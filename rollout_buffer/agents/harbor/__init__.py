"""Harbor tasks as agent_command rollouts: the task's image (named or built, `images`), its limits and
timeouts (`plan`), and Harbor's test-script verification (`verify`). The format's parsing lives in
`rollout_buffer.tasks.harbor`."""
