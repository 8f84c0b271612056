# Declarations of csrc/ (namespace llamax).  Every function that can throw is
# `except +translate_exception`, which raises the llamax.LlamaxError subclass
# named by the C++ error's kind (csrc/pyerrors.h).
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from llamax.includes.llama cimport (
    llama_adapter_lora, llama_context, llama_context_params, llama_model, llama_pos,
    llama_sampler, llama_seq_id, llama_token, llama_vocab,
)


cdef extern from "pyerrors.h" namespace "llamax":
    # the `except +` handler for every shim call below (C++ -> LlamaxError)
    void translate_exception()
    int register_errors(dict ns) except -1


cdef extern from "packed_gemm.h" namespace "llamax::packed" nogil:
    # float weights packed once for embedding contexts (third_party/patches/0010)
    const char * packed_isa "llamax::packed::isa"()
    cbool packed_set_isa "llamax::packed::set_isa"(const char * name)
    vector[string] packed_runnable_isas "llamax::packed::runnable_isas"() except +translate_exception
    void packed_set_enabled "llamax::packed::set_enabled"(cbool on)
    cbool packed_enabled "llamax::packed::enabled"()
    void packed_set_bf16 "llamax::packed::set_bf16"(cbool on)
    cbool packed_bf16 "llamax::packed::bf16"()
    void packed_set_budget "llamax::packed::set_budget"(size_t nbytes)
    size_t packed_budget "llamax::packed::budget"()
    uint64_t packed_fused_products "llamax::packed::fused_products"()
    ctypedef void (*SgemmFnRef "llamax::packed::SgemmFnRef")(int, int, int, int, int, int, float, const float *, int,
                                                          const float *, int, float, float *, int) noexcept
    cbool packed_bench "llamax::packed::bench"(int M, int N, int K, double seconds, SgemmFnRef sgemm,
                                               cbool bf16, double * out) except +translate_exception
    size_t packed_bytes "llamax::packed::packed_bytes"(const llama_model * model)
    double packed_self_check "llamax::packed::self_check"(int M, int N, int K, int threads, unsigned int seed,
                                                            cbool with_bias, cbool bf16) except +translate_exception


