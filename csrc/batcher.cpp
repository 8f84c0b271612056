// Continuous batching (batcher.h).
#include "batcher.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <unistd.h>

namespace llamax {

namespace {
int64_t steady_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

// ---------------------------------------------------------------------------
// Seq: the consumer's side

Seq::~Seq() {
    if (chain_ != nullptr) {
        llama_sampler_free(chain_);
    }
}

bool Seq::wait(int32_t timeout_ms, std::vector<SeqEvent> & out) {
    std::unique_lock<std::mutex> lk(mu_);
    if (events_.empty() && !done_) {
        cv_.wait_for(lk, std::chrono::milliseconds(std::max(0, timeout_ms)),
                     [this] { return !events_.empty() || done_; });
    }
    while (!events_.empty()) {
        out.push_back(std::move(events_.front()));
        events_.pop_front();
    }
    return done_;
}

void Seq::cancel() {
    // The batcher is never asleep while it has sequences: it sees this at
    // its next step, queued or running.
    cancelled_.store(true, std::memory_order_relaxed);
}

void Seq::rethrow() const {
    if (failed_) {
        throw Error(error_kind_, error_);
    }
}

// ---------------------------------------------------------------------------
// Batcher

Batcher::Batcher(Context * ctx, int32_t quantum, int32_t prefix_chunk, bool mix_adapters, bool prefix_align,
                 int32_t prompt_step)
    : ctx_(ctx), n_slots_(ctx->n_seq_max()), quantum_(quantum), prefix_chunk_(prefix_chunk),
      prefix_align_(prefix_align),
      mix_(mix_adapters && Context::kHasPerSeq), prompt_step_(prompt_step) {
    if (!ctx->has_memory()) {
        throw Error(ErrorKind::InvalidArgument, "a Batcher needs a generating context (this model has no KV memory)");
    }
    if (ctx->kv_unified_ && n_slots_ > 1) {
        throw Error(ErrorKind::InvalidArgument,
                    "a Batcher needs a context with kv_unified=False (each sequence its own cells)");
    }
    if (quantum < 1) {
        throw Error(ErrorKind::InvalidArgument, "quantum must be at least 1 step");
    }
    if (prompt_step < 0) {
        throw Error(ErrorKind::InvalidArgument, "prompt_step must be >= 0 (0: n_batch)");
    }
    if (prompt_step_ == 0 || prompt_step_ > ctx->n_batch()) {
        prompt_step_ = ctx->n_batch();
    }
    // LLAMAX_NEWCOMER_PREEMPT=0: a newcomer tenant waits for the decode in
    // flight instead of aborting it (still with a step of its own), to
    // measure what the preemption buys the newcomer and costs the others
    // (benchmarks/bench_tenants.py).
    const char * preempt_env = std::getenv("LLAMAX_NEWCOMER_PREEMPT");
    preempt_newcomers_ = preempt_env == nullptr || std::string(preempt_env) != "0";
    if (prefix_chunk < 0 || prefix_chunk > ctx->n_batch()) {
        throw Error(ErrorKind::InvalidArgument, "prefix_chunk must be in [0, n_batch=" +
                                                    std::to_string(ctx->n_batch()) + "] (0: no prefix cache)");
    }
    // Recurrent and hybrid memories can't drop the tail of a sequence, which
    // the prefix cache needs: no prefix cache there.
    if (llama_model_is_recurrent(ctx->model_) || llama_model_is_hybrid(ctx->model_)) {
        prefix_chunk_ = 0;
    }
    slots_.resize(n_slots_);
    cache_.resize(n_slots_);
    // whatever the context's cells held before is not the batcher's
    llama_memory_clear(llama_get_memory(ctx->raw()), true);
    ctx_->saved_valid_ = false;  // its sequences' KV is the batcher's from here
    thread_ = std::thread([this] { run(); });
}

Batcher::~Batcher() { close(); }

void Batcher::close() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_ && !thread_.joinable()) {
            return;
        }
        stop_ = true;
    }
    closing_.store(true, std::memory_order_relaxed);  // a grammar being sampled stops between slices
    ctx_->cancel();  // a decode in progress stops within a graph node
    cv_.notify_all();
    if (thread_.joinable()) {
        thread_.join();
    }
    {
        std::lock_guard<std::mutex> lk(smu_);
        sstop_ = true;
        sjobs_.clear();
    }
    scv_.notify_all();
    for (auto & t : samplers_) {
        if (t.joinable()) {
            t.join();
        }
    }
    samplers_.clear();
}

// ---------------------------------------------------------------------------
// Sampling off the decode path

void Batcher::offload_sample(const SeqPtr & s, const float * logits) {
    s->row_.assign(logits, logits + ctx_->n_vocab());
    s->sampling_.store(1, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lk(smu_);
        sjobs_.push_back(s);
        if ((int32_t) samplers_.size() < kSamplers &&
            n_busy_samplers_ + (int32_t) sjobs_.size() > (int32_t) samplers_.size()) {
            samplers_.emplace_back([this] { sampler_loop(); });
        }
    }
    scv_.notify_one();
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.n_offloaded;
}

