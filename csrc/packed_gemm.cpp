// Packed-weight matrix products for embedding contexts: see packed_gemm.h.
#include "packed_gemm.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define LLAMAX_PACKED_X86 1
#include <immintrin.h>
#endif

namespace llamax {
namespace packed {

namespace {

// A kernel adds A[mr x K] * panel (K x nr) to (or stores it in) C[mr x nr],
// `cols` of whose columns are real (the rest of a last panel is padding),
// then adds `bias` (the panel's nr entries; nullptr: none) to each row: the
// same two roundings as a product followed by ggml's ADD of the bias.
using Kernel = void (*)(int K, const float * A, long lda, const float * B, float * C, long ldc, int cols, bool add,
                        const float * bias);

struct Kernels {
    const char * name;
    int nr;             // panel width (output columns)
    int mr;             // rows per kernel call
    int max_rows;       // inputs with more rows are left to OpenBLAS/ggml
    int kc;             // K block (K <= kc + kc / 3: one block)
    Kernel k[13];       // k[r]: r rows, 1 <= r <= mr
};

// The BF16 kernels (BF16 weights, on CPUs with AVX512_BF16): like Kernel,
// over KP pairs of bf16 (two k each, packed in 32 bits) of A and of the
// panel, summed in float32 by the CPU's bf16 dot-product instruction.
using KernelBf16 = void (*)(int KP, const uint32_t * A, long lda, const uint32_t * B, float * C, long ldc, int cols,
                            bool add, const float * bias);

constexpr int kBf16Rows = 12;  // rows per BF16 kernel call (multiply_bf16's strip holds this many)

struct KernelsBf16 {
    const char * name;
    int nr;
    int mr;  // kBf16Rows
    KernelBf16 k[kBf16Rows + 1];
};

#ifdef LLAMAX_PACKED_X86

// Stores (adds, when `add`) MR rows of 32 accumulated columns, `cols` of
// them real, into C, then adds `bias` (nullptr: none).
template <int MR>
__attribute__((target("avx512f"), always_inline)) inline void store_avx512(const __m512 * c0, const __m512 * c1,
                                                                            float * C, long ldc, int cols, bool add,
                                                                            const float * bias) {
    const __mmask16 m0 = cols >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? (__mmask16) 0xFFFF
                         : cols <= 16 ? (__mmask16) 0
                                      : (__mmask16) ((1u << (cols - 16)) - 1);
    const __m512 bias0 = bias != nullptr ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 bias1 = bias != nullptr ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
        float * c = C + i * ldc;
        __m512 r0 = c0[i];
        __m512 r1 = c1[i];
        if (add) {
            r0 = _mm512_add_ps(r0, _mm512_maskz_loadu_ps(m0, c));
            r1 = _mm512_add_ps(r1, _mm512_maskz_loadu_ps(m1, c + 16));
        }
        if (bias != nullptr) {
            r0 = _mm512_add_ps(r0, bias0);
            r1 = _mm512_add_ps(r1, bias1);
        }
        _mm512_mask_storeu_ps(c, m0, r0);
        _mm512_mask_storeu_ps(c + 16, m1, r1);
    }
}

// AVX-512: 2 vectors of 16 columns by up to 12 rows (24 accumulators).
template <int MR>
__attribute__((target("avx512f,fma"))) void kernel_avx512(int K, const float * A, long lda, const float * B, float * C,
                                                          long ldc, int cols, bool add, const float * bias) {
    __m512 c0[MR];
    __m512 c1[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
        c0[i] = _mm512_setzero_ps();
        c1[i] = _mm512_setzero_ps();
    }
    for (int k = 0; k < K; k++) {
        const __m512 b0 = _mm512_load_ps(B + (long) k * 32);
        const __m512 b1 = _mm512_load_ps(B + (long) k * 32 + 16);
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            const __m512 a = _mm512_set1_ps(A[i * lda + k]);
            c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
            c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
        }
    }
    store_avx512<MR>(c0, c1, C, ldc, cols, add, bias);
}

// AVX512_BF16: the AVX-512 kernel's shape over pairs of k, each step one
// bf16 dot product (a[k] * b[k] + a[k+1] * b[k+1] added in float32).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void kernel_bf16(int KP, const uint32_t * A, long lda,
                                                                          const uint32_t * B, float * C, long ldc,
                                                                          int cols, bool add, const float * bias) {
    __m512 c0[MR];
    __m512 c1[MR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
        c0[i] = _mm512_setzero_ps();
        c1[i] = _mm512_setzero_ps();
    }
    for (int k = 0; k < KP; k++) {
        const __m512bh b0 = (__m512bh) _mm512_load_si512(B + (long) k * 32);
        const __m512bh b1 = (__m512bh) _mm512_load_si512(B + (long) k * 32 + 16);
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            const __m512bh a = (__m512bh) _mm512_set1_epi32((int) A[i * lda + k]);
            c0[i] = _mm512_dpbf16_ps(c0[i], a, b0);
            c1[i] = _mm512_dpbf16_ps(c1[i], a, b1);
        }
    }
    store_avx512<MR>(c0, c1, C, ldc, cols, add, bias);
}

