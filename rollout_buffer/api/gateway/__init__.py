"""The agent gateway: OpenAI- and Anthropic-speaking agents train through the buffer, token-exact.

A run started with `"task_type": "external"` takes sessions from clients (`POST /runs/{run_id}/sessions`);
each session gets an API key that opens the model endpoints (`/v1/chat/completions`, `/v1/messages`,
`/v1/responses`, `/v1/models`) for that session only. Every request is rendered into token ids with the
run's chat template and sent to SGLang `/generate`; the session's own generated turns are never
re-tokenized (`history` matches the client's history against the session's turns, `rendering` tokenizes
only what the client added). Finishing a session (`POST /sessions/{id}/finish`, or the idle timeout)
writes its record through the store's ordinary write path: groups, leases, versions and metrics as for
any task module's records.

Modules, one job each (the session state lives lower, where the runtime can reach it too:
`rollout_buffer.store.sessions` (Redis keys in `rollout_buffer.store.keys`, the admission script beside
it), `rollout_buffer.store.session_turns` (one stored turn), `rollout_buffer.security.session_keys`
(session ids and API keys), `rollout_buffer.runtime.rollout_session` (`ctx.session()`)):

- `history`: canonical messages and the prefix digests a request is matched by;
- `rendering`: the first prompt, and the tokens of only the messages a client added;
- `parsers`: tool-call and reasoning parsers, named as SGLang names them;
- `turns`: one model call of a session (match, fork, render, generate, store; retries replay);
- `records`: a finished session as a trajectory record;
- `context`: what one API process keeps per run (tokenizer, engine client, parsers), and external run start;
- `errors`: each API's error shape and the session lookup;
- `wire_common`, `wire_openai`, `wire_anthropic`, `wire_responses`: each API's request and answer shapes;
- `serving`: running a turn for a route, streamed or not;
- `sse_stream`: a streamed answer's HTTP response (server-sent events, one write per flush, disconnects);
- `routes_sessions`, `routes_openai`, `routes_anthropic`, `routes_responses`: the HTTP routes;
- `reaper`: finishing idle sessions as failed; `app`: the routers and per-process state for the app factory.

Part of `api/`: it may import what the API may (runtime, runs, store, tasks, wire, security, settings);
only the app factory imports it.
"""
