#!/usr/bin/env bash
# The numerics-sensitive suites on the code paths of an AVX2-only CPU, on any
# x86-64 machine (CI runs it after the README's commands; it needs them first:
# the test extra installed, the model and test data cached).
#
#   tools/test_baseline.sh [pytest options] [tests/...]   default: the suites below
#
# What makes it an AVX2 machine's run:
# - llama.cpp built with LLAMAX_CPU=baseline (AVX2+FMA+F16C: ggml's AVX2
#   kernels; ~4 min on 2 cores the first time, cached under ~/.cache/llamax),
#   in a copy of this checkout under build/baseline (the checkout's own
#   in-place build stays as it is);
# - LLAMAX_PACKED_ISA=avx2: embedding contexts' packed products on the AVX2
#   kernels (they are chosen at run time from the CPU, not the build);
# - OPENBLAS_CORETYPE=Haswell: OpenBLAS's AVX2 kernels for what the packed
#   kernels leave to it.
# PYTHONPATH puts the copy first, so the tests, and the interpreters and
# servers they start, import the baseline build (and the copy's dev helpers,
# tools/llamax_dev).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/build/baseline"

if [ "$(uname -m)" != "x86_64" ]; then
    echo "test_baseline: x86-64 only (the AVX2 kernels)"; exit 0
fi

# The copy: every file git knows of, modified or new (not the ignored builds).
rm -rf "$dest"
mkdir -p "$dest"
(cd "$root" && git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - --ignore-failed-read -cf -) | tar -C "$dest" -xf -

python3 -m pip install -q "Cython>=3.0" "cmake>=3.21" ninja setuptools wheel "pycparser>=2.21"
cd "$dest"
start=$(date +%s)
LLAMAX_CPU=baseline LLAMAX_CYTHON_BUILD_DIR="$dest/build/cython" \
    python3 setup.py -q build_ext --inplace --build-temp "$dest/build/temp" >"$dest/build.log" 2>&1 \
    || { tail -50 "$dest/build.log"; exit 1; }
echo "test_baseline: built in $(( $(date +%s) - start )) s"

export PYTHONPATH="$dest:$dest/tools${PYTHONPATH:+:$PYTHONPATH}"
export LLAMAX_PACKED_ISA=avx2 OPENBLAS_CORETYPE=Haswell
# This copy, built without AVX-512: refuse to go on otherwise.
python3 - "$dest" <<'EOF'
import sys
import llamax
from llamax import _core
assert llamax.__file__.startswith(sys.argv[1]), llamax.__file__
info = llamax.system_info()
assert "AVX2 = 1" in info and "AVX512 = 1" not in info, info
assert _core._packed_isas() in ([], ["avx2"]), _core._packed_isas()
print("test_baseline:", info)
EOF

# Options alone (-q, -k ...) go with the default suites; name paths to run others.
paths=0
for a in "$@"; do case "$a" in tests*) paths=1 ;; esac; done
if [ $paths -eq 0 ]; then
    set -- tests/api tests/core tests/server/test_concurrency.py tests/embeddings tests/compat "$@"
fi
# -m "slow or not slow": these suites whole, their slow tests too
python3 -m pytest -p no:cacheprovider -m "slow or not slow" "$@"