void Batcher::sampler_loop() {
    struct Who {
        const Batcher * b;
        const Seq * s;
    };
    auto stop = [](void * user) {
        const auto * w = static_cast<const Who *>(user);
        if (w->s->cancelled_.load(std::memory_order_relaxed) || w->b->closing_.load(std::memory_order_relaxed)) {
            throw Error(ErrorKind::Aborted, "sampling under the grammar was cancelled");
        }
    };
    for (;;) {
        SeqPtr s;
        {
            std::unique_lock<std::mutex> lk(smu_);
            scv_.wait(lk, [this] { return sstop_ || !sjobs_.empty(); });
            if (sstop_) {
                return;
            }
            s = std::move(sjobs_.front());
            sjobs_.pop_front();
            ++n_busy_samplers_;
        }
        Who who{this, s.get()};
        s->sample_failed_ = false;
        try {
            s->sampled_ = sample_logits_with(s->chain_, s->grammar_, s->row_.data(), ctx_->n_vocab(), s->cand_, stop,
                                             &who);
        } catch (const Error & e) {
            s->sample_failed_ = true;
            s->sample_kind_ = e.kind;
            s->sample_error_ = e.what();
        } catch (const std::bad_alloc &) {
            s->sample_failed_ = true;
            s->sample_kind_ = ErrorKind::OutOfMemory;
            s->sample_error_ = "out of memory while sampling under the grammar";
        } catch (const std::exception & e) {
            s->sample_failed_ = true;
            s->sample_kind_ = ErrorKind::Decode;
            s->sample_error_ = e.what();
        } catch (...) {
            s->sample_failed_ = true;
            s->sample_kind_ = ErrorKind::Decode;
            s->sample_error_ = "unknown error while sampling under the grammar";
        }
        s->sampling_.store(2, std::memory_order_release);
        {
            std::lock_guard<std::mutex> lk(smu_);
            --n_busy_samplers_;
        }
        {
            std::lock_guard<std::mutex> lk(mu_);  // (the batcher may be between its check and its wait)
        }
        cv_.notify_all();
    }
}

// On the batcher's thread, for s with sampling_ == 2: false when s ended.
bool Batcher::take_sampled(const SeqPtr & s) {
    s->sampling_.store(0, std::memory_order_relaxed);
    if (s->sample_failed_) {
        fail(s, s->sample_kind_, s->sample_error_);
        return false;
    }
    return !push_token(s, s->sampled_, s->row_.data());
}

BatcherStats Batcher::stats() {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
}

int32_t Batcher::n_active() {
    std::lock_guard<std::mutex> lk(mu_);
    int32_t n = (int32_t) pending_.size();
    for (const auto & s : slots_) {
        n += s ? 1 : 0;
    }
    return n;
}

SeqPtr Batcher::submit(llama_sampler * chain, llama_sampler * grammar, bool plain_greedy, SeqParams params) {
    const int32_t n_prompt = (int32_t) params.prompt.size();
    if (n_prompt <= 0) {
        throw Error(ErrorKind::InvalidArgument, "empty prompt: generation needs at least one token (a BOS token)");
    }
    ctx_->check_tokens(params.prompt.data(), n_prompt);
    for (const auto & s : params.stop_sequences) {
        if (s.empty()) {
            throw Error(ErrorKind::InvalidArgument, "a stop token sequence is empty");
        }
        ctx_->check_tokens(s.data(), (int32_t) s.size());
    }
    if (n_prompt > ctx_->n_ctx_seq()) {
        throw Error(ErrorKind::ContextOverflow, "prompt of " + std::to_string(n_prompt) +
                                                    " tokens does not fit in a sequence's context of " +
                                                    std::to_string(ctx_->n_ctx_seq()) +
                                                    " tokens: shorten it or raise n_ctx");
    }
    if (!params.state) {
        params.state = state_base();
    }
    if (params.n_logprobs > ctx_->n_vocab()) {
        throw Error(ErrorKind::InvalidArgument, "n_logprobs is larger than the vocabulary");
    }
    auto s = std::make_shared<Seq>();
    // The clone carries the chain's state (seed, penalties, grammar position);
    // the batcher's thread uses it alone.
    s->chain_ = llama_sampler_clone(chain);
    if (s->chain_ == nullptr) {
        throw Error(ErrorKind::InvalidArgument, "the sampler chain could not be cloned");
    }
    if (grammar != nullptr) {
        const int n = llama_sampler_chain_n(chain);
        for (int i = 0; i < n; ++i) {
            if (llama_sampler_chain_get(chain, i) == grammar) {
                s->grammar_ = llama_sampler_chain_get(s->chain_, i);
            }
        }
        if (s->grammar_ == nullptr) {
            throw Error(ErrorKind::InvalidArgument, "the grammar sampler is not in the chain");
        }
    }
    s->plain_greedy_ = plain_greedy;
    s->submit_ns_ = steady_ns();
    s->p_ = std::move(params);
    // Its state (and so its adapters) lives as long as the sequence; equal
    // states are one interned State, whose id is the group.
    s->group_ = s->p_.state->id;
    s->cv_state_ = s->p_.state->cvec ? state_intern(ctx_->model_, {}, {}, s->p_.state->cvec) : state_base();
    s->n_prompt_ = n_prompt;
    for (const auto & st : s->p_.stop_sequences) {
        s->max_stop_ = std::max(s->max_stop_, st.size());
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_) {
            throw Error(ErrorKind::Aborted, "the batcher is closed");
        }
        pending_.push_back(s);
        // a decode of a long prompt chunk in flight, a free slot for this
        // sequence, and a shorter prompt: preempt that decode (see step())
        if (decode_preemptible_ && n_prompt < decode_min_left_) {
            int32_t n_free = 0;
            for (const auto & o : slots_) {
                n_free += o ? 0 : 1;
            }
            if (n_free >= (int32_t) pending_.size()) {
                decode_preemptible_ = false;
                preempt_ = true;
                ctx_->cancel();
            }
        } else if (decode_newcomer_preemptible_ && s->p_.tenant != 0 && n_prompt <= prompt_step_) {
            // a tenant with nothing here yet, and a slot it can have
            bool known = false;
            int32_t n_free = 0;
            for (const auto & o : slots_) {
                if (o) {
                    known = known || o->p_.tenant == s->p_.tenant;
                } else {
                    ++n_free;
                }
            }
            for (const auto & o : pending_) {
                known = known || (o != s && o->p_.tenant == s->p_.tenant);
            }
            if (!known && n_free > 0) {
                decode_newcomer_preemptible_ = false;
                preempt_ = true;
                ctx_->cancel();
            }
        }
    }
    cv_.notify_all();
    return s;
}

