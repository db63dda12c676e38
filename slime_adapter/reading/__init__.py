"""Reading from the buffer: `/start_rollout` and the leased `/get_rollout_data` long poll (`buffer_client`),
keeping the leases of batches read but not yet acknowledged (`lease_renewal`), and never polling forever on
a run that cannot deliver (`run_health`). Imports the root's `auth` and `settings` only.
"""
