// llamax shim: the few things that must not cross into Python per token or
// must be atomic with respect to one llama_context:
//   - ownership: adapters (and the model under them) are reference counted,
//     and a context's applied state -- an interned, immutable set of
//     adapters with scales plus a control vector -- holds what it applies, so
//     nothing llama.cpp reads can be freed under it;
//   - state swap: applying the state a context has is a pointer compare;
//   - control vectors with llama.cpp's layer padding, validated;
//   - the decode -> sample -> stop token loop, without the GIL;
//   - input validation before llama.cpp, which asserts on bad input.
// The README's "The native engine" and "Reliability" sections describe the
// behaviour users see.  Every function that can fail throws llamax::Error;
// Cython turns it into the matching llamax.LlamaxError subclass
// (csrc/pyerrors.h).
#pragma once

#include "llama.h"
#include "ggml-cpu.h"
#include "packed_gemm.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace llamax {

// The one table of error kinds: each shim error kind and the name of the
// llamax/_errors.py class it raises.  csrc/pyerrors.h looks the classes up
// by these names at import (a missing one fails the import), so the enum,
// the classes and the translation can't drift apart by position.
// Interrupted has no class: Python's SIGINT handler runs (KeyboardInterrupt).
#define LLAMAX_ERROR_KINDS(X)                     \
    X(InvalidArgument, "InvalidArgumentError")    \
    X(Token, "TokenError")                        \
    X(ContextOverflow, "ContextOverflowError")    \
    X(InvalidGGUF, "InvalidGGUFError")            \
    X(AdapterMismatch, "AdapterMismatchError")    \
    X(ControlVector, "ControlVectorError")        \
    X(KVCacheFull, "KVCacheFullError")            \
    X(Aborted, "CancelledError")                  \
    X(Decode, "DecodeError")                      \
    X(OutOfMemory, "OutOfMemoryError")            \
    X(Load, "LoadError")                          \
    X(Grammar, "GrammarError")                    \
    X(Busy, "ContextBusyError")                   \
    X(Interrupted, nullptr)

enum class ErrorKind : int {
#define LLAMAX_KIND_ENUM(kind, cls) kind,
    LLAMAX_ERROR_KINDS(LLAMAX_KIND_ENUM)
#undef LLAMAX_KIND_ENUM
};

#define LLAMAX_KIND_COUNT(kind, cls) +1
constexpr int kErrorKinds = 0 LLAMAX_ERROR_KINDS(LLAMAX_KIND_COUNT);
#undef LLAMAX_KIND_COUNT
static_assert(kErrorKinds == 14, "an error kind was added or removed: update llamax/_errors.py and tests");
static_assert(static_cast<int>(ErrorKind::Interrupted) == kErrorKinds - 1, "Interrupted is the last kind");

// The Python class name of `kind` (nullptr for Interrupted / out of range).
inline const char * error_class_name(int kind) {
    static const char * const names[] = {
#define LLAMAX_KIND_NAME(kind, cls) cls,
        LLAMAX_ERROR_KINDS(LLAMAX_KIND_NAME)
#undef LLAMAX_KIND_NAME
    };
    return kind >= 0 && kind < kErrorKinds ? names[kind] : nullptr;
}

struct Error : std::runtime_error {
    ErrorKind kind;
    int code;
    Error(ErrorKind k, const std::string & msg, int c = 0) : std::runtime_error(msg), kind(k), code(c) {}
};

// The last error llama.cpp logged on this thread (its loaders log the reason
// and return NULL); empty if none since the last take.
std::string take_last_log_error();