// Under mu_: pending sequences into free slots, in pick_pending's order;
// queued ones already cancelled go to `gone`.
void Batcher::admit(std::vector<SeqPtr> & gone) {
    for (auto it = pending_.begin(); it != pending_.end();) {
        if ((*it)->cancelled_.load(std::memory_order_relaxed)) {
            gone.push_back(*it);
            it = pending_.erase(it);
        } else {
            ++it;
        }
    }
    llama_memory_t mem = llama_get_memory(ctx_->raw());
    if (forget_.exchange(false, std::memory_order_relaxed)) {
        for (int32_t i = 0; i < n_slots_; ++i) {
            if (slots_[i]) {
                slots_[i]->shareable_ = false;
            } else if (!cache_[i].tokens.empty()) {
                llama_memory_seq_rm(mem, i, -1, -1);
                cache_[i] = SlotCache();
            }
        }
    }
    while (!pending_.empty()) {
        int32_t n_free = 0;
        for (int32_t i = 0; i < n_slots_; ++i) {
            n_free += slots_[i] ? 0 : 1;
        }
        if (n_free == 0) {
            break;  // every slot runs a sequence
        }
        auto it = pick_pending(n_free);
        if (it == pending_.end()) {
            break;  // the free slots are the reserve, and no waiting tenant may take them
        }
        const int32_t i = place(*it);
        if (i < 0) {
            break;
        }
        SeqPtr s = *it;
        pending_.erase(it);
        s->seq_ = i;
        s->admit_order_.store(++n_admitted_, std::memory_order_relaxed);
        s->queued_ns_.store(steady_ns() - s->submit_ns_, std::memory_order_relaxed);
        slots_[i] = s;
    }
}

// Whether s is a newcomer tenant's short first prompt, not started (see
// last_newcomer_only_ in batcher.h): batcher thread.
bool Batcher::newcomer(const Seq & s, const std::vector<SeqPtr> & running) const {
    if (s.p_.tenant == 0 || s.n_fed_ >= s.n_prompt_ || s.n_prompt_ - s.n_fed_ > prompt_step_ ||
        s.n_fed_ != s.n_cached_.load(std::memory_order_relaxed) || !s.leader_.expired()) {
        return false;
    }
    for (const auto & o : running) {
        if (o.get() != &s && o->p_.tenant == s.p_.tenant) {
            return false;
        }
    }
    return true;
}

// Which waiting sequence gets a free slot (under mu_, batcher thread).
// Sequences of one tenant keep their order.  Among tenants: the highest
// priority first, then the tenant holding the fewest slots per unit of
// weight, then the oldest.  The last reserve_ free slots go only to a
// tenant holding fewer slots than its share would be with one more tenant
// of its weight active (n_slots * w / (sum of active weights + w)), so a
// tenant that floods the server leaves a slot free and a newcomer starts at
// once.  A sequence with max_slots waits while its tenant holds that many.
// end(): none may take one.
std::deque<SeqPtr>::iterator Batcher::pick_pending(int32_t n_free) {
    const int32_t reserve = reserve_.load(std::memory_order_relaxed);
    const uint64_t t0 = pending_.front()->p_.tenant;
    bool one_tenant = reserve == 0 && pending_.front()->p_.max_slots == 0;
    for (auto it = pending_.begin(); one_tenant && it != pending_.end(); ++it) {
        one_tenant = (*it)->p_.tenant == t0;
    }
    for (int32_t i = 0; one_tenant && i < n_slots_; ++i) {
        one_tenant = !slots_[i] || slots_[i]->p_.tenant == t0;
    }
    if (one_tenant) {
        return pending_.begin();  // first come, first served
    }
    struct Held {
        int32_t n = 0;
        double w = 1.0;
    };
    std::vector<std::pair<uint64_t, Held>> held;  // few tenants: a flat list
    auto find = [&](const Seq & s) -> Held & {
        for (auto & e : held) {
            if (e.first == s.p_.tenant) {
                return e.second;
            }
        }
        held.push_back({s.p_.tenant, Held{0, s.p_.weight > 0 ? s.p_.weight : 1.0}});
        return held.back().second;
    };
    for (int32_t i = 0; i < n_slots_; ++i) {
        if (slots_[i]) {
            find(*slots_[i]).n += 1;
        }
    }
    for (const auto & s : pending_) {
        find(*s);
    }
    double sum_w = 0.0;
    for (const auto & e : held) {
        sum_w += e.second.w;
    }
    auto best = pending_.end();
    double best_load = 0.0;
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        const Seq & s = **it;
        const Held & h = find(s);
        if (n_free <= reserve && h.n >= n_slots_ * h.w / (sum_w + h.w)) {
            continue;
        }
        if (s.p_.max_slots > 0 && h.n >= s.p_.max_slots) {
            continue;  // its tenant runs as many sequences as it may
        }
        const double load = h.n / h.w;
        if (best == pending_.end() || s.p_.priority > (*best)->p_.priority ||
            (s.p_.priority == (*best)->p_.priority && load < best_load)) {
            best = it;
            best_load = load;
        }
    }
    return best;
}

