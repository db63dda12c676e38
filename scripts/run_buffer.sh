#!/usr/bin/env bash
# Start the rollout buffer in the foreground (Ctrl-C stops it and its embedded Redis cleanly).
#
# Usage: scripts/run_buffer.sh [extra `rollout-buffer serve` flags...]
#
# Variables (all optional):
#   ROLLOUT_BUFFER_URL       where the buffer listens, http://HOST:PORT; when set, its host and port win
#   BUFFER_HOST              bind address                                  (default 127.0.0.1)
#   BUFFER_PORT              port                                          (default 8889)
#   ROLLOUT_BUFFER_DATA_DIR  embedded Redis data directory                 (default ./.rollout-buffer)
#   ROLLOUT_BUFFER_TASK_DIR  extra folder(s) of *_generator.py task modules, ':'-separated (default none)
#   PYTHON                   interpreter with the buffer's dependencies    (default python3)
#
# When sourced (scripts/run_agent.sh does), it only sets ROLLOUT_BUFFER_URL, PYTHONPATH and the
# BUFFER_SERVE command array, and starts nothing.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
BUFFER_HOST="${BUFFER_HOST:-127.0.0.1}"
BUFFER_PORT="${BUFFER_PORT:-8889}"
if [[ -n "${ROLLOUT_BUFFER_URL:-}" ]]; then
    if [[ "$ROLLOUT_BUFFER_URL" =~ ^http://([^:/]+):([0-9]+)/?$ ]]; then
        BUFFER_HOST="${BASH_REMATCH[1]}"
        BUFFER_PORT="${BASH_REMATCH[2]}"
    else
        echo "ROLLOUT_BUFFER_URL must look like http://HOST:PORT, got '$ROLLOUT_BUFFER_URL'" >&2
        exit 2
    fi
fi
ROLLOUT_BUFFER_URL="http://${BUFFER_HOST}:${BUFFER_PORT}"
ROLLOUT_BUFFER_DATA_DIR="${ROLLOUT_BUFFER_DATA_DIR:-.rollout-buffer}"
# the packages import from a checkout without installing it (the trainer needs slime_adapter too)
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

BUFFER_SERVE=("$PYTHON" -m rollout_buffer.cli serve --host "$BUFFER_HOST" --port "$BUFFER_PORT"
              --data-dir "$ROLLOUT_BUFFER_DATA_DIR")
if [[ -n "${ROLLOUT_BUFFER_TASK_DIR:-}" ]]; then
    IFS=':' read -r -a task_dirs <<< "$ROLLOUT_BUFFER_TASK_DIR"
    for dir in "${task_dirs[@]}"; do
        if [[ -n "$dir" ]]; then BUFFER_SERVE+=(--task-dir "$dir"); fi
    done
fi

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "rollout buffer on $ROLLOUT_BUFFER_URL (data: $ROLLOUT_BUFFER_DATA_DIR)" >&2
    exec "${BUFFER_SERVE[@]}" "$@"
fi
