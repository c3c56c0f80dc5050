#!/usr/bin/env bash
# Multi-turn load with and without prefix caching, one server after the other on this machine:
#   bash docs/results/serving/zen4/multiturn/run.sh [OUT]
# draftwise serve (SmolLM2-135M preset, its Q4_1 file, pld, 2 threads), then `draftwise loadtest --turns 3` at 1 and
# 16 concurrent clients (2 conversations per client, at least 4), 128 tokens per answer, greedy, streaming chat.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../../../../.."
out="${1:-docs/results/serving/zen4/multiturn}"
mkdir -p "$out"
export PATH="$PWD/.venv/bin:$PATH"
for mode in on off; do
    flag=()
    [ "$mode" = off ] && flag=(--no-enable-prefix-caching)
    draftwise serve --model smollm2-135m --method pld --threads 2 --port 8010 "${flag[@]}" > "$out/serve-$mode.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:8010/health > /dev/null && break; sleep 1; done
    draftwise loadtest --url http://127.0.0.1:8010/v1 --model smollm2-135m --sweep 1,16 --per-client 2 --turns 3 \
        --max-tokens 128 --label "prefix caching $mode" --json "$out/prefix-caching-$mode.json"
    curl -s http://127.0.0.1:8010/metrics | grep -E "^draftwise:(prefix_cache|drafting_paused|generation_tokens)" \
        > "$out/metrics-$mode.txt"
    kill "$pid"; wait "$pid" 2> /dev/null
done
draftwise loadtest --no-run --compare "$out/prefix-caching-on.json" "$out/prefix-caching-off.json" | tee "$out/table.txt"