// llama.cpp reports some failures only in its log (its loaders log the
// reason and return NULL).  The phrases llamax relies on and the kind each
// means, in one table (tests/core/test_errors.py checks every phrase still
// occurs in the pinned llama.cpp source and maps as listed here).
struct LogPhrase {
    const char * text;
    ErrorKind kind;
};
inline constexpr LogPhrase kLogPhrases[] = {
    {"wrong base model", ErrorKind::AdapterMismatch},
    {"arch mismatch", ErrorKind::AdapterMismatch},
    {"missing one component", ErrorKind::AdapterMismatch},
    {"expect general.type", ErrorKind::AdapterMismatch},
    {"expect adapter.type", ErrorKind::AdapterMismatch},
    {"not transposed", ErrorKind::AdapterMismatch},
    {"unexpected suffix", ErrorKind::AdapterMismatch},
    {"failed to allocate", ErrorKind::OutOfMemory},
    {"unable to allocate", ErrorKind::OutOfMemory},  // a model's weights (CPU or GPU buffer)
};
// The kind of the first phrase `why` contains, else `fallback`.
ErrorKind classify_log(const std::string & why, ErrorKind fallback);

// Log routing.  llama.cpp logs from any thread; the sink is called only for
// records at or above `min_level` (a ggml_log_level), so a quiet logger costs
// one atomic load per record and never touches the GIL.
typedef void (*log_sink_fn)(int level, const char * text);
void log_install(log_sink_fn sink);
void log_set_min_level(int level);

// The single-threaded SGEMM (cblas_sgemm's signature: order and transposes as
// CBLAS enum values) that the threadpools of embedding contexts hand to ggml
// (third_party/patches/0005): float matmuls with many rows run it inside
// ggml's threads.  nullptr: ggml's own kernels, as with an unpatched tree.
// Read when a context sets its threads; set before creating the context.
using SgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float * a,
                         int lda, const float * b, int ldb, float beta, float * c, int ldc);
void set_embedding_sgemm(SgemmFn fn);
SgemmFn embedding_sgemm();

// ---------------------------------------------------------------------------
// Models and LoRA adapters, reference counted.
//
// An adapter is freed when its last holder lets go: the Python object that
// loaded it, and every State that names it (a context's applied state, a
// queued or running batched sequence).  So "unload" never has to wait or
// refuse: the adapter lives until the last request using it ends.  It holds
// its model, because llama.cpp's adapter free touches the model (patch 0003
// guards the model's adapter set for frees on any thread).

using ModelPtr = std::shared_ptr<llama_model>;
ModelPtr model_own(llama_model * model);  // the deleter is llama_model_free

// The llama.cpp objects llamax owns (models, contexts, adapters, samplers),
// by address, while they live: llamax.llama_cpp's ctypes bindings of
// llama.h refuse to free one (owned_has), so that nothing llamax holds is
// freed under it through the raw C API.
void owned_add(const void * p);
void owned_remove(const void * p);
bool owned_has(const void * p);

struct Adapter {
    llama_adapter_lora * ptr = nullptr;
    ModelPtr model;
    std::string path;
    uint64_t serial = 0;  // unique per loaded adapter, never reused (State ids, see state_intern)
    Adapter() = default;
    Adapter(const Adapter &) = delete;
    Adapter & operator=(const Adapter &) = delete;
    ~Adapter();  // llama_adapter_lora_free, then the model reference goes
};
using AdapterPtr = std::shared_ptr<const Adapter>;

AdapterPtr adapter_load(const ModelPtr & model, const std::string & path);  // GIL-free

// ---------------------------------------------------------------------------
// Control vectors: an immutable, already padded buffer in llama.cpp's layout
// (row il-1 holds layer il, for il in [1, layer_end]).

struct ControlVector {
    int32_t n_embd = 0;
    int32_t layer_start = 0;
    int32_t layer_end = 0;
    std::vector<float> data;  // n_embd * layer_end floats
    uint64_t hash = 0;        // of the above, computed once when it is made (State interning)
    uint64_t serial = 0;      // unique per vector made, never reused (State ids, see state_intern)
    bool same_as(const ControlVector & o) const {
        return hash == o.hash && n_embd == o.n_embd && layer_start == o.layer_start &&
               layer_end == o.layer_end && data == o.data;
    }
};
using ControlVectorPtr = std::shared_ptr<const ControlVector>;

