#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model if missing, build,
# and generate text for a prompt (default below, or the first argument).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release
prompt=${1:-"Write a short poem about the history of the Roman Empire."}
./target/release/nanoinfer generate --model models/SmolLM2-135M-Instruct --chat --prompt "$prompt" --max-tokens 128
