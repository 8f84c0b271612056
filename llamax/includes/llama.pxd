# Raw mirror of the subset of llama.h (pinned llama.cpp 0c1e570) that llamax
# uses.  Declarations only: no logic lives here.
from libc.stdint cimport int8_t, int32_t, int64_t, uint32_t, uint64_t
from libc.stdio cimport FILE


cdef extern from "ggml.h" nogil:
    ctypedef bint (*ggml_abort_callback)(void * data)

    cdef enum ggml_type:
        GGML_TYPE_F32
        GGML_TYPE_F16
        GGML_TYPE_COUNT
    const char * ggml_type_name(ggml_type t)
    bint ggml_is_quantized(ggml_type t)
    int64_t ggml_blck_size(ggml_type t)

    cdef enum ggml_numa_strategy:
        GGML_NUMA_STRATEGY_DISABLED
        GGML_NUMA_STRATEGY_DISTRIBUTE
        GGML_NUMA_STRATEGY_ISOLATE
        GGML_NUMA_STRATEGY_NUMACTL
        GGML_NUMA_STRATEGY_MIRROR
        GGML_NUMA_STRATEGY_COUNT

    cdef enum ggml_log_level:
        GGML_LOG_LEVEL_NONE
        GGML_LOG_LEVEL_DEBUG
        GGML_LOG_LEVEL_INFO
        GGML_LOG_LEVEL_WARN
        GGML_LOG_LEVEL_ERROR
        GGML_LOG_LEVEL_CONT


cdef extern from "ggml-backend.h" nogil:
    ctypedef void * ggml_backend_dev_t
    cdef enum ggml_backend_dev_kind "ggml_backend_dev_type":
        GGML_BACKEND_DEVICE_TYPE_CPU
        GGML_BACKEND_DEVICE_TYPE_GPU
        GGML_BACKEND_DEVICE_TYPE_IGPU
        GGML_BACKEND_DEVICE_TYPE_ACCEL
    size_t ggml_backend_dev_count()
    ggml_backend_dev_t ggml_backend_dev_get(size_t index)
    const char * ggml_backend_dev_name(ggml_backend_dev_t device)
    const char * ggml_backend_dev_description(ggml_backend_dev_t device)
    void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total)
    int ggml_backend_dev_type(ggml_backend_dev_t device)