// rows: (layer_end - layer_start + 1) x n_embd, row 0 = layer_start.
ControlVectorPtr cvec_from_rows(const llama_model * model, const float * rows, size_t n_floats,
                                int32_t layer_start, int32_t layer_end);
// flat: llama.cpp's padded layout, at least n_embd * layer_end floats from layer 1.
ControlVectorPtr cvec_from_padded(const llama_model * model, const float * flat, size_t n_floats,
                                  int32_t layer_start, int32_t layer_end);
// A llama.cpp control-vector GGUF (`direction.N` tensors, N >= 1), times scale.
// layer_start/layer_end <= 0 mean "the file's own range".
ControlVectorPtr cvec_from_gguf(const llama_model * model, const std::string & path, float scale,
                                int32_t layer_start, int32_t layer_end);
// sum_i scales[i] * parts[i]; the range is the union of the parts' ranges.
ControlVectorPtr cvec_sum(const std::vector<ControlVectorPtr> & parts, const std::vector<float> & scales);

// For control-vector training: the output of every layer (llama.cpp's
// "l_out-N" graph tensors, where its control vectors are added) at the last
// token of each prompt, captured by an eval callback in a context of its own.
// Prompt i is tokens[offsets[i], offsets[i+1]); out holds
// n_prompts x n_layer x n_embd floats.
void layer_outputs(const ModelPtr & model, const llama_token * tokens, const int64_t * offsets,
                   int32_t n_prompts, int32_t n_threads, float * out);

// ---------------------------------------------------------------------------
// State: what a context applies besides its weights.  Immutable and
// interned: equal contents (the same adapter objects with bit-equal scales,
// and an equal control vector) give the same State object while any holder
// keeps it, so comparing states is comparing pointers, and `id` (never
// reused) can tag whatever was computed under it (saved logits, cached
// prefixes).  The base state (no adapters, no control vector) has id 0.

struct State {
    // Equal contents, equal id, also across the lives of states: a state
    // made again from the same adapter objects, scales and control vector
    // object gets its old id back, so the prefix caches keyed by it (the
    // Batcher's slots, Llama's context pool) still match after the last
    // request of an adapter set ended and freed its state.  Ids are never
    // shared by different contents (serials are never reused).
    uint64_t id = 0;
    std::vector<std::pair<AdapterPtr, float>> adapters;  // in application order
    ControlVectorPtr cvec;                               // null: none
    bool is_base() const { return adapters.empty() && !cvec; }
};
using StatePtr = std::shared_ptr<const State>;

// Validates (no null or duplicate adapter, finite scales, all adapters and
// the control vector for `model`) and interns.
StatePtr state_intern(const llama_model * model, const std::vector<AdapterPtr> & adapters,
                      const std::vector<float> & scales, const ControlVectorPtr & cvec);
const StatePtr & state_base();
size_t state_n_interned();  // live interned states, the base one excluded (tests)

// ---------------------------------------------------------------------------
// Context: a llama_context plus what llamax must know about it.

struct GenParams {
    int32_t max_tokens = 16;    // < 0: until the context is full
    int32_t seq_id = 0;
    bool ignore_eos = false;
    bool plain_greedy = false;  // the sampler chain is exactly one greedy sampler
    // > 0: decode the prompt in chunks that end at multiples of `chunk`
    // positions (at most n_batch), so that a prompt decoded after a cached
    // prefix of whole chunks does exactly the arithmetic of a cold run
    // (llama.cpp's results depend on batch shapes).  0: chunks of n_batch.
    int32_t chunk = 0;
    std::vector<std::vector<llama_token>> stop_sequences;
    // The chain's grammar sampler (owned by the chain), or null: every token
    // is checked against it before it is accepted (see accept_checked).
    llama_sampler * grammar = nullptr;
    // Prompt-lookup speculative decoding (0: off): after each sampled token,
    // the longest n-gram (at most draft_ngram tokens) ending the history that
    // occurred earlier in it proposes the (at most draft_n) tokens that
    // followed it there; one decode verifies them all and the tokens the
    // sampler itself picks at each row are kept up to the first
    // disagreement.  The output is what the sampler picks token by token
    // (exactly so for greedy, up to the batch-shape dependence of
    // llama.cpp's arithmetic).  `history` is what precedes the prompt in
    // the sequence (the lookup searches history + prompt + output).  At
    // most draft_n drafts per decode; fewer after drafts were rejected.
    int32_t draft_ngram = 0;
    int32_t draft_n = 0;
    // false: verify every draft found (no timing): for tests, and where a
    // batch is known to cost about one token (a GPU)
    bool draft_adaptive = true;
    std::vector<llama_token> history;
    // >= 0: each token's logprob and the n_logprobs likeliest (token_logprobs,
    // from the row it was sampled from) go to the callback; -1: none.
    int32_t n_logprobs = -1;
};