namespace {
int32_t common_prefix(const std::vector<llama_token> & a, const std::vector<llama_token> & b, int32_t limit) {
    int32_t n = 0;
    limit = std::min<int32_t>(limit, (int32_t) std::min(a.size(), b.size()));
    while (n < limit && a[n] == b[n]) {
        ++n;
    }
    return n;
}
}  // namespace

// Under mu_, on the batcher's thread (the context's mutex held).
int32_t Batcher::place(const SeqPtr & s) {
    llama_memory_t mem = llama_get_memory(ctx_->raw());
    const int32_t C = prefix_chunk_;
    // the best source of cells for the prompt's first whole chunks
    int32_t best_n = 0, best_slot = -1;
    const bool reuse = C > 0 && s->p_.cache_prompt;
    if (reuse) {
        const auto & P = s->p_.prompt;
        const int32_t limit = ((int32_t) P.size() - 1) / C * C;  // the last token is always decoded
        for (int32_t i = 0; i < n_slots_ && limit > 0; ++i) {
            int32_t n = 0;
            if (slots_[i]) {
                const Seq & o = *slots_[i];
                if (o.group_ == s->group_ && o.shareable_ && o.p_.cache_salt == s->p_.cache_salt) {
                    n = common_prefix(o.p_.prompt, P, std::min(limit, o.n_fed_)) / C * C;
                }
            } else if (!cache_[i].tokens.empty() && cache_[i].state == s->group_ &&
                       cache_[i].salt == s->p_.cache_salt) {
                n = common_prefix(cache_[i].tokens, P, limit) / C * C;
            }
            // on a tie, a free slot's own cells (no copy) win
            if (n > best_n || (n > 0 && n == best_n && !slots_[i] && slots_[best_slot])) {
                best_n = n;
                best_slot = i;
            }
        }
    }
    // a running sequence of this state still decoding a longer shared prefix:
    // follow it (wait, then copy) rather than decode that prefix again
    SeqPtr leader;
    int32_t lead_n = 0;
    if (reuse) {
        const auto & P = s->p_.prompt;
        const int32_t limit = ((int32_t) P.size() - 1) / C * C;
        for (int32_t i = 0; i < n_slots_ && limit > 0; ++i) {
            if (!slots_[i] || slots_[i]->group_ != s->group_ || !slots_[i]->shareable_ ||
                slots_[i]->p_.cache_salt != s->p_.cache_salt) {
                continue;
            }
            const Seq & o = *slots_[i];
            // what o will hold: its own prompt, and (while it follows) no more
            const int32_t n = common_prefix(o.p_.prompt, P, limit) / C * C;
            if (n > best_n && n > lead_n && o.n_fed_ < n) {
                leader = slots_[i];
                lead_n = n;
            }
        }
    }
    if (leader) {
        best_n = 0;  // one copy, of the longer prefix, once the leader has it
        best_slot = -1;
    }
    int32_t target = -1;
    if (best_slot >= 0 && !slots_[best_slot]) {
        target = best_slot;
    } else {
        // a free slot: one that keeps nothing, else the least recently kept
        for (int32_t i = 0; i < n_slots_; ++i) {
            if (slots_[i]) {
                continue;
            }
            if (target < 0 || (cache_[i].tokens.empty() && !cache_[target].tokens.empty()) ||
                (cache_[i].tokens.empty() == cache_[target].tokens.empty() && cache_[i].used < cache_[target].used)) {
                target = i;
            }
        }
    }
    if (target < 0) {
        return -1;
    }
    if (best_n > 0 && best_slot != target) {
        // whole streams only (kv_unified=false); llama.cpp copies the buffers
        // before the next decode, which is exactly when they are final
        llama_memory_seq_cp(mem, best_slot, target, -1, -1);
        ++stats_.n_seq_copies;
    }
    if (!llama_memory_seq_rm(mem, target, best_n > 0 ? best_n : -1, -1)) {
        llama_memory_seq_rm(mem, target, -1, -1);
        best_n = 0;
    }
    cache_[target] = SlotCache();
    s->n_fed_ = best_n;
    s->pos_ = best_n;
    s->n_cached_.store(best_n, std::memory_order_relaxed);
    stats_.n_cached_tokens += best_n;
    if (leader) {
        s->leader_ = leader;
        s->share_n_ = lead_n;
    }
    return target;
}

// Applies what `group` needs; true if that is several adapter sets in one
// decode (patch 0004).  The union of the group's adapters is taken over all
// its running sequences (not only this batch's), so it changes only as
// sequences come and go.
bool Batcher::apply_group_state(const std::vector<SeqPtr> & group) {
    const StatePtr & first = group.front()->p_.state;
    bool same = true;
    for (const auto & s : group) {
        same = same && s->p_.state == first;
    }
    if (same || !mix_active()) {
        ctx_->set_state(first);
        return false;
    }
    std::vector<AdapterPtr> ads;
    for (const auto & s : group) {
        for (const auto & p : s->p_.state->adapters) {
            if (std::find(ads.begin(), ads.end(), p.first) == ads.end()) {
                ads.push_back(p.first);
            }
        }
    }
    // the canonical order Context::set_state uses (see there)
    std::sort(ads.begin(), ads.end(), [](const AdapterPtr & a, const AdapterPtr & b) {
        return std::less<llama_adapter_lora *>()(a->ptr, b->ptr);
    });
    if (ads.empty()) {  // (equal control vectors, no adapters: one state after all)
        ctx_->set_state(group.front()->cv_state_);
        return false;
    }
    scale_buf_.assign(ads.size() * (size_t) n_slots_, 0.0f);
    for (const auto & s : group) {
        for (const auto & p : s->p_.state->adapters) {
            const size_t a = (size_t) (std::find(ads.begin(), ads.end(), p.first) - ads.begin());
            scale_buf_[a * (size_t) n_slots_ + (size_t) s->seq_] = p.second;
        }
    }
    ctx_->set_state_per_seq(group.front()->cv_state_, ads, scale_buf_);
    return true;
}