cdef extern from "llama.h" nogil:
    cdef struct llama_vocab
    cdef struct llama_model
    cdef struct llama_context
    cdef struct llama_sampler
    cdef struct llama_adapter_lora
    cdef struct llama_memory_i
    ctypedef llama_memory_i * llama_memory_t

    ctypedef int32_t llama_pos
    ctypedef int32_t llama_token
    ctypedef int32_t llama_seq_id

    cdef uint32_t LLAMA_DEFAULT_SEED

    cdef enum llama_pooling_type:
        LLAMA_POOLING_TYPE_UNSPECIFIED
        LLAMA_POOLING_TYPE_NONE
        LLAMA_POOLING_TYPE_MEAN
        LLAMA_POOLING_TYPE_CLS
        LLAMA_POOLING_TYPE_LAST
        LLAMA_POOLING_TYPE_RANK

    cdef enum llama_load_mode:
        LLAMA_LOAD_MODE_AUTO
        LLAMA_LOAD_MODE_NONE
        LLAMA_LOAD_MODE_MMAP
        LLAMA_LOAD_MODE_MLOCK
        LLAMA_LOAD_MODE_MMAP_MLOCK

    cdef enum llama_split_mode:
        LLAMA_SPLIT_MODE_NONE
        LLAMA_SPLIT_MODE_LAYER
        LLAMA_SPLIT_MODE_ROW
        LLAMA_SPLIT_MODE_TENSOR

    cdef enum llama_rope_scaling_type:
        LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED
        LLAMA_ROPE_SCALING_TYPE_NONE
        LLAMA_ROPE_SCALING_TYPE_LINEAR
        LLAMA_ROPE_SCALING_TYPE_YARN
        LLAMA_ROPE_SCALING_TYPE_LONGROPE

    cdef enum llama_attention_type:
        LLAMA_ATTENTION_TYPE_UNSPECIFIED
        LLAMA_ATTENTION_TYPE_CAUSAL
        LLAMA_ATTENTION_TYPE_NON_CAUSAL

    cdef enum llama_model_kv_override_type:
        LLAMA_KV_OVERRIDE_TYPE_INT
        LLAMA_KV_OVERRIDE_TYPE_FLOAT
        LLAMA_KV_OVERRIDE_TYPE_BOOL
        LLAMA_KV_OVERRIDE_TYPE_STR

    cdef struct llama_model_kv_override:
        llama_model_kv_override_type tag
        char key[128]
        # (members of an anonymous union in llama.h)
        int64_t val_i64
        double val_f64
        bint val_bool
        char val_str[128]

    cdef enum llama_flash_attn_type:
        LLAMA_FLASH_ATTN_TYPE_AUTO
        LLAMA_FLASH_ATTN_TYPE_DISABLED
        LLAMA_FLASH_ATTN_TYPE_ENABLED

    cdef enum llama_vocab_type:
        LLAMA_VOCAB_TYPE_NONE
        LLAMA_VOCAB_TYPE_SPM
        LLAMA_VOCAB_TYPE_BPE
        LLAMA_VOCAB_TYPE_WPM

    ctypedef struct llama_token_data:
        llama_token id
        float logit
        float p

    ctypedef struct llama_logit_bias:
        llama_token token
        float bias

    cdef struct llama_model_params:
        int32_t n_gpu_layers
        llama_split_mode split_mode
        llama_load_mode load_mode
        int32_t main_gpu
        const float * tensor_split
        const llama_model_kv_override * kv_overrides
        bint vocab_only
        bint check_tensors
        bint use_extra_bufts

    cdef struct llama_context_params:
        uint32_t n_ctx
        uint32_t n_batch
        uint32_t n_ubatch
        uint32_t n_seq_max
        int32_t n_threads
        int32_t n_threads_batch
        llama_rope_scaling_type rope_scaling_type
        llama_pooling_type pooling_type
        llama_attention_type attention_type
        llama_flash_attn_type flash_attn_type
        float rope_freq_base
        float rope_freq_scale
        float yarn_ext_factor
        float yarn_attn_factor
        float yarn_beta_fast
        float yarn_beta_slow
        uint32_t yarn_orig_ctx
        ggml_type type_k
        ggml_type type_v
        ggml_abort_callback abort_callback
        void * abort_callback_data
        bint embeddings
        bint offload_kqv
        bint no_perf
        bint op_offload
        bint swa_full
        bint kv_unified

    ctypedef struct llama_sampler_chain_params:
        bint no_perf

    llama_model_params llama_model_default_params()
    llama_context_params llama_context_default_params()
    llama_sampler_chain_params llama_sampler_chain_default_params()

    void llama_backend_init()
    void llama_numa_init(ggml_numa_strategy numa)
    size_t llama_max_devices()
    const char * llama_print_system_info()
    bint llama_supports_gpu_offload()

    llama_model * llama_model_load_from_file(const char * path_model, llama_model_params params)
    void llama_model_free(llama_model * model)

    const llama_vocab * llama_model_get_vocab(const llama_model * model)
    int32_t llama_model_n_ctx_train(const llama_model * model)
    int32_t llama_model_n_embd(const llama_model * model)
    int32_t llama_model_n_layer(const llama_model * model)
    int32_t llama_model_n_head(const llama_model * model)
    uint64_t llama_model_size(const llama_model * model)
    uint64_t llama_model_n_params(const llama_model * model)
    int32_t llama_model_desc(const llama_model * model, char * buf, size_t buf_size)
    int32_t llama_model_meta_count(const llama_model * model)
    int32_t llama_model_meta_key_by_index(const llama_model * model, int32_t i, char * buf, size_t buf_size)
    int32_t llama_model_meta_val_str_by_index(const llama_model * model, int32_t i, char * buf, size_t buf_size)
    const char * llama_model_chat_template(const llama_model * model, const char * name)
    bint llama_model_has_encoder(const llama_model * model)
    bint llama_model_is_recurrent(const llama_model * model)
    bint llama_model_is_hybrid(const llama_model * model)

    llama_vocab_type llama_get_vocab_type "llama_vocab_type"(const llama_vocab * vocab)
    int32_t llama_vocab_n_tokens(const llama_vocab * vocab)
    bint llama_vocab_is_eog(const llama_vocab * vocab, llama_token token)
    bint llama_vocab_is_control(const llama_vocab * vocab, llama_token token)
    llama_token llama_vocab_bos(const llama_vocab * vocab)
    llama_token llama_vocab_eos(const llama_vocab * vocab)
    llama_token llama_vocab_eot(const llama_vocab * vocab)
    llama_token llama_vocab_sep(const llama_vocab * vocab)
    llama_token llama_vocab_nl(const llama_vocab * vocab)
    llama_token llama_vocab_pad(const llama_vocab * vocab)
    llama_token llama_vocab_fim_pre(const llama_vocab * vocab)
    llama_token llama_vocab_fim_suf(const llama_vocab * vocab)
    llama_token llama_vocab_fim_mid(const llama_vocab * vocab)
    bint llama_vocab_get_add_bos(const llama_vocab * vocab)
    bint llama_vocab_get_add_eos(const llama_vocab * vocab)
    bint llama_vocab_get_add_sep(const llama_vocab * vocab)
    const char * llama_vocab_get_text(const llama_vocab * vocab, llama_token token)

    int32_t llama_tokenize(const llama_vocab * vocab, const char * text, int32_t text_len,
                           llama_token * tokens, int32_t n_tokens_max,
                           bint add_special, bint parse_special)
    int32_t llama_token_to_piece(const llama_vocab * vocab, llama_token token, char * buf,
                                 int32_t length, int32_t lstrip, bint special)
    int32_t llama_detokenize(const llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                             char * text, int32_t text_len_max, bint remove_special, bint unparse_special)

    uint32_t llama_n_ctx(const llama_context * ctx)
    uint32_t llama_n_batch(const llama_context * ctx)
    uint32_t llama_n_ubatch(const llama_context * ctx)
    uint32_t llama_n_seq_max(const llama_context * ctx)
    int32_t llama_n_threads(llama_context * ctx)
    int32_t llama_n_threads_batch(llama_context * ctx)
    void llama_set_n_threads(llama_context * ctx, int32_t n_threads, int32_t n_threads_batch)
    void llama_set_embeddings(llama_context * ctx, bint embeddings)
    llama_pooling_type llama_get_pooling_type "llama_pooling_type"(const llama_context * ctx)

    float * llama_get_logits(llama_context * ctx)
    float * llama_get_logits_ith(llama_context * ctx, int32_t i)
    float * llama_get_embeddings(llama_context * ctx)
    float * llama_get_embeddings_seq(llama_context * ctx, llama_seq_id seq_id)

    uint64_t llama_adapter_get_alora_n_invocation_tokens(const llama_adapter_lora * adapter)
    const llama_token * llama_adapter_get_alora_invocation_tokens(const llama_adapter_lora * adapter)
    int32_t llama_adapter_meta_count(const llama_adapter_lora * adapter)
    int32_t llama_adapter_meta_key_by_index(const llama_adapter_lora * adapter, int32_t i, char * buf, size_t buf_size)
    int32_t llama_adapter_meta_val_str_by_index(const llama_adapter_lora * adapter, int32_t i, char * buf, size_t buf_size)

    llama_sampler * llama_sampler_chain_init(llama_sampler_chain_params params)
    void llama_sampler_chain_add(llama_sampler * chain, llama_sampler * smpl)
    int32_t llama_sampler_chain_n(const llama_sampler * chain)
    void llama_sampler_free(llama_sampler * smpl)
    void llama_sampler_reset(llama_sampler * smpl)
    void llama_sampler_accept(llama_sampler * smpl, llama_token token)
    llama_token llama_sampler_sample(llama_sampler * smpl, llama_context * ctx, int32_t idx)
    llama_sampler * llama_sampler_init_greedy()
    llama_sampler * llama_sampler_init_dist(uint32_t seed)
    llama_sampler * llama_sampler_init_top_k(int32_t k)
    llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep)
    llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep)
    llama_sampler * llama_sampler_init_typical(float p, size_t min_keep)
    llama_sampler * llama_sampler_init_temp(float t)
    llama_sampler * llama_sampler_init_mirostat(int32_t n_vocab, uint32_t seed, float tau, float eta, int32_t m)
    llama_sampler * llama_sampler_init_mirostat_v2(uint32_t seed, float tau, float eta)
    llama_sampler * llama_sampler_init_grammar(const llama_vocab * vocab, const char * grammar_str,
                                               const char * grammar_root)
    llama_sampler * llama_sampler_init_grammar_lazy_patterns(const llama_vocab * vocab, const char * grammar_str,
                                                             const char * grammar_root,
                                                             const char ** trigger_patterns,
                                                             size_t num_trigger_patterns,
                                                             const llama_token * trigger_tokens,
                                                             size_t num_trigger_tokens)
    llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                 float penalty_freq, float penalty_present)
    llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                  const llama_logit_bias * logit_bias)
