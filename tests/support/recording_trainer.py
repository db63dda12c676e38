"""A trainer-hosted model endpoint for tests of the remote-rollout protocol, recording what it receives.

It behaves like a trainer that keeps tokens on its own side, as the protocol's guide describes: per
`rollout_id` it holds the first prompt's ids, then `response_ids` / `response_mask`. Every call's `messages`
and `tools` are rendered with the chat template of its tokenizer (the real Qwen2.5 tool template by default).
On each call after the first it computes the guide's count itself,

    n = len(render(messages)) - last_prompt_length,  last_prompt_length = previous render length + len(token_ids)

checks the received `response_mask` against it (n zeros), appends the render's last n tokens with mask 0,
generates from its own token list through a TestEngine's token-in/token-out `/generate`, appends the sampled
ids with mask 1 and answers with `token_ids` and `prompt_token_ids`, like a real server. It also records, for
comparison only, the tokens that follow the previous reply as re-rendered (`tail_ids`): they differ from the
n it appends exactly where the template re-renders the reply differently from the model's ids (drift).
`/v1/rollout/completed` records completion callbacks, deduplicated by `Idempotency-Key`, and can be told to
fail its next attempts with HTTP 500 or by dropping the connection. What it recorded is available in Python
and at `GET /_recorded/{rollout_id}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from rollout_buffer.remote.mask import end_of_turn_id
from rollout_buffer.tasks.chat_format import parse_assistant_text
from rollout_buffer.testing.engine import TestEngine
from rollout_buffer.testing.engine.running import background_loop
from rollout_buffer.testing.tokenizer import load_qwen_tokenizer


@dataclass
class CallRecord:
    """One chat call as the trainer saw it."""

    call_index: int | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    response_mask: list[int] | None  # as received; None when absent
    expected_new_tokens: int | None  # the trainer's own count by the guide's formula (None on the first call)
    rendered_ids: list[int]  # the chat template's rendering of the received messages and tools
    new_token_ids: list[int]  # the non-model tokens appended with mask 0
    tail_ids: list[int] | None  # what follows the previous reply as re-rendered (None: not found, or first call)
    prompt_ids: list[int]  # the trainer's whole token list the model generated from
    output_ids: list[int]
    finish_reason: str
    retried: int = 0  # repeats of this call_index answered from the cache


@dataclass
class Session:
    """Per-rollout token bookkeeping, the way a trainer keeps it."""

    rollout_id: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last_prompt_length: int = 0  # previous render length + len(previous token_ids), as the guide defines it
    last_prompt_text: str = ""
    last_closed: bool = True
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class CallbackAttempt:
    rollout_id: str | None
    idempotency_key: str | None
    outcome: str  # accepted | duplicate | fail_500 | dropped | refused | bad_request
    body: dict[str, Any] | None
    at: float


class RecordingTrainer:
    """The recording trainer server (see module docstring). Thread-safe reads from the test's thread."""

    __test__ = False

    def __init__(self, *, engine_url: str, tokenizer: Any, strict: bool = True,
                 default_max_tokens: int = 512, token_ids_at: str = "top") -> None:
        if token_ids_at not in ("top", "choice"):
            raise ValueError("token_ids_at must be 'top' (the guide's shape) or 'choice' (vLLM / SGLang's)")
        self.engine_url = engine_url.rstrip("/")
        self.tokenizer = tokenizer
        self.eot = end_of_turn_id(tokenizer)
        self.eot_text = tokenizer.convert_ids_to_tokens(self.eot)
        self.strict = strict
        self.default_max_tokens = default_max_tokens
        self.token_ids_at = token_ids_at
        self.sessions: dict[str, Session] = {}
        self.callback_attempts: list[CallbackAttempt] = []
        self.completions: dict[str, dict[str, Any]] = {}  # rollout_id -> first accepted callback body
        self._unchecked: set[str] = set()
        self._without_ids: set[str] = set()
        self._fail: list[str] = []  # queued failure modes for the next callback attempts
        self._cond = threading.Condition()
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self.url = ""

    # ----- control from tests -----------------------------------------------------------------

    def fail_callbacks(self, count: int, mode: str = "500") -> None:
        """Fail `count` more callback attempts (queued after earlier ones): "500" answers HTTP 500, "drop"
        closes the connection without an answer, "400" refuses the body with HTTP 400."""
        if mode not in ("500", "drop", "400"):
            raise ValueError("mode must be '500', 'drop' or '400'")
        with self._cond:
            self._fail.extend([mode] * count)

    def clear_callback_failures(self) -> None:
        with self._cond:
            self._fail.clear()

    def allow_unchecked_mask(self, rollout_id: str) -> None:
        """Accept any response_mask for this rollout (for tasks that send an explicit mask)."""
        with self._cond:
            self._unchecked.add(rollout_id)

    def omit_token_ids(self, rollout_id: str) -> None:
        """Answer this rollout's calls without token_ids, like a server that does not return them."""
        with self._cond:
            self._without_ids.add(rollout_id)

    def wait_for_completion(self, rollout_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The accepted callback body of `rollout_id`; raises TimeoutError when none arrives in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while rollout_id not in self.completions:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no completion callback for {rollout_id} within {timeout_s}s")
                self._cond.wait(left)
            return self.completions[rollout_id]

    def wait_for_calls(self, rollout_id: str, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.sessions.get(rollout_id, Session(rollout_id)).calls) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{rollout_id}: fewer than {count} calls within {timeout_s}s")
                self._cond.wait(left)

    def recorded(self, rollout_id: str) -> dict[str, Any]:
        """Everything recorded for one rollout (JSON-ready)."""
        with self._cond:
            session = self.sessions.get(rollout_id)
            attempts = [asdict(a) for a in self.callback_attempts if a.rollout_id == rollout_id]
            return {
                "rollout_id": rollout_id,
                "prompt_ids": list(session.prompt_ids) if session else [],
                "response_ids": list(session.response_ids) if session else [],
                "response_mask": list(session.response_mask) if session else [],
                "calls": [asdict(c) for c in session.calls] if session else [],
                "errors": list(session.errors) if session else [],
                "callback_attempts": attempts,
                "completion": self.completions.get(rollout_id),
                "accepted_callbacks": sum(1 for a in attempts if a["outcome"] == "accepted"),
            }

    # ----- server ---------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._http = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/rollout/completed", self._completed)
        app.router.add_get("/_recorded/{rollout_id}", self._recorded)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")

    async def _recorded(self, request: web.Request) -> web.Response:
        return self._json(self.recorded(request.match_info["rollout_id"]))

    # ----- /v1/rollout/completed ----------------------------------------------------------------

    async def _completed(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        key = request.headers.get("Idempotency-Key")
        try:
            body = orjson.loads(raw)
            rollout_id = body.get("rollout_id") if isinstance(body, dict) else None
        except orjson.JSONDecodeError:
            body, rollout_id = None, None
        with self._cond:
            mode = self._fail.pop(0) if self._fail else None
            if mode is not None:
                outcome = {"500": "fail_500", "drop": "dropped", "400": "refused"}[mode]
            elif not isinstance(body, dict) or not isinstance(rollout_id, str) or not rollout_id or key != rollout_id:
                outcome = "bad_request"
            else:
                outcome = "duplicate" if rollout_id in self.completions else "accepted"
                self.completions.setdefault(rollout_id, body)
            self.callback_attempts.append(CallbackAttempt(rollout_id, key, outcome, body, time.time()))
            self._cond.notify_all()
        if outcome == "dropped":
            assert request.transport is not None
            request.transport.abort()  # the client sees the connection reset, no answer
            raise asyncio.CancelledError
        if outcome == "fail_500":
            return self._json({"error": "injected callback failure"}, 500)
        if outcome == "refused":
            return self._json({"error": "injected callback refusal"}, 400)
        if outcome == "bad_request":
            return self._json({"error": "callback needs a JSON body with rollout_id and a matching "
                                        "Idempotency-Key header"}, 400)
        return self._json({"success": True, "duplicate": outcome == "duplicate"})

    # ----- /v1/chat/completions -----------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _tail(self, session: Session, text: str) -> list[int] | None:
        """What follows the previous reply as the template re-renders it (found in text: the previous prompt,
        then up to the reply's end-of-turn marker); None when the new text does not extend the previous one."""
        if not text.startswith(session.last_prompt_text):
            return None
        at = text.find(self.eot_text, len(session.last_prompt_text))
        if at < 0:
            return None
        return self._encode(text[at + len(self.eot_text) if session.last_closed else at:])

    def _mask_problem(self, mask: Any, expected: int) -> str | None:
        if expected < 0:
            return f"the guide's count is negative ({expected}): the render is shorter than the tokens held"
        if not isinstance(mask, list) or any(x != 0 for x in mask):
            return f"a later call needs response_mask = [0] * n, got {str(mask)[:80]}"
        if len(mask) != expected:
            return f"response_mask has {len(mask)} zeros but the guide's count is {expected}"
        return None

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return self._json({"error": {"message": "body is not JSON"}}, 400)
        rollout_id, messages = body.get("rollout_id"), body.get("messages")
        if not isinstance(rollout_id, str) or not isinstance(messages, list) or not messages:
            return self._json({"error": {"message": "rollout_id and messages are required"}}, 400)
        tools = body.get("tools") or None
        call_index = body.get("call_index")
        mask = body.get("response_mask")
        with self._cond:
            session = self.sessions.setdefault(rollout_id, Session(rollout_id))
            if isinstance(call_index, int) and call_index in session.answers:
                for done in session.calls:
                    done.retried += done.call_index == call_index
                return self._json(session.answers[call_index])
            unchecked = rollout_id in self._unchecked
        text = self._render(messages, tools)
        rendered = self._encode(text)
        first = not session.calls
        expected: int | None = None
        tail: list[int] | None = None
        if first:
            new_ids: list[int] = []
            problem = "the first call must not carry a response_mask" if mask is not None else None
            prompt = rendered
        else:
            expected = len(rendered) - session.last_prompt_length
            tail = self._tail(session, text)
            problem = self._mask_problem(mask, expected)
            if problem is not None and unchecked and isinstance(mask, list):
                problem = None
            # The render's last n tokens (n: the guide's count, or an unchecked mask's length).
            take = len(mask) if unchecked and isinstance(mask, list) else max(expected, 0)
            new_ids = rendered[len(rendered) - take:] if take else []
            prompt = [*session.prompt_ids, *session.response_ids, *new_ids]
        if problem is not None:
            with self._cond:
                session.errors.append(f"call {len(session.calls)}: {problem}")
            if self.strict:
                return self._json({"error": {"message": problem}}, 400)
        try:
            output_ids, logprobs, text_out, finish = await self._generate(prompt, body, rollout_id, len(session.calls))
        except Exception as exc:  # noqa: BLE001 - the engine failed: a trainer answers 5xx and keeps no tokens
            return self._json({"error": {"message": f"generation failed: {exc}"}}, 503)
        message = parse_assistant_text(text_out, id_prefix=f"call_{uuid.uuid4().hex[:8]}")
        finish_reason = "tool_calls" if finish == "stop" and message.get("tool_calls") else finish
        with self._cond:
            with_ids = rollout_id not in self._without_ids
        answer = self._answer(body, message, finish_reason, prompt, output_ids, logprobs, with_ids)
        with self._cond:
            if first:
                session.prompt_ids = prompt
            else:
                session.response_ids.extend(new_ids)
                session.response_mask.extend([0] * len(new_ids))
            session.response_ids.extend(output_ids)
            session.response_mask.extend([1] * len(output_ids))
            session.last_prompt_length = len(rendered) + len(output_ids)
            session.last_prompt_text = text
            session.last_closed = bool(output_ids) and output_ids[-1] == self.eot
            session.calls.append(CallRecord(call_index, messages, tools, mask, expected, rendered, new_ids, tail,
                                            prompt, output_ids, finish_reason))
            if isinstance(call_index, int):
                session.answers[call_index] = answer
            self._cond.notify_all()
        return self._json(answer)

    async def _generate(self, prompt: list[int], body: dict[str, Any], rollout_id: str,
                        index: int) -> tuple[list[int], list[float], str, str]:
        assert self._http is not None
        params = {"max_new_tokens": body.get("max_tokens", body.get("max_completion_tokens", self.default_max_tokens)),
                  "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0)}
        if body.get("stop"):
            params["stop"] = body["stop"]
        request = {"input_ids": prompt, "sampling_params": params, "return_logprob": True,
                   "rid": f"{rollout_id}:{index}"}
        async with self._http.post(f"{self.engine_url}/generate", json=request,
                                   timeout=aiohttp.ClientTimeout(total=60)) as response:
            response.raise_for_status()
            answer = await response.json()
        meta = answer["meta_info"]
        output_ids = [int(x) for x in answer["output_ids"]]
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        finish = meta["finish_reason"]["type"] if isinstance(meta["finish_reason"], dict) else str(meta["finish_reason"])
        return output_ids, logprobs, answer["text"], finish

    def _answer(self, body: dict[str, Any], message: dict[str, Any], finish: str, prompt: list[int],
                output_ids: list[int], logprobs: list[float], with_ids: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(output_ids, logprobs)]}
        answer: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                  "created": int(time.time()), "model": body.get("model", "trainer"),
                                  "choices": [choice],
                                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output_ids),
                                            "total_tokens": len(prompt) + len(output_ids)}}
        if with_ids:  # the protocol's trainer always returns them; `token_ids_at` picks the shape
            answer["prompt_token_ids"] = prompt
            (answer if self.token_ids_at == "top" else choice)["token_ids"] = output_ids
        return answer


@contextlib.contextmanager
def run_recording_trainer_in_thread(*, engine_url: str | None = None, template: str = "qwen2.5",
                                    tokenizer: Any | None = None, strict: bool = True, token_ids_at: str = "top",
                                    **engine_kwargs: Any) -> Iterator[RecordingTrainer]:
    """Run a RecordingTrainer (and, without `engine_url`, its own TestEngine) on a loop in a daemon thread."""
    tokenizer = tokenizer if tokenizer is not None else load_qwen_tokenizer(template)
    engine: TestEngine | None = None

    async def build() -> RecordingTrainer:
        nonlocal engine
        url = engine_url
        if url is None:
            engine = TestEngine(template=template, tokenizer=tokenizer, **engine_kwargs)
            url = await engine.start()
        trainer = RecordingTrainer(engine_url=url, tokenizer=tokenizer, strict=strict, token_ids_at=token_ids_at)
        await trainer.start()
        return trainer

    with background_loop("recording-trainer") as run:
        trainer: RecordingTrainer | None = None
        try:
            trainer = run(build())
            yield trainer
        finally:
            with contextlib.suppress(Exception):
                if trainer is not None:
                    run(trainer.stop(), 30)
                if engine is not None:
                    run(engine.stop(), 30)
