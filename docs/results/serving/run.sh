#!/usr/bin/env bash
# Serving under load, one server after the other on this machine: draftwise (ar, pld), vLLM's CPU server and
# llama.cpp's server, each swept over 1, 4 and 16 concurrent clients by `draftwise loadtest` on guidellm's synthetic
# profile (256-token prompts, exactly 128 output tokens) and on Spec-Bench questions (up to 128 tokens, greedy).
#   bash docs/results/serving/run.sh [OUT]
# The anchors start from the commands in $VLLM_SERVER and $LLAMACPP_SERVER (scripts taking the port, then more flags
# for `python -m vllm.entrypoints.openai.api_server` / `python -m llama_cpp.server`; see README.md here); a server
# whose command is unset is left out. SERVERS limits the run to some of "ar pld vllm llamacpp"; DRAFTWISE_FLAGS adds
# flags to the draftwise servers (e.g. "--weights float") and LABEL_SUFFIX to their labels (e.g. " bf16").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
out="${1:-docs/results/serving}"
mkdir -p "$out"
export PATH="$PWD/.venv/bin:$PATH"
levels="${LEVELS:-1,4,16}"
per_client="${PER_CLIENT:-2}"

wait_for() {  # the server's model list (llama.cpp's server has no /health), up to 10 minutes
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null && return 0; sleep 2; done
    echo "server on port $1 did not start" >&2; return 1
}

measure() {  # label port extra-body data...
    local label="$1" port="$2" body="$3"; shift 3
    for data in "$@"; do
        local extra=()
        [ "$data" = synthetic ] && extra=(--data synthetic --prompt-tokens 256)
        [ -n "$body" ] && extra+=(--extra-body "$body")
        draftwise loadtest --url "http://127.0.0.1:$port/v1" --model smollm2-135m --sweep "$levels" \
            --per-client "$per_client" --max-tokens 128 "${extra[@]}" --label "$label" \
            --json "$out/$data-${label// /-}.json" || true
    done
}

run_server() {  # label port extra-body datasets command...
    local label="$1" port="$2" body="$3" datasets="$4"; shift 4
    setsid "$@" > "$out/server-${label// /-}.log" 2>&1 &
    local pid=$!
    if wait_for "$port"; then measure "$label" "$port" "$body" $datasets; fi
    kill -- -"$pid" 2> /dev/null || kill "$pid" 2> /dev/null || true
    sleep 5
}

servers="${SERVERS:-ar pld vllm llamacpp}"
for method in ar pld; do
    [[ " $servers " == *" $method "* ]] || continue
    run_server "draftwise $method${LABEL_SUFFIX:-}" 8200 "" "synthetic spec-bench" \
        draftwise serve --model smollm2-135m --method "$method" --max-batch 16 --port 8200 --log-level warning \
        ${DRAFTWISE_FLAGS:-}
done
if [ -n "${VLLM_SERVER:-}" ] && [[ " $servers " == *" vllm "* ]]; then run_server "vLLM CPU" 8300 "" "synthetic spec-bench" "$VLLM_SERVER" 8300; fi
# llama.cpp's server ignores ignore_eos: a ban on its end-of-turn token (id 2) keeps answers to length.
if [ -n "${LLAMACPP_SERVER:-}" ] && [[ " $servers " == *" llamacpp "* ]]; then
    # Its server stops the answer in progress when another request arrives unless told not to.
    run_server "llama.cpp" 8301 '{"logit_bias": {"2": -100}}' "synthetic" "$LLAMACPP_SERVER" 8301 \
        --interrupt_requests False
fi

for data in synthetic spec-bench; do
    files=("$out/$data"-*.json)
    draftwise loadtest --no-run --compare "${files[@]}" --plot "$out/$data.png" | tee "$out/$data.txt"
done
