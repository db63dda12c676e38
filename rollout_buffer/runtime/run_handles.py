"""A run as one worker process serves it: its options, task module, tokenizer, queue and this host's facts.

`load_handle` is the worker's gate for a run: an unknown or legacy task, an external (gateway) run, or an engine
outside this process's `--allow-url` is not served here (None).
"""

from __future__ import annotations

import logging

from rollout_buffer.runtime.executor import RunHandle
from rollout_buffer.runtime.host_locks import redis_host_lock, redis_image_cache
from rollout_buffer.runtime.jobqueue import JobQueue
from rollout_buffer.runtime.options import RunOptions
from rollout_buffer.runtime.task_folders import TaskFolders, default_cache
from rollout_buffer.runtime.tokenizers import get_tokenizer
from rollout_buffer.security.access import AccessDenied, AccessPolicy
from rollout_buffer.security.outbound import checked_engine_urls
from rollout_buffer.settings import Settings
from rollout_buffer.store.store import Store
from rollout_buffer.tasks.contract import ServerFacts
from rollout_buffer.tasks.discovery import TaskRegistry
from rollout_buffer.tasks.harbor_toml import TaskLimits
from rollout_buffer.wire.schema import StartRolloutRequest

log = logging.getLogger(__name__)
EXTERNAL_TASK_TYPE = "external"  # a run whose sessions come from clients through the gateway (no task module)


async def load_handle(store: Store, registry: TaskRegistry, settings: Settings, run_id: str) -> RunHandle | None:
    """The run as this worker can serve it, or None (unknown task here, legacy task, bad config, an engine
    outside this process's `--allow-url`)."""
    config = await store.run_config(run_id)
    if config is None:
        return None
    request = StartRolloutRequest.model_validate(config)
    task = registry.get(request.task_type)
    if task is None and request.task_type == EXTERNAL_TASK_TYPE:  # the agent gateway's run: the API serves it
        log.debug("run %s: an external run, served by the gateway, not by workers", run_id)
        return None
    if task is None:
        log.error("run %s: task_type %r is not known to this worker (add its --task-dir)", run_id, request.task_type)
        return None
    if task.kind != "native":
        return None
    options = RunOptions.from_request(request, rollout_timeout_s=settings.rollout_timeout_s)
    access = AccessPolicy.from_settings(settings)
    try:  # checked at /start_rollout; again here, for a run stored before this process's --allow-url narrowed
        checked_engine_urls(access, request.remote_engine_url)
        if options.auto is not None:
            checked_engine_urls(access, options.auto.load_urls, "concurrency_load_urls")
    except AccessDenied as exc:
        log.error("run %s: not served by this worker: %s", run_id, exc)
        return None
    tokenizer = (await get_tokenizer(options.tokenizer_path, allow_download=settings.allow_hub_downloads)
                 if options.tokenizer_path else None)
    server = ServerFacts(agent_sandboxes=access.agent_sandboxes, input_roots=tuple(str(r) for r in access.roots),
                         egress_agent=access.egress_agent, egress_verifier=access.egress_verifier,
                         egress_proxy=access.egress_proxy, egress_mirror=access.egress_mirror,
                         egress_build=access.egress_build, forwarder_image=settings.forwarder_image or "",
                         host_lock=redis_host_lock(store.redis),
                         gateway_url=settings.gateway_url or "", model_body_bytes=settings.gateway_body_bytes,
                         task_limits=TaskLimits.from_settings(settings), allowed_urls=tuple(access.allowed_urls),
                         image_cache=redis_image_cache(store.redis, settings.image_cache_mb))
    folders = TaskFolders(store.redis, settings.task_folder_cache or default_cache(), settings.task_folders,
                          settings.task_folder_max_mb)
    return RunHandle(run_id=run_id, request=request, options=options, task=task, tokenizer=tokenizer,
                     queue=JobQueue(store.redis, run_id), server=server, folders=folders)