// On the batcher's thread, before s's prompt chunk goes into a batch.
bool Batcher::follow(const SeqPtr & s) {
    if (s->share_n_ <= 0) {
        return true;
    }
    SeqPtr L = s->leader_.lock();
    if (!L || L->seq_ < 0 || !L->shareable_ || L->group_ != s->group_ || L->p_.cache_salt != s->p_.cache_salt) {
        // the leader is gone (ended, cancelled, forgotten): decode it ourselves
        s->leader_.reset();
        s->share_n_ = 0;
        return true;
    }
    if (L->n_fed_ < s->share_n_) {
        return false;  // not decoded yet: wait a step
    }
    if (s->n_fed_ < s->share_n_) {
        llama_memory_t mem = llama_get_memory(ctx_->raw());
        llama_memory_seq_cp(mem, L->seq_, s->seq_, -1, -1);
        if (!llama_memory_seq_rm(mem, s->seq_, s->share_n_, -1)) {
            llama_memory_seq_rm(mem, s->seq_, -1, -1);  // (decode it ourselves)
            s->leader_.reset();
            s->share_n_ = 0;
            return true;
        }
        std::lock_guard<std::mutex> lk(mu_);
        stats_.n_cached_tokens += s->share_n_ - s->n_fed_;
        ++stats_.n_seq_copies;
        s->n_fed_ = s->pos_ = s->share_n_;
        s->n_cached_.store(s->share_n_, std::memory_order_relaxed);
    }
    s->leader_.reset();
    s->share_n_ = 0;
    return true;
}

void Batcher::release_slot(const SeqPtr & s, bool keep_prefix) {
    if (s->seq_ >= 0) {
        const int32_t C = prefix_chunk_;
        int32_t keep = keep_prefix && C > 0 && s->shareable_ ? std::min(s->n_fed_, s->n_prompt_) / C * C : 0;
        llama_memory_t mem = llama_get_memory(ctx_->raw());
        if (!llama_memory_seq_rm(mem, s->seq_, keep > 0 ? keep : -1, -1)) {
            llama_memory_seq_rm(mem, s->seq_, -1, -1);
            keep = 0;
        }
        std::lock_guard<std::mutex> lk(mu_);
        if (keep > 0) {
            cache_[s->seq_].tokens.assign(s->p_.prompt.begin(), s->p_.prompt.begin() + keep);
            cache_[s->seq_].state = s->group_;
            cache_[s->seq_].salt = s->p_.cache_salt;
            cache_[s->seq_].used = ++tick_;
        }
        slots_[s->seq_].reset();
        s->seq_ = -1;
        ++stats_.n_finished;
    }
}

void Batcher::fail_all(std::vector<SeqPtr> & seqs, ErrorKind k, const std::string & msg) {
    for (const auto & s : seqs) {
        if (s) {
            fail(s, k, msg);
        }
    }
}

void Batcher::notify(const SeqPtr & s) {
    s->cv_.notify_all();
    const int fd = notify_fd_.load(std::memory_order_relaxed);
    if (fd >= 0 && s->notify_.load(std::memory_order_relaxed)) {
        const char byte = 1;
        // non-blocking: a full pipe already holds a wake-up for the reader
        ssize_t rc = ::write(fd, &byte, 1);
        (void) rc;
    }
}

void Batcher::end(const SeqPtr & s, Finish f) {
    release_slot(s, true);
    s->p_.state.reset();  // its adapters may be freed now (if nothing else holds them)
    {
        std::lock_guard<std::mutex> lk(s->mu_);
        s->finish_ = f;
        s->done_ = true;
    }
    notify(s);
}

void Batcher::fail(const SeqPtr & s, ErrorKind k, const std::string & msg) {
    release_slot(s, false);  // (its cells may be half-written)
    s->p_.state.reset();  // its adapters may be freed now (if nothing else holds them)
    {
        std::lock_guard<std::mutex> lk(s->mu_);
        s->failed_ = true;
        s->error_kind_ = k;
        s->error_ = msg;
        s->done_ = true;
    }
    notify(s);
}

// Hand one sampled token to its consumer; true when the sequence is over.
bool Batcher::push_token(const SeqPtr & s, llama_token tok, const float * logits) {
    const SeqParams & p = s->p_;
    if (!p.ignore_eos && llama_vocab_is_eog(ctx_->vocab_, tok)) {
        end(s, Finish::Eog);
        return true;
    }
    SeqEvent ev;
    ev.token = tok;
    if (p.n_logprobs >= 0) {
        token_logprobs(logits, ctx_->n_vocab(), tok, p.n_logprobs, lp_buf_, ev.logprob, ev.top);
    }
    {
        std::lock_guard<std::mutex> lk(s->mu_);
        s->events_.push_back(std::move(ev));
    }
    notify(s);
    ++s->n_generated_;
    if (s->max_stop_ > 0) {
        s->tail_.push_back(tok);
        if (s->tail_.size() > s->max_stop_) {
            s->tail_.erase(s->tail_.begin());
        }
        for (const auto & st : p.stop_sequences) {
            if (s->tail_.size() >= st.size() &&
                std::equal(st.begin(), st.end(), s->tail_.end() - (ptrdiff_t) st.size())) {
                end(s, Finish::StopSequence);
                return true;
            }
        }
    }
    if (p.max_tokens >= 0 && s->n_generated_ >= p.max_tokens) {
        end(s, Finish::Length);
        return true;
    }
    // prompt + output never exceed the context (the next token would need a
    // cell at pos_ + 1), as llama-cpp-python and OpenAI count
    if (s->pos_ + 1 >= ctx_->n_ctx_seq()) {
        end(s, Finish::ContextFull);
        return true;
    }
    s->next_ = tok;
    return false;
}

