"""A protocol-faithful SGLang stand-in for tests: real HTTP, real tokenizer, seeded output.

It answers ``/generate`` and ``/v1/chat/completions`` the way SGLang does (token ids,
finish reasons, logprobs, weight versions, aborts), scripts plausible answers to
arithmetic questions (including a calculator tool call), and mixes in random
vocabulary tokens that do not survive decode -> encode, so code that must keep the
engine's own token ids is exercised. Faults (HTTP 500, aborts, hangs, malformed
bodies) are injectable by rate or exact count, also over HTTP from another process.

Modules, one concern each:

- ``server``: ``TestEngine``, its lifecycle and generation path;
- ``endpoints``, ``generate``, ``chat``: the route table and the protocol's endpoints;
- ``http_server``: the lean HTTP/1.1 server under them;
- ``answers`` and ``policy``: the scripted policy (answer text; token ids and logprobs);
- ``output``: SGLang's stop checks and detokenization applied to a planned output;
- ``faults``, ``inflight``: injected faults; waiting requests that aborts interrupt;
- ``config``, ``stats``, ``codec``: knobs, counters, tokenizer work;
- ``running``, ``cli``: running an engine in a test, or from the command line.
"""

from rollout_buffer.testing.engine.answers import (
    Responder,
    default_responder,
    evaluate_expression,
    find_last_expression,
    format_number,
)
from rollout_buffer.testing.engine.cli import main
from rollout_buffer.testing.engine.config import EngineConfig
from rollout_buffer.testing.engine.output import SGLANG_DEFAULT_MAX_NEW_TOKENS, Result
from rollout_buffer.testing.engine.policy import Plan, noise_tokens
from rollout_buffer.testing.engine.running import run_engine_in_thread, running_engine
from rollout_buffer.testing.engine.server import ENGINE_ID_HEADER, TestEngine

__all__ = [
    "ENGINE_ID_HEADER",
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "EngineConfig",
    "Plan",
    "Responder",
    "Result",
    "TestEngine",
    "default_responder",
    "evaluate_expression",
    "find_last_expression",
    "format_number",
    "main",
    "noise_tokens",
    "run_engine_in_thread",
    "running_engine",
]