// Accept `token` into the chain.  With a grammar, the token is first tested
// against it (llama.cpp's own accept aborts on an end-of-generation token the
// grammar doesn't allow yet, and empties the grammar's stacks -- after which
// any use aborts -- on another rejected token): ErrorKind::Grammar instead.
void accept_checked(llama_sampler * chain, llama_sampler * grammar, llama_token token);

// The first maximum logit of a row (llama.cpp's greedy sampler's pick, without
// building the candidate array); a row with a NaN in it raises InvalidArgument
// (an adapter scale or control vector that overflows the model).
llama_token greedy_pick(const float * logits, int32_t n_vocab);

// Sample one token from `logits` (n_vocab of them) through `chain` and
// accept it.  `grammar` (the chain's grammar sampler, or null) is applied
// to the candidates in slices; between slices `stop(user)` is asked whether
// to give up (it throws the error to raise, or returns false).  `cand` is
// the caller's scratch buffer, so several threads can sample at once, each
// with its own chain.
llama_token sample_logits_with(llama_sampler * chain, llama_sampler * grammar, const float * logits,
                               int32_t n_vocab, std::vector<llama_token_data> & cand,
                               void (*stop)(void * user), void * user);

// A reasoning budget, as a sampler of llama.cpp's interface (put it first
// in a chain).  It reads the text of the tokens the chain accepts (rendered
// as the text assembler renders them: special tokens not as text).  The
// section opens with `start` where the output begins (after whitespace), or
// at once when `started_open` (the prompt opened it); it closes by itself
// when `end` appears.  After `budget` tokens inside an open section (0: at
// once), the chain's next picks are forced to `forced` (the closing text's
// tokens: every other candidate is set to -inf), one per token; then the
// budget is spent and the sampler does nothing more.  A pick that is not
// the forced token (a grammar that rejects it raises before that) ends the
// forcing.  Clone copies the progress; reset starts over.
llama_sampler * reasoning_budget_init(const llama_vocab * vocab, int32_t budget, const std::string & start,
                                      const std::string & end, const std::vector<llama_token> & forced,
                                      bool started_open);

// The deepest nesting of parentheses in a GBNF text, outside string
// literals, character classes and comments.  llama.cpp's grammar parser
// recurses once per level (a stack overflow on deep nesting).
int64_t gbnf_max_nesting(const std::string & text);



enum class Finish : int { Eog = 0, Length = 1, StopSequence = 2, Callback = 3, ContextFull = 4, Cancelled = 5 };

struct GenResult {
    std::vector<llama_token> tokens;
    Finish finish = Finish::Length;
    int32_t n_prompt = 0;   // prompt tokens decoded
    int32_t n_drafted = 0;  // speculative decoding: tokens proposed ...
    int32_t n_accepted = 0; // ... and kept
    int32_t n_decodes = 0;  // decodes after the prompt
};

// Per generated token; return 0 to go on, 1 to stop (finish = Callback),
// -1 when the callback raised (the loop stops, the caller re-raises).
// With GenParams::n_logprobs >= 0: the token's logprob and its n_top
// likeliest (token, logprob) pairs; otherwise n_top is -1.
typedef int (*token_cb_fn)(void * user, llama_token token, float logprob,
                           const std::pair<llama_token, float> * top, int32_t n_top);