void Batcher::run() {
    std::vector<SeqPtr> running;
    for (;;) {
        {
            std::unique_lock<std::mutex> lk(mu_);
            // work: a queued sequence and a slot for it, or a running
            // sequence whose token is not still being sampled
            auto has_work = [this] {
                if (stop_) {
                    return true;
                }
                bool free_slot = false;
                for (const auto & s : slots_) {
                    if (!s) {
                        free_slot = true;
                    } else if (s->sampling_.load(std::memory_order_acquire) != 1 ||
                               s->cancelled_.load(std::memory_order_relaxed)) {
                        return true;
                    }
                }
                return free_slot && !pending_.empty();
            };
            if (!has_work()) {
                lk.unlock();
                release_orphaned_state();
                lk.lock();
            }
            cv_.wait(lk, has_work);
            if (stop_) {
                break;
            }
        }
        std::lock_guard<std::mutex> ctx_lock(ctx_->mutex());
        std::vector<SeqPtr> gone;
        {
            std::lock_guard<std::mutex> lk(mu_);
            admit(gone);
            running.clear();
            for (const auto & s : slots_) {
                if (s) {
                    running.push_back(s);
                }
            }
        }
        // cancelled sequences leave first
        for (const auto & s : gone) {
            end(s, Finish::Cancelled);
        }
        for (auto & s : running) {
            if (s->cancelled_.load(std::memory_order_relaxed)) {
                end(s, Finish::Cancelled);
                s.reset();
            }
        }
        running.erase(std::remove(running.begin(), running.end(), nullptr), running.end());
        // Tokens sampled off the decode path: while others could decode, a
        // token still in flight is waited for a little (a quarter of the
        // last decode's time), then the decode goes ahead without it.
        size_t n_flight = 0;
        for (const auto & s : running) {
            n_flight += s->sampling_.load(std::memory_order_acquire) == 1 ? 1 : 0;
        }
        if (n_flight > 0 && n_flight < running.size()) {
            const auto patience = std::chrono::duration<double>(std::min(0.05, std::max(0.0005, last_decode_s_ / 4)));
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait_for(lk, patience, [&] {
                if (stop_) {
                    return true;
                }
                for (const auto & s : running) {
                    if (s->sampling_.load(std::memory_order_acquire) == 1) {
                        return false;
                    }
                }
                return true;
            });
        }
        try {
            // (inside the try: nothing may escape this thread, or the process ends)
            for (auto & s : running) {
                if (s->sampling_.load(std::memory_order_acquire) == 2 && !take_sampled(s)) {
                    s.reset();
                }
            }
            running.erase(std::remove(running.begin(), running.end(), nullptr), running.end());
            bool any_ready = false;
            for (const auto & s : running) {
                any_ready = any_ready || s->sampling_.load(std::memory_order_relaxed) == 0;
            }
            if (any_ready) {  // (else all of them are in flight: the wait at the top sleeps until one is back)
                step(running);
            }
        } catch (const Error & e) {
            fail_all(running, e.kind, e.what());
        } catch (const std::bad_alloc &) {
            fail_all(running, ErrorKind::OutOfMemory, "out of memory in the batcher");
        } catch (const std::exception & e) {
            fail_all(running, ErrorKind::Decode, e.what());
        } catch (...) {
            fail_all(running, ErrorKind::Decode, "unknown error in the batcher");
        }
    }
    // closing: every sequence, queued or running, ends with an error
    std::vector<SeqPtr> all;
    {
        std::lock_guard<std::mutex> lk(mu_);
        all.assign(pending_.begin(), pending_.end());
        pending_.clear();
        for (const auto & s : slots_) {
            if (s) {
                all.push_back(s);
            }
        }
    }
    std::lock_guard<std::mutex> ctx_lock(ctx_->mutex());
    for (const auto & s : all) {
        fail(s, ErrorKind::Aborted, "the batcher was closed while this request ran");
    }
    try {
        ctx_->set_state(nullptr);  // the context goes back with the base model applied
    } catch (...) {
    }
    // ... and with no cells: what the prefix cache kept is nobody's now
    llama_memory_clear(llama_get_memory(ctx_->raw()), true);
    ctx_->saved_valid_ = false;
    {
        std::lock_guard<std::mutex> lk(mu_);
        for (auto & c : cache_) {
            c = SlotCache();
        }
    }
    sched_.have = false;
}

