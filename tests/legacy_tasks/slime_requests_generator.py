"""A slime-style task module that posts with `requests` and `httpx`, as slime's own modules do: both
clients log the URL they call (httpx at INFO, urllib3 at DEBUG) from the server's thread, so the run's
capability URL reaches the server's log unless the server redacts it (tests/test_auth.py).
"""

import json
import uuid

import httpx
import requests

TASK_TYPE = "slime_requests"


def run_rollout(data):
    url = data["remote_buffer_url"].rstrip("/") + "/buffer/write"
    with open(data["input_file"]) as handle:
        items = [json.loads(line) for line in handle if line.strip()]
    for item in items:
        for post in (requests.post, httpx.post):
            record = {"uid": str(uuid.uuid4()), "instance_id": item["instance_id"],
                      "messages": [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": "a"}],
                      "reward": 1.0, "extra_info": {}}
            post(url, json=record, timeout=30).raise_for_status()
