// Packed-weight matrix products for embedding contexts (third_party/patches/0010).
//
// ggml multiplies an embedding model's float weights with tinyBLAS (no
// packing, about half of a core's FMA peak) or, through patch 0005, with
// OpenBLAS, which packs the weights into its own layout on every call:
// for inputs of 14-60 tokens that packing costs as much as the product.
// Weights never change, so this packs each float weight matrix of a model
// once, on first use, into panels of 32 (AVX-512) or 16 (AVX2) output
// columns, and multiplies from them with register-blocked kernels that
// read each panel in order.  Every output element is one dot product
// summed in the same order whatever the number of rows, so a row's result
// does not depend on what it was batched with.
//
// The packed copies are float32, one store per model, shared by its
// contexts and freed with the model.  BF16 weights, on CPUs with
// AVX512_BF16, are packed as bf16 instead and multiplied by the CPU's bf16
// dot-product instruction, the activations rounded to bf16 (as ggml's own
// BF16 products do), sums in float32: twice the products per instruction.
// A store stops packing past its budget (set_budget), and a weight it did
// not pack goes on to patch 0005 / ggml.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct ggml_tensor;
struct llama_model;

namespace llamax {
namespace packed {

// The kernels this process runs: "avx512", "avx2", or "" when the CPU (or
// the build: not x86-64 with GCC/Clang) has neither.
const char * isa();
// The kernel sets this CPU can run, best first ("avx512", "avx2"); with
// LLAMAX_PACKED_ISA=avx2 in the environment, only "avx2" (an AVX2-only CPU's).
std::vector<std::string> runnable_isas();
// Tests: run the named kernels ("avx512", "avx2"; "" = the best the CPU
// has) for models whose first embedding context is made from now on.
// False, changing nothing, when the CPU can't run them.
bool set_isa(const char * name);

// Whether embedding contexts made from now on use packed weights.
void set_enabled(bool on);
bool enabled();

// Whether models whose first embedding context is made from now on multiply
// BF16 weights with the BF16 kernels (set_bf16; default on), and whether
// they will: on, and the CPU and kernel choice have them (bf16).
void set_bf16(bool on);
bool bf16();

// Products computed together with the ADD of their bias (patch 0010's
// fusion), since the process started.
uint64_t fused_products();

// Bytes of packed weights one model may hold (default 2 GiB).
void set_budget(size_t bytes);
size_t budget();

class Store;
using StorePtr = std::shared_ptr<Store>;

// The packed-weight store of `model`, made on first use.
StorePtr store_for(const llama_model * model);
// Drops the model's store (the model is being freed).
void forget(const llama_model * model);
// Bytes packed for `model` so far (0: none).
size_t packed_bytes(const llama_model * model);

// The threadpool hook (ggml_mul_mat_hook_t): mm's product plus `bias` (a
// row; nullptr: none) into `out`; `data` is a Store.
bool mul_mat_hook(void * data, const ggml_tensor * mm, const ggml_tensor * bias, ggml_tensor * out, int ith, int nth);

// Packs a random M x K by N x K problem, multiplies it with `threads`
// simulated shares (adding a random bias row if asked) and returns
// max |C - C_ref| / max |C_ref| against a double-precision reference, or
// infinity if a row's bits depend on the rows multiplied with it or a
// column past N was written (tests).  With `bf16`, the weights are rounded
// to bf16 and the BF16 kernels run, against a reference from the rounded
// values.  -1 when no such kernels can run.
double self_check(int M, int N, int K, int threads, uint32_t seed, bool with_bias, bool bf16);

// Times C = A * W^T (M x K by N x K, one thread) with the packed kernels
// and, when `sgemm` is given (cblas_sgemm's signature), with it too, each
// for at least `seconds`; writes GFLOP/s (best of 5 rounds) to out[0] and
// out[1] (0: not run); `bf16`: the BF16 kernels, on weights rounded to
// bf16.  False when no such kernels can run (benchmarks).
using SgemmFnRef = void (*)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                            int);
bool bench(int M, int N, int K, double seconds, SgemmFnRef sgemm, bool bf16, double out[2]);

}  // namespace packed
}  // namespace llamax