// Rounds `rows` rows of `kl` floats (row r at A + r * lda) to bf16, to
// nearest even, into rows of `kp` pairs (dst + r * kp), an odd tail's pair
// completed with 0.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void to_bf16_pairs(int rows, int kl, const float * A, long lda,
                                                                            uint32_t * dst, int kp) {
    for (int r = 0; r < rows; r++) {
        const float * a = A + (long) r * lda;
        uint16_t * d = reinterpret_cast<uint16_t *>(dst + (long) r * kp);
        int k = 0;
        for (; k + 32 <= kl; k += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(a + k));
            _mm512_storeu_si512(d + k, (__m512i) v);
        }
        if (k < kl) {
            const int n = kl - k;  // 1..31 floats, 2 * kp - k >= n bf16 to write
            const __mmask16 lo = n >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << n) - 1);
            const __mmask16 hi = n <= 16 ? (__mmask16) 0 : (__mmask16) ((1u << (n - 16)) - 1);
            const __m512bh v =
                _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, a + k + 16), _mm512_maskz_loadu_ps(lo, a + k));
            const int w = 2 * kp - k;  // n rounded up to even
            _mm512_mask_storeu_epi16(d + k, (__mmask32) ((w >= 32) ? 0xFFFFFFFFu : ((1u << w) - 1)), (__m512i) v);
        }
    }
}

// AVX2 + FMA: 2 vectors of 8 columns by up to 6 rows (12 accumulators).
template <int MR>
__attribute__((target("avx2,fma"))) void kernel_avx2(int K, const float * A, long lda, const float * B, float * C,
                                                     long ldc, int cols, bool add, const float * bias) {
    __m256 c0[MR];
    __m256 c1[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        c0[i] = _mm256_setzero_ps();
        c1[i] = _mm256_setzero_ps();
    }
    // one pointer per row, set once (recomputing row i's address from lda
    // took two LEAs per k), and k unrolled by 4: the loop's bookkeeping
    // had crowded the FMAs out of the front end on Zen 3
    const float * a_row[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        a_row[i] = A + i * lda;
    }
#pragma GCC unroll 4
    for (int k = 0; k < K; k++) {
        const __m256 b0 = _mm256_load_ps(B + (long) k * 16);
        const __m256 b1 = _mm256_load_ps(B + (long) k * 16 + 8);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m256 a = _mm256_broadcast_ss(a_row[i] + k);
            c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
        }
    }
    alignas(32) static const int32_t ramp[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const __m256i n = _mm256_set1_epi32(cols);
    const __m256i m0 = _mm256_cmpgt_epi32(n, _mm256_load_si256((const __m256i *) ramp));
    const __m256i m1 = _mm256_cmpgt_epi32(n, _mm256_load_si256((const __m256i *) (ramp + 8)));
    const __m256 bias0 = bias != nullptr ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    const __m256 bias1 = bias != nullptr ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
    // masked loads and stores only for a last, partial panel (they are slow
    // on AMD's cores, microcoded stores)
    const bool full = cols >= 16;
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        float * c = C + i * ldc;
        __m256 r0 = c0[i];
        __m256 r1 = c1[i];
        if (add) {
            r0 = _mm256_add_ps(r0, full ? _mm256_loadu_ps(c) : _mm256_maskload_ps(c, m0));
            r1 = _mm256_add_ps(r1, full ? _mm256_loadu_ps(c + 8) : _mm256_maskload_ps(c + 8, m1));
        }
        if (bias != nullptr) {
            r0 = _mm256_add_ps(r0, bias0);
            r1 = _mm256_add_ps(r1, bias1);
        }
        if (full) {
            _mm256_storeu_ps(c, r0);
            _mm256_storeu_ps(c + 8, r1);
        } else {
            _mm256_maskstore_ps(c, m0, r0);
            _mm256_maskstore_ps(c + 8, m1, r1);
        }
    }
}

template <int... I>
Kernels make_avx512(std::integer_sequence<int, I...>) {
    // Measured against OpenBLAS (one thread, 384/1536-wide weights): 1.3-1.95x
    // at 14-58 rows, 1.03-1.12x at 448-1856: no row limit.
    return {"avx512", 32, 12, std::numeric_limits<int>::max(), 384, {nullptr, kernel_avx512<I + 1>...}};
}

template <int... I>
Kernels make_avx2(std::integer_sequence<int, I...>) {
    // Measured against OpenBLAS's Haswell kernels (one thread, the shapes of
    // benchmarks/bench_packed_gemm.py, on an AVX-512 EPYC held to AVX2):
    // 1.7-1.8x at 14 rows, 1.2-1.3x at 58, 1.0-1.1x at 448-1856 since the
    // row blocks went outermost (K-blocked products were 0.75-0.87x at 1856
    // rows before): no row limit, and so no row whose bits depend on the
    // batch's size.
    return {"avx2", 16, 6, std::numeric_limits<int>::max(), 384, {nullptr, kernel_avx2<I + 1>...}};
}

