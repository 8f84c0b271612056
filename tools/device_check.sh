#!/usr/bin/env bash
# The CUDA device check: build llamax for an H200 (sm_90) from the carried
# llama.cpp tree, run tests/core and tests/api with every layer offloaded,
# and benchmark against llama-bench / llama-batched-bench built from the same
# tree.  Written for the workplace's device tool (a bare H200 machine with
# 16 cores, nvcc, CMake, ninja, Cython and Python 3.12 with numpy and jinja2,
# and no network), usable on any Linux machine with an NVIDIA GPU.
#
# Here, first (packs .devcheck/, git-ignored; see tools/device_prepare.py):
#     python3 tools/device_prepare.py
# Then two calls on one warm machine, the second right after the first (the
# model is 94 MiB and one call carries at most 64 MiB, so each carries half):
#     bash tools/device_check.sh build   carry: .devcheck/src .devcheck/model1  (~6 min)
#     bash tools/device_check.sh test    carry: .devcheck/model2                (~6 min)
# or, instead of test, issue #34's benchmark on the GPU (tenants.md/.json):
#     bash tools/device_check.sh tenants carry: .devcheck/model2                (~4 min)
# Each phase writes its log and results under $OUT (the device tool's output
# folder; default .devcheck/out): device_check.log, nvidia-smi.txt,
# tests.xml (JUnit), gpu.md and gpu.json (bench_gpu.py).
#
# "all" runs both phases in one go, for a machine where everything is at
# hand (carry all three folders; over the device tool's 64 MiB).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PHASE=${1:-all}
OUT=${OUT:-$REPO/.devcheck/out}
DC=${LLAMAX_DEVCHECK_DIR:-/tmp/llamax-devcheck}   # survives between calls while the machine is held
mkdir -p "$OUT" "$DC"
LOG=$OUT/device_check.log
log() { echo "[device_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
die() { log "FAILED: $*"; exit 1; }

setup_env() {
    export LLAMAX_BACKEND=cuda
    export LLAMAX_CUDA_ARCHS=${LLAMAX_CUDA_ARCHS:-90-real}
    export LLAMAX_LLAMA_CPP_DIR=$DC/llama.cpp
    export LLAMAX_CACHE_DIR=$DC/cache
    export LLAMAX_BUILD_JOBS=${LLAMAX_BUILD_JOBS:-$(nproc)}
    # the checkout's llamax and dev helpers (tools/llamax_dev): nothing is pip-installed here
    export PYTHONPATH=$REPO:$REPO/tools:$DC/site${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
}

phase_build() {
    log "phase build: $(nproc) cores, $(python3 --version 2>&1), $(nvcc --version | tail -1)"
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed (no driver?)"
    [ -f .devcheck/src/llama.cpp.tar.xz ] || die "no .devcheck/src: run tools/device_prepare.py here and carry .devcheck/src"
    rm -rf "$DC/llama.cpp" && tar -xJf .devcheck/src/llama.cpp.tar.xz -C "$DC" || die "unpacking llama.cpp"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$DC/site" .devcheck/src/*.whl \
        || die "installing the carried wheels"
    if [ -f .devcheck/model1/SmolLM2.part1 ]; then cp .devcheck/model1/SmolLM2.part1 "$DC/"; fi
    setup_env
    local t0=$SECONDS
    # build_ext --inplace: the extension lands in llamax/ of this tree (git-ignored, kept between calls)
    python3 setup.py -q build_ext --inplace -j "$LLAMAX_BUILD_JOBS" > "$OUT/build.txt" 2>&1 \
        || { tail -40 "$OUT/build.txt" | tee -a "$LOG"; die "building llamax with CUDA"; }
    log "llamax built with CUDA in $((SECONDS - t0)) s"
    t0=$SECONDS
    python3 buildsys/build_llama_cpp.py llama-bench llama-batched-bench >> "$OUT/build.txt" 2>&1 \
        || { tail -40 "$OUT/build.txt" | tee -a "$LOG"; die "building llama-bench"; }
    log "llama-bench and llama-batched-bench built in $((SECONDS - t0)) s"
    (cd /tmp && python3 -c "
import llamax
print('supports_gpu_offload:', llamax.supports_gpu_offload())
print('gpu_devices:', llamax.gpu_devices())
print(llamax.system_info())
") 2>&1 | tee -a "$LOG"
    ldd llamax/_core*.so | grep -E "cublas|cudart|libcuda" | tee -a "$LOG"
}

# The model from its two carried pieces (once per machine).
join_model() {
    local model=$LLAMAX_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$(dirname "$model")"
    if [ ! -f "$model" ]; then
        [ -f "$DC/SmolLM2.part1" ] && [ -f .devcheck/model2/SmolLM2.part2 ] \
            || die "the model's pieces: part1 comes with the build phase (.devcheck/model1), part2 with this one (.devcheck/model2)"
        cat "$DC/SmolLM2.part1" .devcheck/model2/SmolLM2.part2 > "$model.part"
        want=$(python3 -c "import json; print(json.load(open('.devcheck/model2/model.json'))['sha256'])")
        got=$(sha256sum "$model.part" | cut -d' ' -f1)
        [ "$want" = "$got" ] || die "the joined model's sha256 is $got, expected $want"
        mv "$model.part" "$model"
    fi
    log "model ok: $model"
}

phase_test() {
    setup_env
    ls llamax/_core*.so > /dev/null 2>&1 || die "no built extension: run the build phase first, on the same machine"
    join_model
    export LLAMAX_N_GPU_LAYERS=-1 LLAMAX_EXPECT_GPU=1
    local workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n "${LLAMAX_DEVCHECK_WORKERS:-6}")
    local t0=$SECONDS
    # Not run here: the tokenizer suites (CPU-only code, and their vocabulary
    # files don't travel) and the type-stub check (mypy isn't on the image).
    # Other packages' deprecation warnings (the image's newer numpy/pytest)
    # are not errors here.
    timeout "${LLAMAX_DEVCHECK_TEST_TIMEOUT:-330}" python3 -m pytest tests/core tests/api -q -p no:cacheprovider \
        "${workers[@]}" \
        --ignore=tests/core/test_tokenize.py --ignore=tests/core/test_tokenize_long.py \
        --ignore=tests/core/test_stubs.py --ignore=tests/core/test_fetch.py \
        -W ignore::DeprecationWarning -W ignore::PendingDeprecationWarning \
        --junitxml="$OUT/tests.xml" > "$OUT/tests.txt" 2>&1
    local rc=$?
    tail -30 "$OUT/tests.txt" | tee -a "$LOG"
    log "tests: exit $rc in $((SECONDS - t0)) s"
    t0=$SECONDS
    timeout "${LLAMAX_DEVCHECK_BENCH_TIMEOUT:-200}" python3 benchmarks/bench_gpu.py --runs 3 --threads 8 \
        --out "$OUT" 2>&1 | tail -30 | tee -a "$LOG"
    log "benchmark: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
    return $rc
}

# Issue #34's noisy neighbour on the GPU (benchmarks/bench_tenants.py, the
# tenants server only, every layer offloaded): where a batch's extra row and
# a newcomer's prompt cost next to nothing, unlike on 2 CPU cores.
phase_tenants() {
    setup_env
    ls llamax/_core*.so > /dev/null 2>&1 || die "no built extension: run the build phase first, on the same machine"
    join_model
    export LLAMAX_N_GPU_LAYERS=-1
    local t0=$SECONDS
    timeout "${LLAMAX_DEVCHECK_TENANTS_TIMEOUT:-420}" python3 benchmarks/bench_tenants.py --servers tenants \
        --threads 4 --rounds "${LLAMAX_DEVCHECK_TENANTS_ROUNDS:-4}" --window 6 --per-round 8 --out "$OUT" \
        > "$OUT/tenants.txt" 2>&1
    local rc=$?
    tail -20 "$OUT/tenants.txt" | tee -a "$LOG"
    log "tenants benchmark: exit $rc in $((SECONDS - t0)) s"
    return $rc
}

case "$PHASE" in
    build) phase_build ;;
    test) phase_test ;;
    tenants) phase_tenants ;;
    all) phase_build && phase_test ;;
    *) echo "usage: $0 build|test|tenants|all" >&2; exit 2 ;;
esac
