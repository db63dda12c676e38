"""SGLang's streamed `/generate` (`"stream": true`): server-sent events, `data: {"text", "output_ids",
"meta_info"}` per chunk, then `data: [DONE]`.

As SGLang does: chunks are cumulative (everything so far) unless the server runs with
`--incremental-streaming-output` (`incremental_streaming_output`: only what is new), one every
`stream_interval` tokens (`--stream-interval`) and at the end, its text without a character split across
tokens; `meta_info.output_token_logprobs` always holds
every token so far; `finish_reason` is null until the last chunk. Tokens come `token_delay_s` apart after the
request's latency, on a fixed schedule (as a GPU's decode steps: a busy event loop here does not slow the
rate, so a streamed call takes its latency plus tokens x delay, as an unstreamed one of that latency does); `/abort_request` with the rid cuts the stream (`finish_reason.type` `abort`), and a client
that disconnects stops the generation, which is logged as aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from rollout_buffer.testing.engine.core import Engine
from rollout_buffer.testing.engine.http_server import BadRequest, Streamed
from rollout_buffer.testing.engine.output import output_text


DISCONNECTED = "the client disconnected"


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def stream_generate(engine: Engine, body: dict[str, Any], params: dict[str, Any]) -> Streamed:
    """The streamed answer of one single-prompt `/generate` request."""
    prompt = body.get("input_ids")
    if prompt is None and isinstance(body.get("text"), str):
        prompt = list(engine.tokenizer.encode(body["text"]))
    if not isinstance(prompt, list) or (prompt and isinstance(prompt[0], list)):
        raise BadRequest("a streamed /generate takes one prompt (input_ids or text)")
    rid = body.get("rid")
    plan, count, reason, rng, request_id = engine.prepare(list(prompt), params, None if rid is None else str(rid))
    want_logprob = bool(body.get("return_logprob", False))
    config = engine.config
    incremental, interval = config.incremental_streaming_output, max(1, config.stream_interval)

    def chunk(ids: list[int], sent: int, text_sent: int, final: dict[str, Any] | None) -> tuple[bytes, int]:
        # a chunk's text ends at its last whole character, as SGLang's detokenizer holds back a split one
        text = output_text(ids, final, params, engine.codec) if final else engine.codec.decode(
            ids, skip_special_tokens=bool(params.get("skip_special_tokens", True))).rstrip("\ufffd")
        meta: dict[str, Any] = {"id": request_id, "finish_reason": final, "prompt_tokens": len(prompt),
                                "completion_tokens": len(ids), "weight_version": config.weight_version}
        if want_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(plan.logprobs, ids)]
        payload = {"text": text[text_sent:] if incremental else text,
                   "output_ids": ids[sent:] if incremental else ids, "meta_info": meta}
        return _event(payload), len(text)

    async def chunks() -> AsyncIterator[bytes]:
        ids: list[int] = []
        final = reason
        sent = text_sent = 0
        recorded = False
        loop = asyncio.get_running_loop()
        due = loop.time() + config.latency_s + rng.uniform(0, config.latency_jitter_s)  # the next token's time
        try:
            for token in plan.ids[:count]:
                aborted = await engine.inflight.wait(request_id, max(0.0, due - loop.time()))
                if aborted is not None:
                    final = {"type": "abort", "message": aborted[0]}
                    engine.count_abort()
                    break
                due += config.token_delay_s  # on a fixed schedule: a late wake-up does not slow the rate
                ids.append(token)
                if len(ids) % interval == 0 and len(ids) < count:
                    event, text_sent = chunk(ids, sent, text_sent, None)
                    sent = len(ids)
                    yield event
            event, _ = chunk(ids, sent, text_sent, final)
            engine.record(request_id, list(prompt), ids, plan.logprobs[:len(ids)], final, params)
            recorded = True
            yield event
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            if not recorded:
                engine.record(request_id, list(prompt), ids, plan.logprobs[:len(ids)],
                              {"type": "abort", "message": DISCONNECTED}, params)
            raise

    return Streamed(chunks())
