#!/usr/bin/env bash
# Run the rollout buffer and a slime training command side by side.
#
# Usage: scripts/run_agent.sh [extra `rollout-buffer serve` flags...] -- TRAIN_COMMAND [ARGS...]
#   e.g. scripts/run_agent.sh -- python train.py --hf-checkpoint /models/qwen ... --rollout-task-type math
#
# Starts the buffer (see scripts/run_buffer.sh for ROLLOUT_BUFFER_URL, BUFFER_HOST, BUFFER_PORT,
# ROLLOUT_BUFFER_DATA_DIR, ROLLOUT_BUFFER_TASK_DIR, PYTHON), waits for its /health, then runs the
# training command with the flags slime needs appended (each only if the command does not give it):
#   --rollout-function-path slime_adapter.agent_rollout.generate_rollout
#   --rollout-buffer-url $ROLLOUT_BUFFER_URL   (slime's own flag; slime's parser ignores other spellings)
#   --loss-mask-type $LOSS_MASK_TYPE
# The buffer reads each run's input file itself, so its input roots (--input-root, docs/security.md "Input roots";
# printed at start) are the working directory, the folders of the training command's --prompt-data and
# --eval-prompt-data files and its --hf-checkpoint folder (whose tokenizer the buffer loads), each as
# `--flag value` or `--flag=value`, and any folders in ROLLOUT_BUFFER_INPUT_ROOT.
# The buffer is stopped when training ends, fails or is interrupted; the exit status is training's
# (130 / 143 after SIGINT / SIGTERM, 1 when the buffer does not come up).
#
# The buffer's token (docs/security.md) reaches both sides through the environment:
#   ROLLOUT_BUFFER_AUTH_TOKEN       the token itself, or
#   ROLLOUT_BUFFER_AUTH_TOKEN_FILE  a file whose first line is the token.
# When BUFFER_HOST is not a loopback address and neither is set, a random token is generated into
# $ROLLOUT_BUFFER_DATA_DIR/auth_token (mode 600) and used: the buffer never listens on a network unguarded.
#
# More variables (all optional):
#   LOSS_MASK_TYPE      chat template type for records without tokens  (default qwen)
#   HEALTH_TIMEOUT_S    whole seconds to wait for the buffer's /health  (default 60)
#   STOP_TIMEOUT_S      whole seconds the buffer gets to stop before SIGKILL (default 30)
#   ROLLOUT_BUFFER_LOG  the buffer's output                             (default $ROLLOUT_BUFFER_DATA_DIR/buffer.log)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { sed -n '2,4p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; }