template <int... I>
KernelsBf16 make_bf16(std::integer_sequence<int, I...>) {
    return {"avx512bf16", 32, kBf16Rows, {nullptr, kernel_bf16<I + 1>...}};
}

const Kernels kAvx512 = make_avx512(std::make_integer_sequence<int, 12>{});
const Kernels kAvx2 = make_avx2(std::make_integer_sequence<int, 6>{});
const KernelsBf16 kBf16 = make_bf16(std::make_integer_sequence<int, kBf16Rows>{});

// The BF16 kernels that go with the float kernels `ks`, if this CPU runs
// them (nullptr: BF16 weights are widened to float panels like F16 ones).
// They share the AVX-512 kernels' panel width and row blocking.
const KernelsBf16 * bf16_for(const Kernels * ks) {
    __builtin_cpu_init();
    if (ks == &kAvx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16")) {
        return &kBf16;
    }
    return nullptr;
}

// LLAMAX_PACKED_ISA=avx2 caps the kernels at the AVX2 set, as an AVX2-only
// CPU has them (CI runs its baseline build that way on AVX-512 machines);
// llamax._sgemm refuses other values with a typed error.
bool capped_at_avx2() {
    const char * cap = std::getenv("LLAMAX_PACKED_ISA");
    return cap != nullptr && std::strcmp(cap, "avx2") == 0;
}

const Kernels * best_kernels() {
    __builtin_cpu_init();
    if (!capped_at_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) {
        return &kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return &kAvx2;
    }
    return nullptr;
}

#else

const Kernels * best_kernels() { return nullptr; }
const KernelsBf16 * bf16_for(const Kernels *) { return nullptr; }
void to_bf16_pairs(int, int, const float *, long, uint32_t *, int) {}

#endif  // LLAMAX_PACKED_X86

std::atomic<const Kernels *> g_kernels{best_kernels()};
std::atomic<bool> g_enabled{true};
std::atomic<bool> g_bf16{true};  // BF16 weights on the BF16 kernels where the CPU has them
std::atomic<size_t> g_budget{size_t(2) << 30};
std::atomic<uint64_t> g_fused{0};  // products computed with their bias ADD

struct AlignedFree {
    void operator()(float * p) const { std::free(p); }
};
using Panels = std::unique_ptr<float, AlignedFree>;

float * alloc_floats(size_t n) {
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    return static_cast<float *>(std::aligned_alloc(64, bytes == 0 ? 64 : bytes));
}

// Packs rows [0, N) of a K-wide weight matrix, row r at `row(r)` converted to
// float, into panels of nr columns: panel p holds W[p*nr + j][k] at k*nr + j.
template <typename RowFn>
Panels pack(int N, int K, int nr, RowFn && row) {
    const int np = (N + nr - 1) / nr;
    Panels out(alloc_floats((size_t) np * K * nr));
    if (!out) {
        return out;
    }
    std::vector<float> tmp((size_t) K);
    float * P = out.get();
    for (int p = 0; p < np; p++) {
        float * panel = P + (size_t) p * K * nr;
        for (int j = 0; j < nr; j++) {
            const int n = p * nr + j;
            if (n < N) {
                const float * w = row(n, tmp.data());
                for (int k = 0; k < K; k++) {
                    panel[(size_t) k * nr + j] = w[k];
                }
            } else {
                for (int k = 0; k < K; k++) {
                    panel[(size_t) k * nr + j] = 0.0f;
                }
            }
        }
    }
    return out;
}

// C[M x columns of panels p0..p1) = A[M x K] * W^T (+ bias) from packed
// panels.  K is cut into blocks of kc (so a panel block stays in L2) and M
// into blocks of mc (so A's block does); for each (column, row) the sum
// runs over k in the same order whatever M is.
void multiply(const Kernels & ks, int M, int N, int K, const float * A, long lda, const float * P, float * C, long ldc,
              int p0, int p1, const float * bias) {
    const int nr = ks.nr;
    const int kc = K <= ks.kc + ks.kc / 3 ? K : ks.kc;
    const int mc = 192;
    // rows outermost: a block's C (mc x the panels) stays in L2 while the K
    // blocks add to it, instead of all of C going by once per K block
    for (int m0 = 0; m0 < M; m0 += mc) {
        const int m1 = std::min(M, m0 + mc);
        for (int kb = 0; kb < K; kb += kc) {
            const int kl = std::min(kc, K - kb);
            for (int p = p0; p < p1; p++) {
                const float * B = P + (size_t) p * K * nr + (size_t) kb * nr;
                const int cols = std::min(nr, N - p * nr);
                const float * b = (bias != nullptr && kb + kl == K) ? bias + (size_t) p * nr : nullptr;
                for (int i = m0; i < m1; i += ks.mr) {
                    const int rows = std::min(ks.mr, m1 - i);
                    ks.k[rows](kl, A + (size_t) i * lda + kb, lda, B, C + (size_t) i * ldc + (size_t) p * nr, ldc, cols,
                               kb > 0, b);
                }
            }
        }
    }
}

