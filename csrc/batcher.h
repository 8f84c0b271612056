// Continuous batching: many sequences of one llama_context decoded together.
//
// A Batcher owns a Context (n_seq_max = S, kv_unified = false, so every
// sequence has its own n_ctx_seq cells and running out of room never touches
// another's) and a thread that runs it without the GIL.  Sequences are
// submitted with their prompt, their own sampler chain (cloned: the caller's
// Sampler is never touched by the batcher's thread), stops and state (adapter
// set + control vector).  Every step builds one batch -- one token for each
// generating sequence of the running state group, plus prompt chunks of that
// group's newly admitted sequences, up to n_batch -- decodes it once, samples
// each sequence and hands its token to the sequence's consumer (woken by a
// condition variable, never polled).
//
// Adapter sets mix; control vectors don't.  llama.cpp applies adapters and
// control vectors per context; with its patch 0004 (per-sequence LoRA
// scales) one decode serves sequences with different adapter sets: the
// union of their adapters is applied to every token, each scaled per token
// by its sequence's scale (0 where the sequence doesn't use it).  Sequences
// with different control vectors still never share a decode: groups (by
// control vector; by whole state with mix_adapters off) take turns,
// `quantum` steps each, so a minority group is never starved (llama-server
// serves the lowest slot's adapter set until it finishes).
// n_mixed_decodes() counts decodes that mixed what they must not: it stays
// 0, and tests assert it.
//
// Prefix cache (prefix_chunk = C > 0): prompts are decoded in chunks that
// end at multiples of C positions.  A sequence that ends leaves the KV of
// its prompt's whole chunks in its slot, tagged with its state; a new
// sequence of the same state reuses the longest run of whole chunks its
// prompt shares with such a slot, or with a running sequence of that state
// (llama.cpp copies that sequence's cells into the new one's).  A sequence
// admitted while such a shared prefix is still being decoded by an earlier
// one waits for it and then copies it, so concurrent requests with one
// system prompt decode it once.  At least the prompt's
// last token is always decoded.  With align off (prefix_align=false) the
// prompt is decoded in n_batch chunks as usual and reuse counts in units of
// C (C=1: any common prefix, as llama-server does): more is reused, but a
// cached run no longer does exactly the arithmetic of a cold one.
#pragma once

#include "batch_plan.h"
#include "llamax.h"

#include <condition_variable>
#include <deque>
#include <thread>

