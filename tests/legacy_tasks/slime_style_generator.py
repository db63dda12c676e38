"""A task module in the style of slime's rollout buffer: synchronous `run_rollout(data)` that reads the
input file, "generates" each prompt `num_repeat_per_sample` times in a thread pool, and posts every
trajectory to `{remote_buffer_url}/buffer/write` (uid, instance_id, messages, reward, extra_info).
It uses only the standard library, as a slime module using `requests` would, and knows nothing of the
buffer's internals.
"""

import json
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

TASK_TYPE = "slime_style"


def post_record(url, record):
    request = urllib.request.Request(url, data=json.dumps(record).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def rollout_one(data, item, repeat):
    prompt = item["prompt"]
    answer = f"answer {repeat} to {prompt}"
    record = {
        "uid": str(uuid.uuid4()),
        "instance_id": item["instance_id"],
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
        "reward": float(repeat % 2),
        "extra_info": {"repeat": repeat, "task": data["task_type"]},
    }
    return post_record(data["remote_buffer_url"].rstrip("/") + "/buffer/write", record)


def run_rollout(data):
    with open(data["input_file"]) as handle:
        items = [json.loads(line) for line in handle if line.strip()]
    skip = set(data.get("skip_instance_ids") or [])
    jobs = []
    with ThreadPoolExecutor(max_workers=int(data["num_process"])) as pool:
        for _epoch in range(int(data["num_epoch"])):
            for item in items:
                if item["instance_id"] in skip:
                    continue
                for repeat in range(int(data["num_repeat_per_sample"])):
                    jobs.append(pool.submit(rollout_one, data, item, repeat))
        results = [job.result() for job in jobs]
    failed = [r for r in results if not r.get("success")]
    if failed:
        raise RuntimeError(f"{len(failed)} writes failed: {failed[:2]}")