// Rows [0, M) of A (M rows of K floats) rounded to bf16 against BF16
// panels, as multiply() does for float panels: KP = ceil(K / 2) pairs, K cut
// into blocks of kc (even), and for each strip of mr rows the strip is
// rounded into a small buffer that every panel of a group of [p0, p1) reads.
void multiply_bf16(const KernelsBf16 & ks, int M, int N, int K, const float * A, long lda, const uint32_t * P,
                   float * C, long ldc, int p0, int p1, const float * bias) {
    constexpr int kMaxPairs = 512;
    const int nr = ks.nr;
    const int KP = (K + 1) / 2;
    const int kc = K <= 2 * kMaxPairs ? K : 768;
    alignas(64) uint32_t strip[kBf16Rows * kMaxPairs];  // 24 KiB
    for (int kb = 0; kb < K; kb += kc) {
        const int kl = std::min(kc, K - kb);
        const int kp = (kl + 1) / 2;
        // panels in groups of at most 512 KiB (of this K block), which stay
        // in L2 while every strip of rows goes by
        const int group = std::max(1, (int) ((size_t(512) << 10) / ((size_t) kp * nr * sizeof(uint32_t))));
        for (int g0 = p0; g0 < p1; g0 += group) {
            const int g1 = std::min(p1, g0 + group);
            for (int i = 0; i < M; i += ks.mr) {
                const int rows = std::min(ks.mr, M - i);
                to_bf16_pairs(rows, kl, A + (size_t) i * lda + kb, lda, strip, kp);
                for (int p = g0; p < g1; p++) {
                    const uint32_t * B = P + (size_t) p * KP * nr + (size_t) (kb / 2) * nr;
                    const int cols = std::min(nr, N - p * nr);
                    const float * b = (bias != nullptr && kb + kl == K) ? bias + (size_t) p * nr : nullptr;
                    ks.k[rows](kp, strip, kp, B, C + (size_t) i * ldc + (size_t) p * nr, ldc, cols, kb > 0, b);
                }
            }
        }
    }
}

// Thread ith of nth's share of a product with np panels of output columns
// and M rows: calls part(r0, r1, p0, p1) for rows [r0, r1) of panels
// [p0, p1).  Work items are (panel, row part) pairs, rows split only when
// there are too few panels to keep every thread busy (a 384-wide output is
// 12 panels of 32: more than 6 threads would otherwise idle).  Rows split
// on whole kernel heights, and a row's bits do not depend on where it falls.
template <typename Part> void share(int M, int np, int mr, int ith, int nth, Part && part) {
    const int row_blocks = (M + mr - 1) / mr;
    const int parts = np >= 2 * nth ? 1 : std::max(1, std::min(row_blocks, (2 * nth + np - 1) / np));
    const int64_t items = (int64_t) np * parts;
    const int64_t i0 = items * ith / nth;
    const int64_t i1 = items * (ith + 1) / nth;
    if (parts == 1) {
        if (i0 < i1) {
            part(0, M, (int) i0, (int) i1);
        }
        return;
    }
    for (int64_t it = i0; it < i1; it++) {
        const int p = (int) (it / parts);
        const int r = (int) (it % parts);
        const int r0 = (int) ((int64_t) row_blocks * r / parts) * mr;
        const int r1 = std::min(M, (int) ((int64_t) row_blocks * (r + 1) / parts) * mr);
        if (r0 < r1) {
            part(r0, r1, p, p + 1);
        }
    }
}

// Thread ith of nth's share of C = A * W^T (+ bias) from float panels.
void multiply_share(const Kernels & ks, int M, int N, int K, const float * A, long lda, const float * P, float * C,
                    long ldc, const float * bias, int ith, int nth) {
    share(M, (N + ks.nr - 1) / ks.nr, ks.mr, ith, nth, [&](int r0, int r1, int p0, int p1) {
        multiply(ks, r1 - r0, N, K, A + (size_t) r0 * lda, lda, P, C + (size_t) r0 * ldc, ldc, p0, p1, bias);
    });
}

// The same from BF16 panels.
void multiply_share_bf16(const KernelsBf16 & ks, int M, int N, int K, const float * A, long lda, const uint32_t * P,
                         float * C, long ldc, const float * bias, int ith, int nth) {
    share(M, (N + ks.nr - 1) / ks.nr, ks.mr, ith, nth, [&](int r0, int r1, int p0, int p1) {
        multiply_bf16(ks, r1 - r0, N, K, A + (size_t) r0 * lda, lda, P, C + (size_t) r0 * ldc, ldc, p0, p1, bias);
    });
}