namespace llamax {

struct SeqParams {
    std::vector<llama_token> prompt;
    int32_t max_tokens = 16;  // < 0: until the sequence's context is full
    bool ignore_eos = false;
    int32_t n_logprobs = -1;  // < 0: none; k >= 0: the token's logprob and the k most likely
    std::vector<std::vector<llama_token>> stop_sequences;
    StatePtr state;  // null: the base model.  Held until the sequence is over.
    bool cache_prompt = true;  // false: decode the whole prompt (no cached or shared prefix)
    // Who the sequence runs for (see Batcher::admit): a tenant id (0: no
    // tenant), its weight in the fair share of slots, and its priority.
    uint64_t tenant = 0;
    double weight = 1.0;
    int32_t priority = 0;
    int32_t max_slots = 0;  // > 0: at most this many of its tenant's sequences hold slots at once
    // The prefix cache's scope: cells are reused only between sequences
    // with equal salts (a tenant's cache is its own).
    uint64_t cache_salt = 0;
};

struct SeqEvent {
    llama_token token = -1;
    float logprob = 0.0f;
    std::vector<std::pair<llama_token, float>> top;  // most likely first
};

class Batcher;

class Seq {
public:
    ~Seq();
    // Consumer side, any thread.  Waits up to timeout_ms for tokens, moves
    // them to `out`; returns true once the sequence is over and `out` holds
    // its last tokens (then finish()/rethrow() tell how it ended).
    bool wait(int32_t timeout_ms, std::vector<SeqEvent> & out);
    // Ends the sequence at the batcher's next step (its slot and KV cells
    // are freed there); finish() is then Finish::Cancelled.
    void cancel();
    Finish finish() const { return finish_; }
    int32_t n_prompt() const { return n_prompt_; }
    // Prompt tokens reused from the prefix cache (known once admitted).
    int32_t n_cached() const { return n_cached_.load(std::memory_order_relaxed); }
    // Its place in the order sequences got slots (1: the batcher's first;
    // 0: not admitted yet).
    int64_t admit_order() const { return admit_order_.load(std::memory_order_relaxed); }
    // Seconds it waited for a slot (from submit to admission; < 0: still waiting).
    double queue_seconds() const {
        const int64_t q = queued_ns_.load(std::memory_order_relaxed);
        return q < 0 ? -1.0 : (double) q * 1e-9;
    }
    bool failed() const { return failed_; }
    void rethrow() const;  // the error that ended the sequence, if any
    // Also write a byte to the batcher's notify fd whenever this sequence
    // has news (asyncio waits on that fd instead of a thread per sequence).
    void set_notify(bool on) { notify_.store(on, std::memory_order_relaxed); }

private:
    friend class Batcher;
    SeqParams p_;
    llama_sampler * chain_ = nullptr;    // owned clone
    llama_sampler * grammar_ = nullptr;  // inside chain_, or null
    bool plain_greedy_ = false;
    // batcher thread only
    llama_seq_id seq_ = -1;
    llama_pos pos_ = 0;
    uint64_t group_ = 0;       // its state's id: equal states are one interned State
    StatePtr cv_state_;        // its control vector alone (no adapters): the scheduling group with mixing
    size_t max_stop_ = 0;      // the longest stop sequence (tail_ keeps that many tokens)
    int32_t n_fed_ = 0;        // prompt tokens decoded
    int32_t chunk_ = 0;        // prompt tokens in this step's batch
    llama_token next_ = -1;    // sampled, not yet decoded
    int32_t n_generated_ = 0;
    std::vector<llama_token> tail_;  // last tokens, for stop sequences
    int32_t batch_row_ = -1;   // this step's output row in the batch
    // A sequence with a grammar is sampled off the decode path (a sampler
    // thread): its logits row is copied, and it sits out the decodes until
    // its token is back.  0: no sampling in flight; 1: queued or running;
    // 2: done (sampled_, or sample_error_ when sample_failed_).
    std::atomic<int> sampling_{0};
    std::vector<float> row_;
    std::vector<llama_token_data> cand_;  // (sampler thread) scratch
    llama_token sampled_ = -1;
    bool sample_failed_ = false;
    ErrorKind sample_kind_ = ErrorKind::Grammar;
    std::string sample_error_;
    // shared with the consumer (mu_)
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<SeqEvent> events_;
    bool done_ = false;
    std::atomic<bool> cancelled_{false};
    std::atomic<bool> notify_{false};
    Finish finish_ = Finish::Length;
    bool failed_ = false;
    ErrorKind error_kind_ = ErrorKind::Decode;
    std::string error_;
    int32_t n_prompt_ = 0;
    std::atomic<int32_t> n_cached_{0};
    std::atomic<int64_t> admit_order_{0};
    int64_t submit_ns_ = 0;                 // steady clock at submit()
    std::atomic<int64_t> queued_ns_{-1};    // set at admission
    bool shareable_ = true;    // (batcher thread) its prompt's cells may seed another sequence
    // (batcher thread) admitted while an earlier sequence of its state was
    // still decoding a prefix they share: it waits for those share_n_
    // positions and copies them instead of decoding them again
    std::weak_ptr<Seq> leader_;
    int32_t share_n_ = 0;
};
using SeqPtr = std::shared_ptr<Seq>;

struct BatcherStats {
    int64_t n_decodes = 0;        // llama_decode calls
    int64_t n_tokens = 0;         // tokens decoded, prompt and generated
    int64_t n_mixed_decodes = 0;  // decodes mixing states (must stay 0)
    int64_t n_switches = 0;       // state changes between decodes
    int64_t n_finished = 0;       // sequences ended (any way)
    int64_t n_cached_tokens = 0;  // prompt tokens reused from the prefix cache
    int64_t n_seq_copies = 0;     // prefixes copied from another slot's cells
    int64_t n_multi_adapter_decodes = 0;  // decodes that served several adapter sets (patch 0004)
    int64_t n_seq_decoded = 0;    // sum over decodes of the sequences in each (/ n_decodes: sequences per decode)
    int64_t n_offloaded = 0;      // tokens sampled on a sampler thread (sequences with a grammar)
    int64_t n_sat_out = 0;        // decodes that went ahead while a sequence's token was still being sampled
    int64_t n_preempted = 0;      // decodes aborted (and redone) for a shorter newcomer or a newcomer tenant
    int64_t n_newcomer_steps = 0; // decodes of newcomer tenants' first prompts alone (reserve_slots > 0)
    double decode_s = 0;          // seconds in llama_decode, every call (those aborted too)
    double preempted_s = 0;       // of which in decodes aborted for a newcomer (their work is redone)
    double newcomer_s = 0;        // of which in newcomer tenants' steps
};

class Batcher {
public:
    // Takes over `ctx` (the caller must not use it until the Batcher is
    // gone); starts the thread.  quantum: steps a state group keeps the
    // context while another group waits.  prefix_chunk: see above (0: off).
    // mix_adapters: one decode may serve several adapter sets (see above).
    // prompt_step: with other sequences active, a prompt goes in at most this
    // many tokens per step (0: n_batch), so that their decodes stay short.
    Batcher(Context * ctx, int32_t quantum, int32_t prefix_chunk = 0, bool mix_adapters = true,
            bool prefix_align = true, int32_t prompt_step = 64);
    ~Batcher();  // close()
    Batcher(const Batcher &) = delete;
    Batcher & operator=(const Batcher &) = delete;

