"""The agent gateway: OpenAI- and Anthropic-speaking agents train through the buffer, token-exact.

A run started with `"task_type": "external"` takes sessions from clients (`POST /runs/{run_id}/sessions`);
each session gets an API key that opens the model endpoints (`/v1/chat/completions`, `/v1/messages`,
`/v1/responses`, `/v1/models`) for that session only. Every request is rendered into token ids with the
run's chat template and sent to SGLang `/generate`; the session's own generated turns are never
re-tokenized (`history` matches the client's history against the session's turns, `rendering` tokenizes
only what the client added). Finishing a session (`POST /sessions/{id}/finish`, or the idle timeout)
writes its record through the store's ordinary write path: groups, leases, versions and metrics as for
any task module's records.

Modules, one job each:

- `history`: canonical messages and the prefix digests a request is matched by;
- `nodes`: one stored turn of a session (ids as packed arrays, prompts stored as tails);
- `sessions`: the sessions' Redis state (keys in `rollout_buffer.keys`; the admission script beside it);
- `rendering`: the first prompt, and the tokens of only the messages a client added;
- `parsers`: tool-call and reasoning parsers, named as SGLang names them;
- `turns`: one model call of a session (match, fork, render, generate, store; retries replay);
- `records`: a finished session as a trajectory record;
- `context`: what one API process keeps per run (tokenizer, engine client, parsers), and external run start;
- `keys_auth`: session ids and API keys; `errors`: each API's error shape and the session lookup;
- `wire_common`, `wire_openai`, `wire_anthropic`, `wire_responses`: each API's request and answer shapes;
- `serving`: running a turn for a route and framing streams (sse-starlette);
- `routes_sessions`, `routes_openai`, `routes_anthropic`, `routes_responses`: the HTTP routes;
- `reaper`: finishing idle sessions as failed; `app`: the routers and per-process state for the app factory;
- `in_rollout`: `ctx.session()`, a native rollout's own session (used by the runtime's executor).

It may import the store, keys, schema, settings, access, run policy, the runtime's engine client, prompt
tokens and tokenizers, and `http_errors`. Imported by the app factory (`rollout_buffer.api`), and
`in_rollout` by the runtime's executor (it imports only the store-level modules here).
"""
