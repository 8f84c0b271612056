#!/usr/bin/env bash
# Build llamax (llama.cpp, the shim and the extension) with sanitizers into a
# venv of its own and run tests under them.
#
#   tools/sanitize.sh asan   # ASan+UBSan: tests/core and tests/hardening
#   tools/sanitize.sh tsan   # TSan: the thread stress and the batcher (tests/hardening/test_stress.py,
#                            # tests/core/test_batcher.py, tests/core/test_threads.py)
#
# Builds are cached like the normal one (the build key includes the flags):
# the first run of each mode compiles llama.cpp (~8 min on 2 cores).  Reports
# go to $OUT (default /tmp/llamax-sanitize/<mode>); the script prints every
# report and exits 1 if any report has a frame in llamax's own code (csrc/,
# llamax/_core).  Reports wholly inside llama.cpp / CPython are listed for
# the record.  Extra arguments go to pytest.
set -euo pipefail
mode=${1:-asan}; shift || true
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${LLAMAX_CACHE_DIR:-$HOME/.cache/llamax}
out=${OUT:-/tmp/llamax-sanitize/$mode}
venv=$cache/venv-sanitize-$mode
rm -rf "$out"; mkdir -p "$out"
case $mode in
  asan) flags=address,undefined
        pre="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
        # (not the leak cycles: ASan's quarantine holds freed memory, so RSS grows by design)
        tests=("tests/core" "tests/hardening" "--ignore=$root/tests/hardening/test_leaks.py")
        export ASAN_OPTIONS="detect_leaks=0:log_path=$out/asan:halt_on_error=1:abort_on_error=0"
        export UBSAN_OPTIONS="print_stacktrace=1:log_path=$out/ubsan"
        ;;
  tsan) flags=thread
        pre="$(gcc -print-file-name=libtsan.so)"
        tests=("tests/hardening/test_stress.py" "tests/core/test_batcher.py" "tests/core/test_threads.py")
        export TSAN_OPTIONS="log_path=$out/tsan:halt_on_error=0:report_signal_unsafe=0:second_deadlock_stack=1"
        ;;
  *) echo "usage: $0 asan|tsan [pytest args]" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/pip" ]; then rm -rf "$venv"; python3 -m venv "$venv"; fi
echo "[sanitize] building with LLAMAX_SANITIZE=$flags into $venv" >&2
LLAMAX_SANITIZE=$flags "$venv/bin/pip" install -q "$root[test]" >&2
cd "$root/tests/core"   # away from the source tree's llamax/
# TSan needs a fixed memory layout on kernels with high mmap ASLR entropy
runner=()
if [ "$mode" = tsan ] && command -v setarch >/dev/null; then runner=(setarch "$(uname -m)" -R); fi
set +e
LD_PRELOAD="$pre" LLAMAX_SANITIZE_RUN=$mode "${runner[@]}" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    "${tests[@]/#tests/$root/tests}" "$@" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
set -e
shopt -s nullglob
reports=("$out"/asan* "$out"/ubsan* "$out"/tsan*)
ours=0
for r in "${reports[@]}"; do
  echo "=== $r"; cat "$r"
  if grep -qE "csrc/llamax|csrc/batcher|llamax/_core|_core\.cpp" "$r"; then ours=$((ours + 1)); fi
done
echo "[sanitize] pytest exit $rc; ${#reports[@]} report file(s), $ours with llamax frames" >&2
[ "$rc" -eq 0 ] && [ "$ours" -eq 0 ]