// One token's log-probabilities from the logits row it was sampled from: the
// log-softmax of the row (its maximum, then the sum of exps in double),
// `tok`'s entry, and the k likeliest tokens (most likely first; equal logits:
// the lower id first).  Every path that reports logprobs -- the one-sequence
// token loop, the batcher, the prompt's echo, the Python loop -- calls this
// one function, so equal logits give equal logprobs bit for bit.  `scratch`
// is the caller's (k > 0 sorts n_vocab pairs in it).
void token_logprobs(const float * logits, int32_t n_vocab, llama_token tok, int32_t k,
                    std::vector<std::pair<float, llama_token>> & scratch, float & logprob,
                    std::vector<std::pair<llama_token, float>> & top);

// Whether this build's llama.cpp has llamax's LoRA table (patch 0013).
inline bool lora_table_supported() {
#ifdef LLAMA_HAS_LORA_TABLE
    return true;
#else
    return false;
#endif
}

class Context {
public:
    // GIL-free.  max_positions > 0: the model has learned (absolute) position
    // embeddings with that many rows, and no sequence may grow past it.
    Context(const ModelPtr & model, llama_context_params params, int32_t max_positions = 0);
    ~Context();
    Context(const Context &) = delete;
    Context & operator=(const Context &) = delete;

    llama_context * raw() const { return ctx_; }
    std::mutex & mutex() { return mu_; }  // one caller at a time

    // All below expect the caller to hold mutex().

    // Apply `state` (null: the base state).  The state it has is a no-op
    // (returns false); otherwise only the part that differs reaches
    // llama.cpp.  The context holds the applied state (and so its adapters).
    bool set_state(const StatePtr & state);
    const StatePtr & state() const { return state_; }
    // Several adapter sets in one decode (llama.cpp patch 0004): the control
    // vector of `cv_state` (a state without adapters) for every token, and
    // adapters[a] at scales[a * n_seq_max + seq] for the tokens of sequence
    // seq (0: not for it).  state() is then `cv_state`, and per_seq() is
    // true until set_state() applies a plain state again.
    void set_state_per_seq(const StatePtr & cv_state, const std::vector<AdapterPtr> & adapters,
                           const std::vector<float> & scales);
    bool per_seq() const { return per_seq_; }
    // The state the caller asked for: state() -- or, in deterministic mode,
    // the adapter state set_state applied through the per-sequence path
    // (then per_seq() is true and state() holds only its control vector).
    const StatePtr & applied_state() const { return det_state_ ? det_state_ : state_; }
    bool det_applied() const { return det_state_ != nullptr; }
    // Whether llama.cpp has per-sequence LoRA scales (patch 0004; a tree
    // given with LLAMAX_LLAMA_CPP_DIR is built unpatched).
    static constexpr bool kHasPerSeq =
#ifdef LLAMA_HAS_ADAPTERS_LORA_SEQ
        true;
#else
        false;
#endif
    // With per_seq(): sequence `seq` gets exactly `st`'s adapters at its scales.
    bool per_seq_covers(const State & st, llama_seq_id seq) const;

    // Validated llama_decode.  pos/seq/logits may be null (then: positions
    // continue each sequence, seq 0, only the last token outputs).
    // Returns the number of outputs.
    int32_t decode(const llama_token * tokens, int32_t n, const llama_pos * pos,
                   const llama_seq_id * seq, const int8_t * logits);

    // Pooled embeddings of many inputs in as few decodes as possible.  Input
    // i is tokens[offsets[i], offsets[i+1]); whole inputs are packed into a
    // batch (at most n_batch tokens and n_seq_max inputs, one sequence id
    // each) and row i of `out` (n_inputs x n_embd floats, caller-owned)
    // receives input i's pooled vector, L2-normalized when asked.  Everything
    // is validated before the first decode.  Returns the batches decoded.
    int32_t embed(const llama_token * tokens, const int64_t * offsets, int32_t n_inputs, float * out,
                  bool normalize);

