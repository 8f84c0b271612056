#!/usr/bin/env bash
# The long hardening runs (not CI; CI runs the same tests with short counts):
#   - thread stress: 8 threads x 250 mixed requests, n_contexts 1 and 4
#   - leak cycles at the issue's counts: 200 model loads, 2,000 LoRA
#     load/unload, 20,000 control-vector set/clear, 1,000 Llama create/close,
#     10,000 requests (RSS growth after warm-up < 1%)
# Takes about 20 minutes on 2 cores.  Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/tests/core"   # away from the source tree's llamax/
LLAMAX_STRESS_REQUESTS=${LLAMAX_STRESS_REQUESTS:-250} \
    python3 -m pytest -q -s -p no:cacheprovider "$root/tests/hardening/test_stress.py" "$@"
LLAMAX_LEAK_SCALE=${LLAMAX_LEAK_SCALE:-1} \
    python3 -m pytest -q -s -p no:cacheprovider "$root/tests/hardening/test_leaks.py" "$@"