// Packs rows [0, N) of a K-wide BF16 weight matrix (row r's bits at
// `row(r)`) into panels of nr columns by ceil(K / 2) pairs: panel p holds
// W[p*nr + j][2q] (low half) and W[p*nr + j][2q + 1] at q*nr + j.
template <typename RowFn>
Panels pack_bf16(int N, int K, int nr, RowFn && row) {
    const int np = (N + nr - 1) / nr;
    const int KP = (K + 1) / 2;
    Panels out(alloc_floats((size_t) np * KP * nr));  // 4 bytes a pair
    if (!out) {
        return out;
    }
    uint32_t * P = reinterpret_cast<uint32_t *>(out.get());
    for (int p = 0; p < np; p++) {
        uint32_t * panel = P + (size_t) p * KP * nr;
        for (int j = 0; j < nr; j++) {
            const int n = p * nr + j;
            const uint16_t * w = n < N ? row(n) : nullptr;
            for (int q = 0; q < KP; q++) {
                const uint32_t lo = w != nullptr ? w[2 * q] : 0;
                const uint32_t hi = (w != nullptr && 2 * q + 1 < K) ? w[2 * q + 1] : 0;
                panel[(size_t) q * nr + j] = lo | (hi << 16);
            }
        }
    }
    return out;
}

}  // namespace

// The packed copy of one weight: float panels for the float kernels, or
// BF16 panels for the BF16 ones.
struct Packed {
    const float * f32 = nullptr;
    const uint32_t * bf16 = nullptr;
    explicit operator bool() const { return f32 != nullptr || bf16 != nullptr; }
};

class Store {
  public:
    // The kernels this store packs for, fixed when it is made: every thread
    // of every product splits the columns by the same panel width.  `bf16`
    // (nullptr: none) multiplies BF16 weights; without it they are widened
    // to float panels.
    Store(const Kernels * ks, const KernelsBf16 * bf16) : ks_(ks), bf16_(bf16) {}
    const Kernels * kernels() const { return ks_; }
    const KernelsBf16 * bf16_kernels() const { return bf16_; }

    // The panels of weight `w` for this store's kernels, packing them on
    // first use (none: not packed, the store is at its budget or out of
    // memory).  Every caller asking for the same weight gets the same answer.
    Packed get(const ggml_tensor * w) {
        const Key key{w->data, w->ne[0], w->ne[1], w->nb[1], (int) w->type};
        {
            std::shared_lock<std::shared_mutex> lock(mu_);
            auto it = map_.find(key);
            if (it != map_.end()) {
                return as_packed(key, it->second);
            }
        }
        std::unique_lock<std::shared_mutex> lock(mu_);
        auto it = map_.find(key);
        if (it != map_.end()) {
            return as_packed(key, it->second);
        }
        if (broken_) {
            return {};
        }
        // This runs on ggml's compute threads, under C frames: nothing may
        // leave it as an exception.  An allocation that fails here (the
        // packed copy, the map's node) turns packing off for this store, so
        // that the other threads of the product get the same "no".
        try {
            return pack_locked(key, w);
        } catch (...) {
            broken_ = true;
            return {};
        }
    }

    size_t bytes() {
        std::shared_lock<std::shared_mutex> lock(mu_);
        return bytes_;
    }

  private:
    struct Key;
    bool as_bf16(int type) const { return type == GGML_TYPE_BF16 && bf16_ != nullptr; }
    Packed as_packed(const Key & key, const Panels & p) const {
        Packed out;
        if (as_bf16(key.type)) {
            out.bf16 = reinterpret_cast<const uint32_t *>(p.get());
        } else {
            out.f32 = p.get();
        }
        return out;
    }

    Packed pack_locked(const Key & key, const ggml_tensor * w) {
        const Kernels & ks = *ks_;
        const int N = (int) w->ne[1];
        const int K = (int) w->ne[0];
        const bool bf16 = as_bf16(w->type);
        const int nr = bf16 ? bf16_->nr : ks.nr;
        const size_t depth = bf16 ? (size_t) (K + 1) / 2 : (size_t) K;  // 4-byte entries per panel column
        const size_t bytes = (size_t) ((N + nr - 1) / nr) * depth * nr * 4;
        Panels panels;
        if (bytes_ + bytes <= budget()) {
            const char * base = static_cast<const char *>(w->data);
            const size_t nb1 = w->nb[1];
            if (bf16) {
                panels = pack_bf16(N, K, nr, [&](int n) { return (const uint16_t *) (base + (size_t) n * nb1); });
            } else if (w->type == GGML_TYPE_F32) {
                panels = pack(N, K, ks.nr, [&](int n, float *) { return (const float *) (base + (size_t) n * nb1); });
            } else {
                const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;
                panels = pack(N, K, ks.nr, [&](int n, float * tmp) {
                    to_float(base + (size_t) n * nb1, tmp, K);
                    return (const float *) tmp;
                });
            }
        }
        // a refusal is remembered too, so that every thread gets it
        const bool packed = panels != nullptr;
        auto it = map_.emplace(key, std::move(panels)).first;
        if (packed) {
            bytes_ += bytes;
        }
        return as_packed(key, it->second);
    }

