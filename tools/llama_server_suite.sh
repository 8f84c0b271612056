#!/usr/bin/env bash
# llama.cpp's server test suite against llamax (or --target llama-server):
# tools/llama_server_suite.py says how. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 tools/llama_server_suite.py "$@"
