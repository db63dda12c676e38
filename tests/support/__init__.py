"""Test helpers shared by the test folders: servers and processes (`helpers`, `process_tools`,
`runtime_helpers`), Redis backends (`backends`, `redis_cluster`), faults, the browser, records and
trajectories, slime namespaces, group filters named by tests, and the recording trainer peer of the remote
protocol (`recording_trainer`)."""