    // An empty prompt samples the first token from the logits this context
    // saved at the end of the last prompt it decoded, when they still
    // describe sequence params.seq_id exactly: the same state applied, the
    // KV holding that prompt and nothing after it, no KV edit or other
    // decode below its end since (the context tracks this itself).
    GenResult generate(llama_sampler * smpl, const llama_token * prompt, int32_t n_prompt,
                       const GenParams & params, token_cb_fn cb, void * user);

    // Sample (and accept) from output row `row` of the last decode, as
    // sample_chain does.
    llama_token sample(llama_sampler * chain, llama_sampler * grammar, int32_t row);
    // Sample (and accept) from caller-given logits (n_vocab floats), as
    // sample_chain does (Python logits processors).
    llama_token sample_logits(llama_sampler * chain, llama_sampler * grammar, const float * logits);

    // Sequence state: the KV cells of `seq`, as llama_state_seq_get_data
    // writes them, and back.  state_seq_set replaces `seq`'s cells; data
    // llama.cpp refuses (another model, another cache layout, truncated)
    // raises InvalidArgument and leaves `seq` empty.
    std::vector<uint8_t> state_seq_get(llama_seq_id seq);
    void state_seq_set(const uint8_t * data, size_t n, llama_seq_id seq);

    // KV memory
    void kv_clear();
    bool kv_remove(llama_seq_id seq, llama_pos p0, llama_pos p1);
    void kv_copy(llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1);
    void kv_keep(llama_seq_id seq);
    llama_pos seq_pos_max(llama_seq_id seq);

    void cancel() { abort_.store(true, std::memory_order_relaxed); }

    // Deterministic decoding (patch 0012): every graph on ggml's reference
    // kernels, so a row's numbers depend neither on what else is in the
    // batch nor on the thread count (flash attention per query row,
    // products by vec_dot; the row-local fusion stays).  Kept across set_threads().  Throws
    // where the context has no threadpools of llamax's own.
    void set_deterministic(bool on);
    bool deterministic() const { return deterministic_; }

    // The LoRA table (patch 0013): adapters that fit it get a slot of
    // per-weight stacked tensors, and each token is multiplied by its own
    // sequence's adapters only (ggml_mul_mat_id), so a decode mixing n
    // adapter sets costs what one set costs; the rest go the per-sequence
    // way of patch 0004.  Every adapter set of the context goes through it
    // from then on.  Once, before any adapter is applied; throws where
    // llama.cpp is unpatched.
    struct LoraTableInfo {
        int32_t n_slots = 0, max_rank = 0, n_filled = 0, n_per_row = 0, n_table = 0, n_fallback = 0;
        int64_t n_fills = 0, n_evictions = 0, n_bytes = 0;
    };
    void set_lora_table(int32_t n_slots, int32_t max_rank);
    // Any thread, no mutex() needed: as of the last adapter change.
    LoraTableInfo lora_table_info() const {
        std::lock_guard<std::mutex> lk(info_mu_);
        return table_info_;
    }
    bool lora_table_fits(const AdapterPtr & adapter);

    // Ctrl-C: while watching, a SIGINT (seen by a chained C handler, see
    // llamax.cpp) aborts the running decode/generate/embed with
    // ErrorKind::Interrupted, within one graph node.  The Python layer watches
    // only calls made on the main thread while SIGINT has Python's default
    // handler, then lets Python run that handler (KeyboardInterrupt).
    void watch_sigint(bool on);
    bool interrupted() const;

    // Persistent CPU thread pools (as llama-bench and llama-cli use): without
    // them ggml builds a throwaway pool for every graph, every token.
    void set_threads(int32_t n_threads, int32_t n_threads_batch);

    // Introspection (tests, views)
    int32_t last_n_outputs() const { return last_n_outputs_; }
    int64_t output_capacity() const { return out_capacity_; }
    int64_t n_state_calls() const { return n_state_calls_; }  // cvec/adapter calls that reached llama.cpp
    // Whether generate() with an empty prompt on `seq` would sample from saved logits.
    bool has_saved_logits(llama_seq_id seq) const;