cdef extern from "llamax.h" namespace "llamax" nogil:
    ctypedef void (*log_sink_fn)(int level, const char * text) noexcept
    ctypedef int (*token_cb_fn)(void * user, llama_token token, float logprob,
                                const pair[llama_token, float] * top, int32_t n_top) noexcept
    void c_token_logprobs "llamax::token_logprobs"(const float * logits, int32_t n_vocab, llama_token tok, int32_t k,
                        vector[pair[float, llama_token]] & scratch, float & logprob,
                        vector[pair[llama_token, float]] & top)

    cdef cppclass CMutex "std::mutex":
        void lock()
        void unlock()
        cbool try_lock()

    string take_last_log_error()
    void owned_add(const void * p)
    void owned_remove(const void * p)
    cbool owned_has(const void * p)
    cdef enum class CErrorKind "llamax::ErrorKind":
        InvalidGGUF "llamax::ErrorKind::InvalidGGUF"
        OutOfMemory "llamax::ErrorKind::OutOfMemory"
    CErrorKind classify_log(const string & why, CErrorKind fallback)
    cdef cppclass CLogPhrase "llamax::LogPhrase":
        const char * text
        CErrorKind kind
    CLogPhrase kLogPhrases[]
    const char * error_class_name(int kind)
    void log_install(log_sink_fn sink)
    void log_set_min_level(int level)
    # a single-threaded SGEMM with cblas_sgemm's signature (third_party/patches/0005)
    ctypedef void (*SgemmFn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                             float *, int) noexcept
    void set_embedding_sgemm(SgemmFn fn)
    SgemmFn embedding_sgemm()

    ctypedef shared_ptr[llama_model] CModelPtr "llamax::ModelPtr"
    CModelPtr model_own(llama_model * model)

    cdef cppclass CAdapter "llamax::Adapter":
        llama_adapter_lora * ptr
        string path

    ctypedef shared_ptr[const CAdapter] CAdapterPtr "llamax::AdapterPtr"

    cdef cppclass CControlVector "llamax::ControlVector":
        int32_t n_embd
        int32_t layer_start
        int32_t layer_end
        vector[float] data

    ctypedef shared_ptr[const CControlVector] CControlVectorPtr "llamax::ControlVectorPtr"

    cdef cppclass CState "llamax::State":
        unsigned long long id
        vector[pair[CAdapterPtr, float]] adapters
        CControlVectorPtr cvec

    ctypedef shared_ptr[const CState] CStatePtr "llamax::StatePtr"
    CStatePtr state_intern(const llama_model * model, const vector[CAdapterPtr] & adapters,
                           const vector[float] & scales, const CControlVectorPtr & cvec) except +translate_exception
    const CStatePtr & state_base()
    cbool c_lora_table_supported "llamax::lora_table_supported"()
    size_t state_n_interned()

    cdef cppclass CGenParams "llamax::GenParams":
        int32_t max_tokens
        int32_t seq_id
        cbool ignore_eos
        cbool plain_greedy
        int32_t chunk
        vector[vector[llama_token]] stop_sequences
        llama_sampler * grammar
        int32_t draft_ngram
        int32_t draft_n
        cbool draft_adaptive
        vector[llama_token] history
        int32_t n_logprobs

    cdef enum class CFinish "llamax::Finish":
        Eog
        Length
        StopSequence
        Callback
        ContextFull
        Cancelled

    cdef cppclass CGenResult "llamax::GenResult":
        vector[llama_token] tokens
        CFinish finish
        int32_t n_prompt
        int32_t n_drafted
        int32_t n_accepted
        int32_t n_decodes

    cdef cppclass CLoraTableInfo "llamax::Context::LoraTableInfo":
        int32_t n_slots, max_rank, n_filled, n_per_row, n_table, n_fallback
        int64_t n_fills, n_evictions, n_bytes

    cdef cppclass CContext "llamax::Context":
        CContext(const CModelPtr & model, llama_context_params params, int32_t max_positions) except +translate_exception
        llama_context * raw()
        CMutex & mutex()
        cbool set_state(const CStatePtr & state) except +translate_exception
        const CStatePtr & state()
        int32_t decode(const llama_token * tokens, int32_t n, const llama_pos * pos,
                       const llama_seq_id * seq, const int8_t * logits) except +translate_exception
        int32_t embed(const llama_token * tokens, const int64_t * offsets, int32_t n_inputs, float * out,
                      bint normalize) except +translate_exception
        CGenResult generate(llama_sampler * smpl, const llama_token * prompt, int32_t n_prompt,
                            const CGenParams & params, token_cb_fn cb, void * user) except +translate_exception
        llama_token sample(llama_sampler * chain, llama_sampler * grammar, int32_t row) except +translate_exception
        llama_token sample_logits(llama_sampler * chain, llama_sampler * grammar,
                                  const float * logits) except +translate_exception
        vector[uint8_t] state_seq_get(llama_seq_id seq) except +translate_exception
        void state_seq_set(const uint8_t * data, size_t n, llama_seq_id seq) except +translate_exception
        void kv_clear()
        cbool kv_remove(llama_seq_id seq, llama_pos p0, llama_pos p1) except +translate_exception
        void kv_copy(llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1) except +translate_exception
        void kv_keep(llama_seq_id seq) except +translate_exception
        llama_pos seq_pos_max(llama_seq_id seq) except +translate_exception
        void cancel()
        void watch_sigint(cbool on)
        cbool interrupted()
        void set_threads(int32_t n_threads, int32_t n_threads_batch) except +translate_exception
        void set_deterministic(cbool on) except +translate_exception
        cbool deterministic()
        void set_lora_table(int32_t n_slots, int32_t max_rank) except +translate_exception
        CLoraTableInfo lora_table_info()
        cbool lora_table_fits(const CAdapterPtr & adapter) except +translate_exception
        int32_t last_n_outputs()
        int64_t output_capacity()
        int64_t n_state_calls()
        cbool has_saved_logits(llama_seq_id seq)
        int32_t n_vocab()
        int32_t n_ctx()
        int32_t n_ctx_seq()
        int32_t n_batch()
        int32_t n_seq_max()
        cbool would_grow_outputs(int32_t n_tokens, int32_t n_outputs)
        cbool outputs_all()
        cbool external_sgemm()
        cbool packed_weights()
        int32_t n_call_max()
        cbool has_memory()

    CAdapterPtr adapter_load(const CModelPtr & model, const string & path) except +translate_exception

    CControlVectorPtr cvec_from_rows(const llama_model * model, const float * rows, size_t n_floats,
                                     int32_t layer_start, int32_t layer_end) except +translate_exception
    CControlVectorPtr cvec_from_padded(const llama_model * model, const float * flat, size_t n_floats,
                                       int32_t layer_start, int32_t layer_end) except +translate_exception
    CControlVectorPtr cvec_from_gguf(const llama_model * model, const string & path, float scale,
                                     int32_t layer_start, int32_t layer_end) except +translate_exception
    CControlVectorPtr cvec_sum(const vector[CControlVectorPtr] & parts,
                               const vector[float] & scales) except +translate_exception
    void layer_outputs(const CModelPtr & model, const llama_token * tokens, const int64_t * offsets,
                       int32_t n_prompts, int32_t n_threads, float * out) except +translate_exception

    void check_gguf_file(const string & path) except +translate_exception
    cbool check_model_gguf(const string & path) except +translate_exception
    void accept_checked(llama_sampler * chain, llama_sampler * grammar, llama_token token) except +translate_exception
    int64_t gbnf_max_nesting(const string & text)
    llama_sampler * reasoning_budget_init(const llama_vocab * vocab, int32_t budget, const string & start,
                                          const string & end, const vector[llama_token] & forced,
                                          cbool started_open) except +translate_exception
    int32_t tokenize_safe(const llama_vocab * vocab, const char * text, int32_t n_text, llama_token * out,
                          int32_t n_max, cbool add_special, cbool parse_special) except +translate_exception
    int32_t wpm_long_words_to_unk(const llama_vocab * vocab, llama_token unk, llama_token * tokens, int32_t n)
    void tokenize_many(const llama_vocab * vocab, llama_token unk, const vector[pair[const char *, int32_t]] & texts,
                       cbool add_special, cbool parse_special, int32_t max_tokens, cbool truncate,
                       vector[llama_token] & flat, vector[int64_t] & offsets) except +translate_exception