    // Validates (tokens, prompt size, stops), clones the chain and queues
    // the sequence; `grammar` is the chain's grammar sampler or null.
    SeqPtr submit(llama_sampler * chain, llama_sampler * grammar, bool plain_greedy, SeqParams params);
    // Ends every sequence (ErrorKind::Aborted, "closed") and joins the
    // thread.  Idempotent.
    void close();

    // Slots a tenant over its fair share leaves free for the others (see
    // admit(); 0: first come, first served among tenants too).
    void set_reserve_slots(int32_t n) { reserve_.store(n < 0 ? 0 : n, std::memory_order_relaxed); }

    // Forget every cached prefix: from the next admission on, no sequence
    // reuses cells of one that came before this call.
    void forget_cache() { forget_.store(true, std::memory_order_relaxed); }

    BatcherStats stats();
    int32_t n_active();   // admitted + queued, not yet finished
    int32_t n_slots() const { return n_slots_; }
    int32_t n_ctx_seq() const { return ctx_->n_ctx_seq(); }
    // The write end of a non-blocking pipe (the caller owns both ends and
    // closes them after close()): a byte is written when a sequence with
    // set_notify(true) has news.  -1: none.
    void set_notify_fd(int fd) { notify_fd_.store(fd, std::memory_order_relaxed); }

private:
    void run();
    void step(std::vector<SeqPtr> & running);
    void admit(std::vector<SeqPtr> & gone);
    std::deque<SeqPtr>::iterator pick_pending(int32_t n_free);
    void end(const SeqPtr & s, Finish f);
    void fail(const SeqPtr & s, ErrorKind k, const std::string & msg);
    void release_slot(const SeqPtr & s, bool keep_prefix);
    int32_t place(const SeqPtr & s);  // a free slot for s, with its cached prefix set up; -1: none free
    bool follow(const SeqPtr & s);    // false: s waits for its leader this step
    bool apply_group_state(const std::vector<SeqPtr> & group);
    bool decode(const std::vector<SeqPtr> & running, std::vector<SeqPtr> & in_batch, bool multi, bool newcomer_step);
    void advance(const std::vector<SeqPtr> & in_batch);
    void fail_all(std::vector<SeqPtr> & seqs, ErrorKind k, const std::string & msg);
    void notify(const SeqPtr & s);
    void release_orphaned_state();
    bool push_token(const SeqPtr & s, llama_token tok, const float * logits);
    // Grammar sampling off the decode path: hand s's row to a sampler
    // thread / take back the tokens that are done (false: s ended).
    void offload_sample(const SeqPtr & s, const float * logits);
    bool take_sampled(const SeqPtr & s);
    void sampler_loop();