    int32_t n_vocab() const { return n_vocab_; }
    int32_t n_ctx() const { return n_ctx_; }
    int32_t n_ctx_seq() const { return n_ctx_seq_; }
    int32_t n_batch() const { return n_batch_; }
    int32_t n_seq_max() const { return n_seq_max_; }
    // Outputs a decode of this shape would need beyond the current buffer.
    // (A context without KV memory -- an encoder-only embedding model --
    // reserves one output row per batch token.)
    // With embeddings on, llama.cpp outputs every token of a batch too.
    int64_t outputs_reserved_for(int32_t n_tokens, int32_t n_outputs) const {
        return outputs_all() ? n_tokens : n_outputs;
    }
    bool outputs_all() const { return !has_memory_ || embeddings_; }
    // Whether float matmuls run the external SGEMM (set_embedding_sgemm).
    bool external_sgemm() const { return sgemm_ != nullptr; }
    // Whether float weights are multiplied from packed copies (packed_gemm.h).
    bool packed_weights() const { return packed_ != nullptr; }
    // The most tokens one decode may take: n_ubatch where llama.cpp needs the
    // whole batch in one ubatch (no KV memory, or non-causal attention).
    int32_t n_call_max() const { return n_call_max_; }
    bool would_grow_outputs(int32_t n_tokens, int32_t n_outputs) const {
        return outputs_reserved_for(n_tokens, n_outputs) > out_capacity_;
    }
    bool has_memory() const { return has_memory_; }

private:
    friend class Batcher;  // drives raw_decode/sample_chain from its thread, holding mutex()
    void check_seq(llama_seq_id seq) const;
    void check_tokens(const llama_token * tokens, int32_t n) const;
    void raw_decode(llama_batch & batch, int32_t n_outputs);
    static bool abort_cb(void * data);
    [[noreturn]] void throw_cancelled(const char * what) const;  // Interrupted or Aborted

    llama_context * ctx_ = nullptr;
    ModelPtr model_own_;  // declared before state_: released after it (and after llama_free)
    const llama_model * model_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
    bool has_memory_ = true;
    bool embeddings_ = false;
    SgemmFn sgemm_ = nullptr;  // what the threadpools were given
    packed::StorePtr packed_;  // the model's packed weights the threadpools' hook reads (null: none)
    bool kv_unified_ = true;
    int32_t n_vocab_ = 0, n_ctx_ = 0, n_ctx_seq_ = 0, n_batch_ = 0, n_seq_max_ = 0, n_call_max_ = 0;
    std::mutex mu_;
    std::atomic<bool> abort_{false};
    bool watch_sigint_ = false;
    uint64_t sigint_start_ = 0;
    StatePtr state_;  // applied; never null (the base state at first)
    bool per_seq_ = false;                  // set_state_per_seq is in effect
    std::vector<AdapterPtr> per_seq_adapters_;  // ... with these adapters (held while applied)
    std::vector<float> per_seq_scales_;         // ... at these scales (adapter-major)
    StatePtr det_state_;  // deterministic: the plain state set_state applied per sequence (else null)
    int64_t out_capacity_ = 0;
    int32_t last_n_outputs_ = 0;
    int64_t n_state_calls_ = 0;
    // scratch batch buffers, reused across calls (no allocation per token)
    std::vector<llama_pos> pos_buf_;
    std::vector<int32_t> nseq_buf_;
    std::vector<llama_seq_id> seq_buf_;
    std::vector<llama_seq_id *> seqp_buf_;
    std::vector<int8_t> out_buf_;
    std::vector<float> prompt_logits_;  // logits after the last prompt generate() decoded
    // ... and what they describe: valid while nothing changed the state or
    // sequence saved_seq_'s KV below saved_pos_ (see invalidate_saved)
    bool saved_valid_ = false;
    llama_seq_id saved_seq_ = -1;
    llama_pos saved_pos_ = 0;
    uint64_t saved_state_ = 0;
    void invalidate_saved(llama_seq_id seq, llama_pos p0);  // seq < 0: any sequence
    std::vector<llama_token_data> cand_;  // candidates for sampling from saved logits
    // Sample one token from a row of logits with the chain, then accept it.
    // Unlike llama_sampler_sample, nothing here asserts or throws past the
    // caller: a grammar that no candidate satisfies (a dead end, e.g.
    // logit_bias banning every token the grammar allows) raises
    // ErrorKind::Grammar, and so does a chain that selects a token the
    // grammar rejects; the grammar's work can be cancelled.
    llama_token sample_chain(llama_sampler * chain, llama_sampler * grammar, const float * logits);
    ggml_threadpool_t tp_ = nullptr;
    ggml_threadpool_t tp_batch_ = nullptr;
    void free_threadpools();
    bool deterministic_ = false;
    mutable std::mutex info_mu_;
    LoraTableInfo table_info_;
    void snap_table_info();  // after every change of the applied adapters
};