    struct Key {
        const void * data;
        int64_t ne0, ne1;
        size_t nb1;
        int type;
        bool operator==(const Key & o) const {
            return data == o.data && ne0 == o.ne0 && ne1 == o.ne1 && nb1 == o.nb1 && type == o.type;
        }
    };
    struct KeyHash {
        size_t operator()(const Key & k) const {
            size_t h = std::hash<const void *>()(k.data);
            h ^= std::hash<int64_t>()(k.ne0 * 1000003 + k.ne1) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
            h ^= std::hash<size_t>()(k.nb1 * 31 + (size_t) k.type) + (h << 6) + (h >> 2);
            return h;
        }
    };
    const Kernels * const ks_;
    const KernelsBf16 * const bf16_;
    bool broken_ = false;  // an allocation failed: no more packing
    std::shared_mutex mu_;
    std::unordered_map<Key, Panels, KeyHash> map_;
    size_t bytes_ = 0;
};

namespace {

std::mutex g_stores_mu;
std::unordered_map<const llama_model *, StorePtr> g_stores;

bool fits_int(int64_t v) { return v >= 0 && v < (int64_t) std::numeric_limits<int>::max(); }

// Whether mm = src0 * src1 (+ bias, into out) is a product of model weights
// the kernels take.
bool eligible(const ggml_tensor * mm, const ggml_tensor * bias, const ggml_tensor * out, const Kernels & ks) {
    const ggml_tensor * w = mm->src[0];
    const ggml_tensor * x = mm->src[1];
    if (w == nullptr || x == nullptr || out == nullptr || w->data == nullptr || x->data == nullptr ||
        out->data == nullptr) {
        return false;
    }
    if (bias != nullptr && (bias->type != GGML_TYPE_F32 || bias->data == nullptr || bias->ne[0] != w->ne[1] ||
                            bias->nb[0] != sizeof(float) || ggml_nrows(bias) != 1)) {
        return false;
    }
    const ggml_tensor * dst = out;
    if (!ggml_are_same_shape(mm, out)) {
        return false;
    }
    if (w->type != GGML_TYPE_F32 && w->type != GGML_TYPE_F16 && w->type != GGML_TYPE_BF16) {
        return false;
    }
    // a model's own weights only: they never change while the model lives
    // (an adapter's, a KV cache's or an activation's data can)
    if (w->buffer == nullptr || ggml_backend_buffer_get_usage(w->buffer) != GGML_BACKEND_BUFFER_USAGE_WEIGHTS ||
        w->extra != nullptr) {
        return false;
    }
    if (x->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32) {
        return false;
    }
    if (w->ne[2] != 1 || w->ne[3] != 1 || w->nb[0] != ggml_type_size(w->type) || x->nb[0] != sizeof(float) ||
        dst->nb[0] != sizeof(float)) {
        return false;
    }
    if (x->ne[0] != w->ne[0] || dst->ne[0] != w->ne[1] || dst->ne[1] != x->ne[1] || dst->ne[2] != x->ne[2] ||
        dst->ne[3] != x->ne[3]) {
        return false;
    }
    if (x->nb[1] % sizeof(float) != 0 || dst->nb[1] % sizeof(float) != 0) {
        return false;
    }
    if (x->ne[1] < 1 || x->ne[1] > ks.max_rows || w->ne[0] < 1 || w->ne[1] < 1) {
        return false;
    }
    return fits_int(w->ne[0]) && fits_int(w->ne[1]) && fits_int(x->ne[1]) && fits_int(x->nb[1] / sizeof(float)) &&
           fits_int(dst->nb[1] / sizeof(float));
}

}  // namespace

const char * isa() {
    const Kernels * ks = g_kernels.load();
    return ks != nullptr ? ks->name : "";
}

namespace {

// The kernel set called `name` if this CPU can run it (nullptr if not).
const Kernels * runnable(const std::string & name) {
#ifdef LLAMAX_PACKED_X86
    const Kernels * best = best_kernels();
    if (name == "avx512" && best == &kAvx512) {
        return &kAvx512;
    }
    if (name == "avx2" && best != nullptr) {  // every AVX-512 CPU here has AVX2
        return &kAvx2;
    }
#else
    (void) name;
#endif
    return nullptr;
}

}  // namespace

std::vector<std::string> runnable_isas() {
    std::vector<std::string> out;
    for (const char * name : {"avx512", "avx2"}) {
        if (runnable(name) != nullptr) {
            out.emplace_back(name);
        }
    }
    return out;
}

bool set_isa(const char * name) {
    const std::string want = name != nullptr ? name : "";
    const Kernels * ks = want.empty() ? best_kernels() : runnable(want);
    if (ks == nullptr && !want.empty()) {
        return false;
    }
    g_kernels.store(ks);
    return true;
}

void set_enabled(bool on) { g_enabled.store(on); }

void set_bf16(bool on) { g_bf16.store(on); }
bool bf16() {
    return g_bf16.load() && bf16_for(g_kernels.load()) != nullptr;
}
bool enabled() { return g_enabled.load() && g_kernels.load() != nullptr; }

uint64_t fused_products() { return g_fused.load(std::memory_order_relaxed); }

void set_budget(size_t bytes) { g_budget.store(bytes); }
size_t budget() { return g_budget.load(); }

StorePtr store_for(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_stores_mu);
    StorePtr & s = g_stores[model];
    if (!s) {
        const Kernels * ks = g_kernels.load();
        s = std::make_shared<Store>(ks, g_bf16.load() ? bf16_for(ks) : nullptr);
    }
    return s;
}

