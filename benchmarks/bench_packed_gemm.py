"""llamax's packed-weight kernels against OpenBLAS's SGEMM, one thread, on
all-MiniLM-L6-v2's matrix shapes (csrc/packed_gemm.cpp, patch 0010).

    python3 benchmarks/bench_packed_gemm.py [--isa avx512|avx2] [--seconds 0.5]

C = A * W^T with A the activations (M rows: one short input, one medium,
a batch of 32 short, 32 medium) and W a weight matrix (N x K).  The packed
kernels read W from panels packed once; OpenBLAS (``scipy-openblas32``, set
to one thread, what patch 0005 calls) packs W on every call.  Both run
warm, best of 5 rounds; the numbers are GFLOP/s.  On CPUs with AVX512_BF16
the BF16 kernels (what BF16 weights run: W rounded to bf16 and packed as
such, A rounded to bf16 as it is read, float32 sums) get columns too.
"""
from __future__ import annotations

import argparse

import llamax
from llamax import _core, _sgemm

ROWS = (14, 58, 448, 1856)
SHAPES = ((384, 384), (1536, 384), (384, 1536))  # (N, K): Q/K/V/output, FFN up, FFN down


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="", help="avx512 or avx2 (default: the best this CPU has)")
    ap.add_argument("--seconds", type=float, default=0.5)
    a = ap.parse_args(argv)
    cfg = _core._packed_config(isa=a.isa)
    sgemm = _sgemm.openblas_address()  # the OpenBLAS embedding contexts use, set to one thread
    if not sgemm:
        ap.error(f"no OpenBLAS to compare with: {llamax.sgemm_info().get('reason')}")
    bf16 = cfg["bf16"]
    print(f"kernels: {cfg['isa']}{' (+ BF16)' if bf16 else ''}; OpenBLAS {llamax.sgemm_info().get('core', '')}; "
          "one thread, GFLOP/s\n")
    extra = " BF16 packed | BF16 / OpenBLAS |" if bf16 else ""
    print("| rows | N x K | packed | OpenBLAS | packed / OpenBLAS |" + extra)
    print("|---|---|---|---|---|" + ("---|---|" if bf16 else ""))
    for n, k in SHAPES:
        for m in ROWS:
            r = _core._packed_bench(m, n, k, a.seconds, sgemm)
            line = f"| {m} | {n} x {k} | {r['packed']:.1f} | {r['sgemm']:.1f} | {r['packed'] / r['sgemm']:.2f}x |"
            if bf16:
                b = _core._packed_bench(m, n, k, a.seconds, bf16=True)["packed"]
                line += f" {b:.1f} | {b / r['sgemm']:.2f}x |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