void Batcher::release_orphaned_state() {
    // Idle, with a state applied whose adapters nothing else holds (they
    // were unloaded, and their last sequence has ended): apply the base
    // state so that they are freed now rather than at the next switch.
    std::lock_guard<std::mutex> ctx_lock(ctx_->mutex());
    if (ctx_->det_applied()) {
        // (deterministic mode: a plain state applied per sequence; its
        // adapters are held by it and by the per-sequence set)
        const StatePtr & st = ctx_->applied_state();
        if (st.use_count() != 1) {
            return;
        }
        for (const auto & p : st->adapters) {
            if (p.first.use_count() != 2) {
                return;
            }
        }
    } else if (ctx_->per_seq()) {
        for (const auto & a : ctx_->per_seq_adapters_) {
            if (a.use_count() != 1) {
                return;
            }
        }
    } else {
        const StatePtr & st = ctx_->state();
        if (st->adapters.empty() || st.use_count() != 1) {
            return;
        }
        for (const auto & p : st->adapters) {
            if (p.first.use_count() != 1) {
                return;
            }
        }
    }
    try {
        ctx_->set_state(nullptr);
    } catch (...) {
        return;  // (kept: the next switch frees them)
    }
    sched_.have = false;
}

// One step: which group runs and what goes into its decode (plain-data
// decisions, batch_plan.h), the decode, then each sequence advanced.
void Batcher::step(std::vector<SeqPtr> & running) {
    struct ClearSkip {  // skip_mix_ holds for one step
        bool & flag;
        bool was;
        ~ClearSkip() { if (was) flag = false; }
    } clear_skip{skip_mix_, skip_mix_};
    // (a sequence whose token is still being sampled sits this step out)
    auto ready = [](const Seq & s) { return s.sampling_.load(std::memory_order_relaxed) == 0; };

    // 1. The group: the state whose sequences this decode serves.
    views_.clear();
    for (const auto & s : running) {
        views_.push_back({s->seq_, sched_key(*s), ready(*s)});
    }
    if (plan::pick_group(views_, n_slots_, quantum_, sched_)) {
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.n_switches;
    }
    std::vector<SeqPtr> group;
    bool multi = false;  // this decode serves several adapter sets
    for (const auto & s : running) {
        if (sched_key(*s) == sched_.cur) {
            group.push_back(s);
        }
    }
    try {
        // no-ops when the context has this state applied already
        multi = apply_group_state(group);
    } catch (const Error & e) {
        fail_all(group, e.kind, e.what());
        sched_.have = false;
        return;
    } catch (const std::exception & e) {
        fail_all(group, ErrorKind::Decode, e.what());
        sched_.have = false;
        return;
    }

    // 2. The batch.
    plan::BatchPolicy pol;
    pol.budget = ctx_->n_batch();
    pol.prompt_step = prompt_step_;
    pol.prefix_chunk = prefix_chunk_;
    pol.align = prefix_chunk_ > 0 && prefix_align_;
    {
        std::lock_guard<std::mutex> lk(mu_);
        pol.alone = running.size() == 1 && pending_.empty();
    }
    pol.newcomer_steps = reserve_.load(std::memory_order_relaxed) > 0 && !last_newcomer_only_;
    pol.last_shorts_only = last_shorts_only_;
    members_.clear();
    for (const auto & s : group) {
        plan::Member m;
        m.seq = s->seq_;
        m.ready = ready(*s);
        m.newcomer = pol.newcomer_steps && newcomer(*s, running);
        m.next = s->next_;
        m.pos = s->pos_;
        m.n_fed = s->n_fed_;
        m.n_prompt = s->n_prompt_;
        m.prompt = s->p_.prompt.data();
        members_.push_back(m);
        s->batch_row_ = -1;
    }
    plan::compose_batch(members_, pol, [&](int32_t i, plan::Member & m) {
        const SeqPtr & s = group[(size_t) i];
        if (!follow(s)) {
            return false;
        }
        m.n_fed = s->n_fed_;  // (a follower's cells copied from its leader)
        m.pos = s->pos_;
        return true;
    }, plan_);
    last_newcomer_only_ = plan_.newcomer_step;
    last_shorts_only_ = plan_.shorts_only;
    if (plan_.newcomer_step) {
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.n_newcomer_steps;
    }
    std::vector<SeqPtr> in_batch;
    for (const auto & part : plan_.parts) {
        const SeqPtr & s = group[(size_t) part.member];
        s->chunk_ = part.chunk;
        s->batch_row_ = part.row;
        in_batch.push_back(s);
    }
    if (plan_.tok.empty()) {
        return;
    }

    // 3. The decode; 4. each sequence advanced (and sampled).
    if (decode(running, in_batch, multi, plan_.newcomer_step)) {
        advance(in_batch);
    }
}