cdef extern from "batcher.h" namespace "llamax" nogil:
    cdef cppclass CSeqParams "llamax::SeqParams":
        vector[llama_token] prompt
        int32_t max_tokens
        cbool ignore_eos
        int32_t n_logprobs
        vector[vector[llama_token]] stop_sequences
        CStatePtr state
        cbool cache_prompt
        uint64_t tenant
        double weight
        int32_t priority
        int32_t max_slots
        uint64_t cache_salt

    cdef cppclass CSeqEvent "llamax::SeqEvent":
        llama_token token
        float logprob
        vector[pair[llama_token, float]] top

    cdef cppclass CSeq "llamax::Seq":
        cbool wait(int32_t timeout_ms, vector[CSeqEvent] & out)
        void cancel()
        CFinish finish()
        int32_t n_prompt()
        int32_t n_cached()
        int64_t admit_order()
        double queue_seconds()
        cbool failed()
        void rethrow() except +translate_exception
        void set_notify(cbool on)

    ctypedef shared_ptr[CSeq] CSeqPtr "llamax::SeqPtr"

    cdef cppclass CBatcherStats "llamax::BatcherStats":
        int64_t n_decodes
        int64_t n_tokens
        int64_t n_mixed_decodes
        int64_t n_switches
        int64_t n_finished
        int64_t n_cached_tokens
        int64_t n_seq_copies
        int64_t n_multi_adapter_decodes
        int64_t n_seq_decoded
        int64_t n_offloaded
        int64_t n_sat_out
        int64_t n_preempted
        int64_t n_newcomer_steps
        double decode_s
        double preempted_s
        double newcomer_s

    cdef cppclass CBatcher "llamax::Batcher":
        CBatcher(CContext * ctx, int32_t quantum, int32_t prefix_chunk, cbool mix_adapters,
                 cbool prefix_align, int32_t prompt_step) except +translate_exception
        void forget_cache()
        void set_reserve_slots(int32_t n)
        CSeqPtr submit(llama_sampler * chain, llama_sampler * grammar, cbool plain_greedy,
                       CSeqParams params) except +translate_exception
        void close()
        CBatcherStats stats()
        int32_t n_active()
        int32_t n_slots()
        int32_t n_ctx_seq()
        void set_notify_fd(int fd)