void forget(const llama_model * model) {
    StorePtr drop;  // freed outside the lock
    std::lock_guard<std::mutex> lock(g_stores_mu);
    auto it = g_stores.find(model);
    if (it != g_stores.end()) {
        drop = std::move(it->second);
        g_stores.erase(it);
    }
}

size_t packed_bytes(const llama_model * model) {
    StorePtr s;
    {
        std::lock_guard<std::mutex> lock(g_stores_mu);
        auto it = g_stores.find(model);
        if (it == g_stores.end()) {
            return 0;
        }
        s = it->second;
    }
    return s->bytes();
}

bool mul_mat_hook(void * data, const ggml_tensor * mm, const ggml_tensor * bias, ggml_tensor * out, int ith, int nth) {
    Store * store = static_cast<Store *>(data);
    const Kernels * ks = store != nullptr ? store->kernels() : nullptr;
    if (ks == nullptr || mm == nullptr || !eligible(mm, bias, out, *ks)) {
        return false;
    }
    const ggml_tensor * w = mm->src[0];
    const ggml_tensor * x = mm->src[1];
    const ggml_tensor * dst = out;
    const float * b = bias != nullptr ? static_cast<const float *>(bias->data) : nullptr;
    const Packed P = store->get(w);
    if (!P) {
        return false;
    }
    const int N = (int) w->ne[1];
    const int K = (int) w->ne[0];
    const int M = (int) x->ne[1];
    if (bias != nullptr && ith == 0) {
        g_fused.fetch_add(1, std::memory_order_relaxed);
    }
    const long lda = (long) (x->nb[1] / sizeof(float));
    const long ldc = (long) (dst->nb[1] / sizeof(float));
    for (int64_t i3 = 0; i3 < x->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < x->ne[2]; i2++) {
            const float * A = (const float *) ((const char *) x->data + i2 * x->nb[2] + i3 * x->nb[3]);
            float * C = (float *) ((char *) dst->data + i2 * dst->nb[2] + i3 * dst->nb[3]);
            if (P.bf16 != nullptr) {
                multiply_share_bf16(*store->bf16_kernels(), M, N, K, A, lda, P.bf16, C, ldc, b, ith, nth);
            } else {
                multiply_share(*ks, M, N, K, A, lda, P.f32, C, ldc, b, ith, nth);
            }
        }
    }
    return true;
}

namespace {

// Rounds x to the nearest bf16 (ties to even; no NaNs here).
uint16_t bf16_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t) (u >> 16);
}

float bf16_value(uint16_t bits) {
    const uint32_t u = (uint32_t) bits << 16;
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

// A random product for the self-check and the benchmark: activations A
// (M rows of lda floats), weights W (N x K), a bias row, W packed for ks,
// or, given `bf16` kernels, W rounded to bf16 (W holds the rounded values)
// and packed for them.
struct Problem {
    std::vector<float> A, W, bias;
    Panels P;
    Problem(const Kernels & ks, const KernelsBf16 * bf16, int M, int N, int K, long lda, uint32_t seed) :
        A((size_t) M * lda), W((size_t) N * K), bias((size_t) N) {
        std::mt19937 rng(seed);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (auto * v : {&A, &W, &bias}) {
            for (auto & x : *v) {
                x = u(rng);
            }
        }
        if (bf16 != nullptr) {
            std::vector<uint16_t> bits(W.size());
            for (size_t i = 0; i < W.size(); i++) {
                bits[i] = bf16_bits(W[i]);
                W[i] = bf16_value(bits[i]);
            }
            P = pack_bf16(N, K, bf16->nr, [&](int n) { return (const uint16_t *) (bits.data() + (size_t) n * K); });
        } else {
            P = pack(N, K, ks.nr, [&](int n, float *) { return (const float *) (W.data() + (size_t) n * K); });
        }
    }

    // C = A * W^T (+ bias) for rows [0, M) of A, thread ith of nth's share
    // (nth = 0: all of it, unshared) with the kernels the problem was packed for.
    void multiply_into(const Kernels & ks, const KernelsBf16 * bf16, int M, int N, int K, const float * a, long lda,
                       float * C, long ldc, const float * b, int ith, int nth) const {
        if (bf16 != nullptr) {
            const uint32_t * Pb = reinterpret_cast<const uint32_t *>(P.get());
            if (nth == 0) {
                multiply_bf16(*bf16, M, N, K, a, lda, Pb, C, ldc, 0, (N + bf16->nr - 1) / bf16->nr, b);
            } else {
                multiply_share_bf16(*bf16, M, N, K, a, lda, Pb, C, ldc, b, ith, nth);
            }
        } else if (nth == 0) {
            multiply(ks, M, N, K, a, lda, P.get(), C, ldc, 0, (N + ks.nr - 1) / ks.nr, b);
        } else {
            multiply_share(ks, M, N, K, a, lda, P.get(), C, ldc, b, ith, nth);
        }
    }
};

// The kernels a self-check or benchmark runs: false if `bf16` is asked for
// and this CPU (or the process's kernel choice) has no BF16 kernels.
bool test_kernels(bool bf16, const Kernels ** ks, const KernelsBf16 ** kb) {
    *ks = g_kernels.load();
    *kb = bf16 ? bf16_for(*ks) : nullptr;
    return *ks != nullptr && (!bf16 || *kb != nullptr);
}

}  // namespace

