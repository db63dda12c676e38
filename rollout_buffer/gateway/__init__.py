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
- `nodes`: one stored turn of a session (ids as packed arrays);
- `sessions`: the sessions' Redis state (keys in `rollout_buffer.keys`);
- `rendering`: the first prompt, and the tokens of only the messages a client added;
- `parsers`: tool-call and reasoning parsers, named as SGLang names them;
- `turns`: one model call of a session (match, fork, render, generate, store; retries replay);
- `records`: a finished session as a trajectory record;
- `context`: what one API process keeps per run (tokenizer, engine client, parsers);
- `keys_auth`: session ids and API keys;
- `wire_openai`, `wire_anthropic`, `wire_responses`: each API's request and answer shapes;
- `routes_*`: the HTTP routes (sessions, one module per API), `errors`: each API's own error shape;
- `reaper`: finishing idle sessions as failed.

It may import the store, keys, schema, settings, runtime engine client and prompt tokens, and
`http_errors`; nothing else imports it but the app factory (`rollout_buffer.api`).
"""