// The planned batch through llama_decode, with preemption and its failures
// handled; true when it was decoded (the sequences advance).
bool Batcher::decode(const std::vector<SeqPtr> & running, std::vector<SeqPtr> & in_batch, bool multi,
                     bool newcomer_step) {
    auto ready = [](const Seq & s) { return s.sampling_.load(std::memory_order_relaxed) == 0; };
    const int32_t n_tok = (int32_t) plan_.tok.size();
    nseq_buf_.assign(n_tok, 1);
    seqp_buf_.resize(n_tok);
    for (int32_t i = 0; i < n_tok; ++i) {
        seqp_buf_[i] = &plan_.seq[i];
    }
    const int32_t n_out = plan_.n_out;
    const bool long_chunk = plan_.long_chunk;
    llama_batch b = {n_tok, plan_.tok.data(), nullptr, plan_.pos.data(), nseq_buf_.data(), seqp_buf_.data(),
                     plan_.out.data()};
    ctx_->abort_.store(false, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lk(mu_);
        decode_preemptible_ = long_chunk && !just_preempted_ && !stop_;
        decode_newcomer_preemptible_ = preempt_newcomers_ && !long_chunk && !newcomer_step && !just_preempted_ &&
                                       !stop_ && reserve_.load(std::memory_order_relaxed) > 0;
        decode_min_left_ = plan_.min_left;
        preempt_ = false;
    }
    just_preempted_ = false;
    const auto t_decode = std::chrono::steady_clock::now();
    try {
        ctx_->raw_decode(b, n_out);
    } catch (const std::exception & e) {
        bool preempted, closing;
        {
            std::lock_guard<std::mutex> lk(mu_);
            decode_preemptible_ = false;
            decode_newcomer_preemptible_ = false;
            closing = stop_;
            preempted = preempt_ && !stop_;
            preempt_ = false;
            const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_decode).count();
            stats_.decode_s += spent;
            if (preempted) {
                ++stats_.n_preempted;
                stats_.preempted_s += spent;
            }
        }
        if (preempted) {
            // Aborted for a newcomer with a shorter prompt (or of a tenant
            // with nothing running: see last_newcomer_only_): llama.cpp dropped
            // the aborted ubatch's cells; drop anything else of this batch
            // and redo it later, nothing advanced.
            ctx_->abort_.store(false, std::memory_order_relaxed);
            for (const auto & s : in_batch) {
                llama_memory_seq_rm(llama_get_memory(ctx_->raw()), s->seq_, s->pos_, -1);
            }
            just_preempted_ = true;
            last_shorts_only_ = false;
            return false;
        }
        if (closing) {  // close() aborted it
            fail_all(in_batch, ErrorKind::Aborted, "the batcher was closed while this request ran");
            return false;
        }
        if (multi) {
            // A mixed decode failed: drop what this batch may have written and
            // run the next step by whole state (a real error then fails the
            // sequences there).  Twice in a row without a mixed decode that
            // worked between: the graph can't mix adapter sets (patch 0004
            // met rows it can't attribute to sequences): stop mixing.
            for (const auto & s : in_batch) {
                llama_memory_seq_rm(llama_get_memory(ctx_->raw()), s->seq_, s->pos_, -1);
            }
            if (++mix_failures_ >= 2) {
                mix_ = false;
            }
            skip_mix_ = true;
            sched_.have = false;
            return false;
        }
        if (const auto * err = dynamic_cast<const Error *>(&e)) {
            fail_all(in_batch, err->kind, e.what());
        } else if (dynamic_cast<const std::bad_alloc *>(&e) != nullptr) {
            fail_all(in_batch, ErrorKind::OutOfMemory, "out of memory in llama_decode");
        } else {
            // llama.cpp throws from its graph reserve (e.g. "failed to allocate
            // compute pp buffers" after a state switch under memory pressure)
            fail_all(in_batch, classify_log(e.what(), ErrorKind::Decode), e.what());
        }
        return false;
    }
    last_decode_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_decode).count();
    {
        std::lock_guard<std::mutex> lk(mu_);
        decode_preemptible_ = false;
        decode_newcomer_preemptible_ = false;
        if (preempt_) {  // (too late: the decode was done)
            preempt_ = false;
            ctx_->abort_.store(false, std::memory_order_relaxed);
        }
        ++stats_.n_decodes;
        stats_.decode_s += last_decode_s_;
        if (newcomer_step) {
            stats_.newcomer_s += last_decode_s_;
        }
        for (const auto & s : running) {
            if (!ready(*s)) {
                ++stats_.n_sat_out;
                break;
            }
        }
        stats_.n_tokens += n_tok;
        stats_.n_seq_decoded += (int64_t) in_batch.size();
        // an independent check of the grouping: every sequence's own state
        // is the one the context has applied -- with adapter sets mixed, its
        // control vector is, and every adapter it names is in the applied union
        if (multi) {
            ++stats_.n_multi_adapter_decodes;
            mix_failures_ = 0;
        }
        for (const auto & s : in_batch) {
            if (multi ? s->cv_state_ != ctx_->state() || !ctx_->per_seq_covers(*s->p_.state, s->seq_)
                      : s->p_.state != ctx_->applied_state() || (ctx_->per_seq() && !ctx_->det_applied())) {
                ++stats_.n_mixed_decodes;
                break;
            }
        }
    }
    return true;
}

// Positions moved on past the decoded tokens; each sequence with an output
// row sampled (or handed to a sampler thread).
void Batcher::advance(const std::vector<SeqPtr> & in_batch) {
    for (const auto & s : in_batch) {
        if (s->n_fed_ < s->n_prompt_) {
            s->n_fed_ += s->chunk_;
            s->pos_ += s->chunk_;
        } else {
            s->pos_ += 1;
        }
        if (s->batch_row_ < 0) {
            continue;
        }
        if (s->p_.max_tokens == 0) {
            end(s, Finish::Length);
            continue;
        }
        const float * lg = llama_get_logits_ith(ctx_->raw(), s->batch_row_);
        if (lg == nullptr) {
            fail(s, ErrorKind::Decode, "no logits after decode: " + take_last_log_error());
            continue;
        }
        llama_token tok;
        try {
            if (s->plain_greedy_) {
                tok = greedy_pick(lg, ctx_->n_vocab());
                llama_sampler_accept(s->chain_, tok);
            } else if (s->grammar_ != nullptr) {
                offload_sample(s, lg);  // its token comes back through take_sampled
                continue;
            } else {
                tok = ctx_->sample_chain(s->chain_, s->grammar_, lg);
            }
        } catch (const Error & e) {
            fail(s, e.kind, e.what());
            continue;
        } catch (const std::exception & e) {
            fail(s, ErrorKind::Decode, e.what());
            continue;
        }
        push_token(s, tok, lg);
    }
}

}  // namespace llamax