// llama_tokenize, made safe for long texts.  Some BPE pre-tokenizers
// (DeepSeek, Falcon, GPT-NeoX, Aquila, ...) have no hand-written splitter in
// llama.cpp and run their regexes through libstdc++'s std::regex, whose
// matcher recurses once per character of a match: ~330 bytes of stack per
// character, so a run of ~26k letters, digits, spaces or punctuation
// overflows an 8 MiB stack (SIGSEGV).  A BPE text of TOKENIZE_DEEP_BYTES or
// more is therefore tokenized on a helper thread whose stack is sized from
// its length (1 KiB a byte + 16 MiB of address space, mapped with
// MAP_NORESERVE: pages are committed only as the recursion touches them);
// if the system will not map that (an address-space limit, strict
// overcommit), ErrorKind::OutOfMemory names the size.
// Returns what llama_tokenize returns.
constexpr int32_t TOKENIZE_DEEP_BYTES = 2048;
int32_t tokenize_safe(const llama_vocab * vocab, const char * text, int32_t n_text, llama_token * out,
                      int32_t n_max, bool add_special, bool parse_special);

// Hugging Face's BERT WordPiece turns a word of more than 100 characters
// into one [UNK] (max_input_chars_per_word); llama.cpp's WPM tokenizer
// splits it into pieces instead.  For a WPM vocabulary, rewrite such words
// in place to [UNK] so that embeddings match the reference model.  Returns
// the new length (n for other vocabularies).
// `unk` is the vocabulary's [UNK] id (tokenizer.ggml.unknown_token_id), -1 for none.
int32_t wpm_long_words_to_unk(const llama_vocab * vocab, llama_token unk, llama_token * tokens, int32_t n);

// Tokenize many texts without the GIL.  texts[i] is (pointer, length) of
// valid UTF-8.  Token ids are appended to `flat`; `offsets` gets n+1
// entries (input i is flat[offsets[i], offsets[i+1])).  An input that
// tokenizes to nothing gets the model's BOS (else EOS) so it can be
// embedded; a model with neither raises.  max_tokens > 0 caps each input:
// truncate keeps its head plus the special tokens the model appends (BERT's
// [SEP]), as Hugging Face tokenizers truncate; otherwise an input over the
// cap raises ContextOverflow naming it.
void tokenize_many(const llama_vocab * vocab, llama_token unk,
                   const std::vector<std::pair<const char *, int32_t>> & texts, bool add_special, bool parse_special, int32_t max_tokens, bool truncate,
                   std::vector<llama_token> & flat, std::vector<int64_t> & offsets);

// Model-level validation helpers used before llama.cpp sees the input.
void check_gguf_file(const std::string & path);  // exists, regular, readable, GGUF magic
// A model file's metadata, for what llama.cpp would assert on (abort) rather
// than report: call after check_gguf_file, before llama_model_load_from_file.
// Returns whether the model has learned (absolute) position embeddings
// (a position_embd.weight tensor: BERT, GPT-2, ...), read in the same pass.
bool check_model_gguf(const std::string & path);

}  // namespace llamax