double self_check(int M, int N, int K, int threads, uint32_t seed, bool with_bias, bool bf16) {
    const Kernels * ks;
    const KernelsBf16 * kb;
    if (!test_kernels(bf16, &ks, &kb) || M < 1 || N < 1 || K < 1 || threads < 1) {
        return -1.0;
    }
    const long lda = K + 3;  // strided rows, as ggml's views can be
    const long ldc = N + 5;
    const Problem pr(*ks, kb, M, N, K, lda, seed);
    if (!pr.P) {
        return -1.0;
    }
    const std::vector<float> & A = pr.A;
    const std::vector<float> & W = pr.W;
    const std::vector<float> & bias = pr.bias;
    std::vector<float> C((size_t) M * ldc, 7.0f);
    const float * b = with_bias ? bias.data() : nullptr;
    for (int t = 0; t < threads; t++) {  // every thread's share, as the hook splits them
        pr.multiply_into(*ks, kb, M, N, K, A.data(), lda, C.data(), ldc, b, t, threads);
    }
    // a row's result does not depend on the rows multiplied with it: the
    // last rows alone (another kernel height, another start) give the same bits
    const int tail = std::min(M, 3);
    std::vector<float> T((size_t) tail * ldc, 7.0f);
    pr.multiply_into(*ks, kb, tail, N, K, A.data() + (size_t) (M - tail) * lda, lda, T.data(), ldc, b, 0, 0);
    for (int i = 0; i < tail; i++) {
        if (std::memcmp(T.data() + (size_t) i * ldc, C.data() + (size_t) (M - tail + i) * ldc, N * sizeof(float)) != 0) {
            return std::numeric_limits<double>::infinity();
        }
    }
    // the reference: in double, from the activations as the kernels see them
    // (rounded to bf16 for the BF16 kernels; W already is)
    std::vector<double> a((size_t) K);
    double worst = 0.0;
    double scale = 0.0;
    for (int i = 0; i < M; i++) {
        for (int k = 0; k < K; k++) {
            const float x = A[(size_t) i * lda + k];
            a[k] = kb != nullptr ? (double) bf16_value(bf16_bits(x)) : (double) x;
        }
        for (int n = 0; n < N; n++) {
            double ref = 0.0;
            for (int k = 0; k < K; k++) {
                ref += a[k] * (double) W[(size_t) n * K + k];
            }
            ref += with_bias ? (double) bias[n] : 0.0;
            worst = std::max(worst, std::fabs(ref - (double) C[(size_t) i * ldc + n]));
            scale = std::max(scale, std::fabs(ref));
        }
        for (long n = N; n < ldc; n++) {  // the padding columns of C are untouched
            if (C[(size_t) i * ldc + n] != 7.0f) {
                return std::numeric_limits<double>::infinity();
            }
        }
    }
    return scale > 0.0 ? worst / scale : worst;
}

bool bench(int M, int N, int K, double seconds, SgemmFnRef sgemm, bool bf16, double out[2]) {
    const Kernels * ks;
    const KernelsBf16 * kb;
    out[0] = out[1] = 0.0;
    if (!test_kernels(bf16, &ks, &kb) || M < 1 || N < 1 || K < 1) {
        return false;
    }
    const Problem pr(*ks, kb, M, N, K, K, 1);
    if (!pr.P) {
        return false;
    }
    const std::vector<float> & A = pr.A;
    const std::vector<float> & W = pr.W;
    std::vector<float> C((size_t) M * N);
    using clock = std::chrono::steady_clock;
    auto rate = [&](auto && once) {
        once();  // warm
        int reps = 1;
        for (;;) {  // enough repetitions for a fifth of `seconds`
            const auto t0 = clock::now();
            for (int r = 0; r < reps; r++) {
                once();
            }
            if (std::chrono::duration<double>(clock::now() - t0).count() >= seconds / 5 || reps >= (1 << 20)) {
                break;
            }
            reps *= 2;
        }
        double best = 1e300;
        for (int round = 0; round < 5; round++) {
            const auto t0 = clock::now();
            for (int r = 0; r < reps; r++) {
                once();
            }
            best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count() / reps);
        }
        return 2.0 * M * N * K / best / 1e9;
    };
    out[0] = rate([&] { pr.multiply_into(*ks, kb, M, N, K, A.data(), K, C.data(), N, nullptr, 0, 0); });
    if (sgemm != nullptr) {
        // row-major C = A * W^T: CblasRowMajor (101), NoTrans (111), Trans (112)
        out[1] = rate([&] { sgemm(101, 111, 112, M, N, K, 1.0f, A.data(), K, W.data(), K, 0.0f, C.data(), N); });
    }
    return true;
}

}  // namespace packed
}  // namespace llamax