    Context * ctx_;
    int32_t n_slots_;
    int32_t quantum_;
    int32_t prefix_chunk_;  // 0: no prefix cache (also forced for recurrent/hybrid models)
    bool prefix_align_;     // prompts decoded in chunks ending at multiples of prefix_chunk_
    // Prompt scheduling (see step()): with other sequences active, a prompt
    // goes in chunks of at most prompt_step_ tokens; alone, n_batch.  Short
    // prompts (at most prompt_step_ tokens left) go first, shortest first,
    // and a step that has them leaves long chunks for the next step.  A
    // decode holding a long chunk is preempted (aborted, redone later) when
    // a sequence with a shorter prompt arrives and has a free slot -- at
    // most once in a row, so long prompts always progress.
    int32_t prompt_step_;
    bool last_shorts_only_ = false;  // batcher thread: the last step left long chunks out
    // Tenants (reserve_ > 0): a tenant's first sequence when it holds no
    // other slot -- a newcomer -- with a short prompt gets a step of its own
    // (its first token costs one short decode, not one beside every other
    // tenant's tokens; not twice in a row), and it preempts a decode in
    // flight that has no newcomer in it (at most once in a row).
    bool last_newcomer_only_ = false;    // batcher thread: the last step was a newcomers' step
    bool decode_newcomer_preemptible_ = false;  // (mu_) the decode in flight may be preempted by a newcomer
    bool preempt_newcomers_ = true;      // LLAMAX_NEWCOMER_PREEMPT=0: never (for measuring; see the constructor)
    bool newcomer(const Seq & s, const std::vector<SeqPtr> & running) const;
    bool just_preempted_ = false;    // batcher thread: the last decode was preempted
    bool decode_preemptible_ = false;  // (mu_) the decode in flight may be preempted ...
    int32_t decode_min_left_ = 0;      // (mu_) ... by a prompt shorter than this
    bool preempt_ = false;             // (mu_) it was
    // Sampler threads (started with the first grammar sequence, at most
    // kSamplers): one ambiguous grammar takes a sampler thread, not the
    // decode loop.  The loop waits for a token in flight at most a quarter
    // of the last decode's time (others waiting) before it decodes without it.
    static constexpr int32_t kSamplers = 2;
    std::vector<std::thread> samplers_;
    std::mutex smu_;  // sjobs_, sstop_
    std::condition_variable scv_;
    std::deque<SeqPtr> sjobs_;
    bool sstop_ = false;
    std::atomic<bool> closing_{false};
    int32_t n_busy_samplers_ = 0;  // (smu_)
    double last_decode_s_ = 0.0;   // batcher thread
    bool mix_;  // batcher thread after start: mix adapter sets in one decode
    int32_t mix_failures_ = 0;  // mixed decodes failed since the last one that worked
    bool skip_mix_ = false;     // this step groups by whole state (after a failed mixed decode)
    bool mix_active() const { return mix_ && !skip_mix_; }
    uint64_t sched_key(const Seq & s) const { return mix_active() ? s.cv_state_->id : s.group_; }
    // per slot, while no sequence runs in it: the prompt tokens whose cells
    // it kept, and their state (batcher thread; empty: nothing kept)
    struct SlotCache {
        std::vector<llama_token> tokens;
        uint64_t state = 0;
        uint64_t salt = 0;
        int64_t used = 0;
    };
    std::vector<SlotCache> cache_;
    int64_t tick_ = 0;
    int64_t n_admitted_ = 0;  // (mu_) sequences given a slot so far
    std::atomic<bool> forget_{false};
    std::atomic<int32_t> reserve_{0};
    std::thread thread_;
    std::atomic<int> notify_fd_{-1};
    std::mutex mu_;  // pending_, slots_, stop_, stats_
    std::condition_variable cv_;
    bool stop_ = false;
    std::deque<SeqPtr> pending_;
    std::vector<SeqPtr> slots_;
    BatcherStats stats_;
    // batcher thread only
    plan::GroupState sched_;               // the group being served, and the rotation
    std::vector<plan::SeqView> views_;     // step(): the running sequences, for pick_group
    std::vector<plan::Member> members_;    // step(): the group's, for compose_batch
    plan::BatchPlan plan_;                 // step(): this decode's tokens
    std::vector<int32_t> nseq_buf_;
    std::vector<llama_seq_id *> seqp_buf_;
    std::vector<std::pair<float, llama_token>> lp_buf_;
    std::vector<float> scale_buf_;
};

}  // namespace llamax