serve_args=()
while (($#)); do
    if [[ "$1" == "--" ]]; then shift; break; fi
    serve_args+=("$1"); shift
done
if (($# == 0)); then usage; exit 2; fi
train=("$@")

# shellcheck source=scripts/run_buffer.sh
source "$SCRIPT_DIR/run_buffer.sh"
LOSS_MASK_TYPE="${LOSS_MASK_TYPE:-qwen}"
HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-60}"
STOP_TIMEOUT_S="${STOP_TIMEOUT_S:-30}"
mkdir -p "$ROLLOUT_BUFFER_DATA_DIR"
ROLLOUT_BUFFER_LOG="${ROLLOUT_BUFFER_LOG:-$ROLLOUT_BUFFER_DATA_DIR/buffer.log}"
export ROLLOUT_BUFFER_URL

input_roots=()
add_root() {  # a folder, made absolute, once
    local dir="$1" root
    if [[ -d "$dir" ]]; then dir="$(cd -- "$dir" && pwd)"; elif [[ "$dir" != /* ]]; then dir="$PWD/$dir"; fi
    for root in "${input_roots[@]}"; do [[ "$root" == "$dir" ]] && return 0; done
    input_roots+=("$dir")
}
add_root "$PWD"
if [[ -n "${ROLLOUT_BUFFER_INPUT_ROOT:-}" ]]; then  # the flags below would override the variable: keep its folders
    IFS=':' read -r -a env_roots <<< "$ROLLOUT_BUFFER_INPUT_ROOT"
    for dir in "${env_roots[@]}"; do [[ -z "$dir" ]] || add_root "$dir"; done
fi
# slime: --prompt-data PATH; --eval-prompt-data PATH or NAME PATH [NAME PATH ...] (a name adds the working dir);
# --hf-checkpoint DIR (the folder itself: the buffer loads the run's tokenizer from it)
i=0
while ((i < ${#train[@]})); do
    arg="${train[i]}"; i=$((i + 1))
    case "$arg" in
        --prompt-data=*|--eval-prompt-data=*) add_root "$(dirname -- "${arg#*=}")" ;;
        --hf-checkpoint=*) add_root "${arg#*=}" ;;
        --prompt-data) if ((i < ${#train[@]})); then add_root "$(dirname -- "${train[i]}")"; i=$((i + 1)); fi ;;
        --hf-checkpoint) if ((i < ${#train[@]})); then add_root "${train[i]}"; i=$((i + 1)); fi ;;
        --eval-prompt-data)
            while ((i < ${#train[@]})) && [[ "${train[i]}" != -* ]]; do
                add_root "$(dirname -- "${train[i]}")"; i=$((i + 1))
            done ;;
    esac
done
for dir in "${input_roots[@]}"; do BUFFER_SERVE+=(--input-root "$dir"); done
echo "run_agent: the buffer's input roots: ${input_roots[*]}" >&2

case "$BUFFER_HOST" in
    127.*|localhost|::1|\[::1\]) loopback=1 ;;
    *) loopback=0 ;;
esac
if ((!loopback)) && [[ -z "${ROLLOUT_BUFFER_AUTH_TOKEN:-}" && -z "${ROLLOUT_BUFFER_AUTH_TOKEN_FILE:-}" ]]; then
    token_file="$ROLLOUT_BUFFER_DATA_DIR/auth_token"
    if [[ ! -s "$token_file" ]]; then
        (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$token_file")
    fi
    export ROLLOUT_BUFFER_AUTH_TOKEN_FILE="$token_file"
    echo "run_agent: the buffer listens on $BUFFER_HOST; its token is in $token_file (send it as" \
         "'Authorization: Bearer <token>'; remote clients need it)" >&2
fi
# the buffer and the trainer's adapter both read these from the environment
if [[ -n "${ROLLOUT_BUFFER_AUTH_TOKEN:-}" ]]; then export ROLLOUT_BUFFER_AUTH_TOKEN; fi
if [[ -n "${ROLLOUT_BUFFER_AUTH_TOKEN_FILE:-}" ]]; then export ROLLOUT_BUFFER_AUTH_TOKEN_FILE; fi

healthy() {
    "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)' \
        "$ROLLOUT_BUFFER_URL" >/dev/null 2>&1
}

buffer_pid=""
train_pid=""

stop_pid() {  # TERM, then KILL after STOP_TIMEOUT_S; reaps the child
    local pid="$1" waited=0
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null && ((waited < STOP_TIMEOUT_S * 5)); do
        sleep 0.2; waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "run_agent: pid $pid did not stop in ${STOP_TIMEOUT_S}s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    trap - EXIT INT TERM
    if [[ -n "$train_pid" ]]; then stop_pid "$train_pid"; fi
    if [[ -n "$buffer_pid" ]]; then
        stop_pid "$buffer_pid"
        echo "run_agent: buffer stopped (log: $ROLLOUT_BUFFER_LOG)" >&2
    fi
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

if healthy; then
    echo "run_agent: something already answers at $ROLLOUT_BUFFER_URL; stop it or choose another BUFFER_PORT" >&2
    exit 1
fi
"${BUFFER_SERVE[@]}" "${serve_args[@]}" >"$ROLLOUT_BUFFER_LOG" 2>&1 &
buffer_pid=$!
deadline=$((SECONDS + HEALTH_TIMEOUT_S))
until healthy; do
    if ! kill -0 "$buffer_pid" 2>/dev/null || ((SECONDS >= deadline)); then
        echo "run_agent: the buffer did not become healthy at $ROLLOUT_BUFFER_URL; last log lines:" >&2
        tail -n 30 "$ROLLOUT_BUFFER_LOG" >&2 || true
        exit 1
    fi
    sleep 0.25
done
echo "run_agent: buffer ready at $ROLLOUT_BUFFER_URL (pid $buffer_pid)" >&2

has_flag() {
    local arg
    for arg in "${train[@]}"; do
        if [[ "$arg" == "$1" || "$arg" == "$1="* ]]; then return 0; fi
    done
    return 1
}
has_flag --rollout-function-path || train+=(--rollout-function-path slime_adapter.agent_rollout.generate_rollout)
has_flag --rollout-buffer-url || train+=(--rollout-buffer-url "$ROLLOUT_BUFFER_URL")
has_flag --loss-mask-type || train+=(--loss-mask-type "$LOSS_MASK_TYPE")

# in the background, so a TERM/INT to this script is handled at once (a foreground child defers traps)
"${train[@]}" &
train_pid=$!
status=0
wait "$train_pid" || status=$?
train_pid=""
exit "$status"
