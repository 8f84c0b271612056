// llamax shim implementation.  See llamax.h for what each piece is for.
#include "llamax.h"

#include "ggml.h"
#include "gguf.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <atomic>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <csignal>
#include <sys/stat.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <exception>

namespace llamax {

// ---------------------------------------------------------------------------
// Logging

namespace {

std::atomic<log_sink_fn> g_sink{nullptr};
std::atomic<int> g_min_level{GGML_LOG_LEVEL_NONE + 100};  // nothing forwarded
thread_local std::string t_last_error;
thread_local int t_prev_level = GGML_LOG_LEVEL_INFO;
thread_local std::string t_pending;  // a record being assembled from CONT pieces

void log_callback(ggml_log_level level, const char * text, void *) {
    if (text == nullptr) {
        return;
    }
    int lvl = level == GGML_LOG_LEVEL_CONT ? t_prev_level : (int) level;
    // An aborted decode (ret 2) is always one its caller asked for -- a
    // cancel, a close, the batcher preempting a long prompt's chunk, Ctrl-C
    // -- and raised as a typed error or redone: not an error for the log,
    // nor the note that the aborted ubatch's cells were dropped.
    if (level != GGML_LOG_LEVEL_CONT && (lvl == GGML_LOG_LEVEL_ERROR || lvl == GGML_LOG_LEVEL_WARN) &&
        (std::strstr(text, "failed to decode, ret = 2") != nullptr ||
         std::strstr(text, "ggml_backend_sched_graph_compute_async failed with error 1\n") != nullptr ||
         std::strstr(text, "failed to compute graph, compute status: 1\n") != nullptr ||  // GGML_STATUS_ABORTED
         std::strstr(text, "removing memory module entries for seq_id") != nullptr)) {
        lvl = GGML_LOG_LEVEL_DEBUG;
    }
    t_prev_level = lvl;
    if (lvl == GGML_LOG_LEVEL_ERROR) {
        // Loaders log why they failed, then return NULL: keep the reasons for
        // the exception message.  Every error record since the last take is
        // kept (bounded): the cause comes first and a generic "failed to
        // load model" last, and the error's kind is read off the cause.
        if (level != GGML_LOG_LEVEL_CONT && !t_last_error.empty() && t_last_error.back() != '\n') {
            t_last_error += '\n';
        }
        t_last_error += text;
        if (t_last_error.size() > 8192) {
            t_last_error.erase(0, t_last_error.size() - 4096);
        }
    }
    log_sink_fn sink = g_sink.load(std::memory_order_acquire);
    if (sink == nullptr || lvl < g_min_level.load(std::memory_order_relaxed)) {
        return;
    }
    // llama.cpp writes one record in pieces; forward whole lines only.
    t_pending += text;
    size_t nl;
    while ((nl = t_pending.find('\n')) != std::string::npos) {
        std::string line = t_pending.substr(0, nl);
        t_pending.erase(0, nl + 1);
        if (!line.empty()) {
            sink(lvl, line.c_str());
        }
    }
}

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
        s.pop_back();
    }
    return s;
}

std::string with_reason(const std::string & msg) {
    std::string why = trim(take_last_log_error());
    return why.empty() ? msg : msg + " (llama.cpp: " + why + ")";
}

}  // namespace

ErrorKind classify_log(const std::string & why, ErrorKind fallback) {
    for (const auto & p : kLogPhrases) {
        if (why.find(p.text) != std::string::npos) {
            return p.kind;
        }
    }
    return fallback;
}

std::string take_last_log_error() {
    std::string s;
    s.swap(t_last_error);
    // one line: records joined with "; " (trailing newlines dropped)
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
        s.pop_back();
    }
    for (size_t i = 0; (i = s.find('\n', i)) != std::string::npos;) {
        s.replace(i, 1, "; ");
    }
    return s;
}

void log_install(log_sink_fn sink) {
    g_sink.store(sink, std::memory_order_release);
    llama_log_set(log_callback, nullptr);
}

void log_set_min_level(int level) { g_min_level.store(level, std::memory_order_relaxed); }

// ---------------------------------------------------------------------------
// Files

void check_gguf_file(const std::string & path) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
        int e = errno;
        throw Error(ErrorKind::Load, path + ": " + std::strerror(e), e);
    }
    if (S_ISDIR(st.st_mode)) {
        throw Error(ErrorKind::Load, path + ": is a directory, expected a .gguf file", EISDIR);
    }
    if (!S_ISREG(st.st_mode)) {
        throw Error(ErrorKind::Load, path + ": not a regular file", EINVAL);
    }
    FILE * f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) {
        int e = errno;
        throw Error(ErrorKind::Load, path + ": " + std::strerror(e), e);
    }
    char magic[4] = {0, 0, 0, 0};
    size_t got = std::fread(magic, 1, 4, f);
    std::fclose(f);
    if (got < 4) {
        throw Error(ErrorKind::InvalidGGUF,
                    path + ": not a GGUF file (" + std::to_string(st.st_size) + " bytes, too short for the header)");
    }
    if (std::memcmp(magic, "GGUF", 4) != 0) {
        throw Error(ErrorKind::InvalidGGUF, path + ": not a GGUF file (bad magic; expected 'GGUF')");
    }
}

namespace {

// A GGUF's metadata only (no tensor data, no ggml context), freed on scope
// exit; gguf's parser validates the header and returns NULL on what it rejects.
struct GgufMeta {
    gguf_context * g = nullptr;
    GgufMeta(const std::string & path, const std::string & what) {
        gguf_init_params params = {/*no_alloc=*/true, /*ctx=*/nullptr};
        take_last_log_error();
        g = gguf_init_from_file(path.c_str(), params);
        if (g == nullptr) {
            throw Error(ErrorKind::InvalidGGUF, with_reason(path + ": cannot read " + what));
        }
    }
    ~GgufMeta() { gguf_free(g); }
    GgufMeta(const GgufMeta &) = delete;
    GgufMeta & operator=(const GgufMeta &) = delete;
};

}  // namespace

bool check_model_gguf(const std::string & path) {
    GgufMeta meta(path, "model (corrupt or unsupported GGUF)");
    gguf_context * g = meta.g;
    // llama.cpp asserts (aborts the process) on a vocabulary with a repeated
    // token string (llama-vocab.cpp: id_to_token.size() == token_to_id.size();
    // found by tools/fuzz.py): refuse it here.
    const int64_t key = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (key >= 0 && gguf_get_kv_type(g, key) == GGUF_TYPE_ARRAY && gguf_get_arr_type(g, key) == GGUF_TYPE_STRING) {
        const size_t n = gguf_get_arr_n(g, key);
        std::unordered_set<std::string_view> seen;
        seen.reserve(n);
        for (size_t i = 0; i < n; ++i) {
            const char * tok = gguf_get_arr_str(g, key, i);
            if (!seen.emplace(tok).second) {
                throw Error(ErrorKind::InvalidGGUF, path + ": the vocabulary lists token " + std::to_string(i) +
                                                        " ('" + std::string(tok).substr(0, 40) +
                                                        "') twice: corrupt tokenizer.ggml.tokens");
            }
        }
    }
    // llama.cpp asserts 0 < n_layer <= LLAMA_MAX_LAYERS (512) while loading.
    const int64_t arch_key = gguf_find_key(g, "general.architecture");
    if (arch_key >= 0 && gguf_get_kv_type(g, arch_key) == GGUF_TYPE_STRING) {
        const std::string bc = std::string(gguf_get_val_str(g, arch_key)) + ".block_count";
        const int64_t k = gguf_find_key(g, bc.c_str());
        if (k >= 0) {
            const gguf_type t = gguf_get_kv_type(g, k);
            int64_t v = -1;
            if (t == GGUF_TYPE_UINT32) {
                v = gguf_get_val_u32(g, k);
            } else if (t == GGUF_TYPE_INT32) {
                v = gguf_get_val_i32(g, k);
            } else if (t == GGUF_TYPE_UINT64) {
                v = (int64_t) std::min<uint64_t>(gguf_get_val_u64(g, k), INT64_MAX);
            } else if (t == GGUF_TYPE_INT64) {
                v = gguf_get_val_i64(g, k);
            }
            if (v != -1 && (v < 1 || v > 512)) {
                throw Error(ErrorKind::InvalidGGUF, path + ": " + bc + " = " + std::to_string(v) +
                                                        " is outside [1, 512]: corrupt model header");
            }
        }
    }
    return gguf_find_tensor(g, "position_embd.weight") >= 0;
}

// ---------------------------------------------------------------------------
// Adapters

namespace {

// llama.cpp's adapter loader reads these keys with gguf_get_val_* and no type
// check: a key of another type asserts (aborts).  Found by tools/fuzz.py.
void check_adapter_kv_types(const std::string & path) {
    GgufMeta meta(path, "LoRA adapter GGUF");
    gguf_context * g = meta.g;
    const std::pair<const char *, gguf_type> expected[] = {
        {"general.type", GGUF_TYPE_STRING},
        {"general.architecture", GGUF_TYPE_STRING},
        {"adapter.type", GGUF_TYPE_STRING},
        {"adapter.lora.alpha", GGUF_TYPE_FLOAT32},
    };
    for (const auto & [key, type] : expected) {
        const int64_t id = gguf_find_key(g, key);
        if (id >= 0 && gguf_get_kv_type(g, id) != type) {
            throw Error(ErrorKind::InvalidGGUF, path + ": '" + key + "' has type " +
                                                    gguf_type_name(gguf_get_kv_type(g, id)) + ", expected " +
                                                    gguf_type_name(type));
        }
    }
}

}  // namespace

namespace {
std::mutex owned_mutex;
std::unordered_set<const void *> owned_set;
}  // namespace

void owned_add(const void * p) {
    std::lock_guard<std::mutex> lock(owned_mutex);
    owned_set.insert(p);
}

void owned_remove(const void * p) {
    std::lock_guard<std::mutex> lock(owned_mutex);
    owned_set.erase(p);
}

bool owned_has(const void * p) {
    std::lock_guard<std::mutex> lock(owned_mutex);
    return owned_set.count(p) != 0;
}

ModelPtr model_own(llama_model * model) {
    owned_add(model);
    return ModelPtr(model, [](llama_model * m) {
        packed::forget(m);
        owned_remove(m);
        llama_model_free(m);
    });
}

Adapter::~Adapter() {
    if (ptr != nullptr) {
        owned_remove(ptr);
        llama_adapter_lora_free(ptr);  // erases it from the model's set (patch 0003: any thread)
    }
}

namespace {

// Adapters' and control vectors' serials: unique for the process's life.
uint64_t next_serial() {
    static std::atomic<uint64_t> n{0};
    return n.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace

AdapterPtr adapter_load(const ModelPtr & model, const std::string & path) {
    check_gguf_file(path);
    check_adapter_kv_types(path);
    take_last_log_error();
    llama_adapter_lora * p = llama_adapter_lora_init(model.get(), path.c_str());
    if (p == nullptr) {
        std::string why = trim(take_last_log_error());
        const ErrorKind kind = classify_log(why, ErrorKind::InvalidGGUF);
        throw Error(kind, path + ": cannot load LoRA adapter for this model" +
                              (why.empty() ? std::string() : ": " + why));
    }
    auto a = std::make_shared<Adapter>();
    owned_add(p);
    a->ptr = p;
    a->model = model;
    a->path = path;
    a->serial = next_serial();
    return a;
}

// ---------------------------------------------------------------------------
// State interning

namespace {

struct StateTable {
    std::mutex mu;
    uint64_t next_id = 1;
    // hash of the contents -> the states with that hash (weak: a state lives
    // as long as its holders; expired entries are swept as the table grows)
    std::unordered_multimap<uint64_t, std::weak_ptr<const State>> map;
    size_t sweep_at = 64;
    // the contents' signature (adapter serials and scale bits, then the
    // control vector's serial) -> the id states of those contents get, kept
    // after the states are gone; forgotten all at once past kMaxIds (ids
    // then change: prefix-cache misses, never a wrong match)
    std::map<std::vector<uint64_t>, uint64_t> ids;
    static constexpr size_t kMaxIds = 1 << 14;
};

StateTable & state_table() {
    static StateTable * t = new StateTable();  // never destroyed: states may die during exit
    return *t;
}

bool same_contents(const State & st, const std::vector<AdapterPtr> & adapters, const std::vector<float> & scales,
                   const ControlVectorPtr & cvec) {
    if (st.adapters.size() != adapters.size()) {
        return false;
    }
    for (size_t i = 0; i < adapters.size(); ++i) {
        if (st.adapters[i].first != adapters[i] ||
            std::memcmp(&st.adapters[i].second, &scales[i], sizeof(float)) != 0) {
            return false;
        }
    }
    if (st.cvec == cvec) {
        return true;
    }
    return st.cvec && cvec && st.cvec->same_as(*cvec);
}

}  // namespace

const StatePtr & state_base() {
    static const StatePtr * base = new StatePtr(std::make_shared<State>());  // id 0, never freed
    return *base;
}

StatePtr state_intern(const llama_model * model, const std::vector<AdapterPtr> & adapters,
                      const std::vector<float> & scales, const ControlVectorPtr & cvec) {
    if (adapters.size() != scales.size()) {
        throw Error(ErrorKind::InvalidArgument, "one scale per adapter is needed");
    }
    for (size_t i = 0; i < adapters.size(); ++i) {
        const AdapterPtr & a = adapters[i];
        if (!a || a->ptr == nullptr) {
            throw Error(ErrorKind::InvalidArgument, "adapter " + std::to_string(i) + " is closed");
        }
        if (a->model.get() != model) {
            throw Error(ErrorKind::AdapterMismatch, "adapter " + a->path + " was loaded for another model");
        }
        if (!std::isfinite(scales[i])) {
            throw Error(ErrorKind::InvalidArgument, "adapter scale must be finite");
        }
        for (size_t j = 0; j < i; ++j) {
            if (adapters[j] == a) {
                throw Error(ErrorKind::InvalidArgument, "adapter " + a->path + " appears twice in one set");
            }
        }
    }
    if (cvec && cvec->n_embd != llama_model_n_embd(model)) {
        throw Error(ErrorKind::ControlVector, "control vector n_embd " + std::to_string(cvec->n_embd) +
                                                  " != model n_embd " + std::to_string(llama_model_n_embd(model)));
    }
    if (adapters.empty() && !cvec) {
        return state_base();
    }
    uint64_t h = cvec ? cvec->hash : 0;
    for (size_t i = 0; i < adapters.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &scales[i], sizeof bits);
        h = (h ^ (uint64_t) (uintptr_t) adapters[i].get()) * 1099511628211ull;
        h = (h ^ bits) * 1099511628211ull;
    }
    StateTable & t = state_table();
    std::lock_guard<std::mutex> lk(t.mu);
    auto range = t.map.equal_range(h);
    for (auto it = range.first; it != range.second;) {
        StatePtr st = it->second.lock();
        if (!st) {
            it = t.map.erase(it);
            continue;
        }
        if (same_contents(*st, adapters, scales, cvec)) {
            return st;
        }
        ++it;
    }
    std::vector<uint64_t> sig;
    sig.reserve(2 * adapters.size() + 1);
    for (size_t i = 0; i < adapters.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &scales[i], sizeof bits);
        sig.push_back(adapters[i]->serial);
        sig.push_back(bits);
    }
    sig.push_back(cvec ? cvec->serial : 0);
    auto known = t.ids.find(sig);
    auto st = std::make_shared<State>();
    if (known != t.ids.end()) {
        st->id = known->second;
    } else {
        if (t.ids.size() >= StateTable::kMaxIds) {
            t.ids.clear();
        }
        st->id = t.next_id++;
        t.ids.emplace(std::move(sig), st->id);
    }
    for (size_t i = 0; i < adapters.size(); ++i) {
        st->adapters.emplace_back(adapters[i], scales[i]);
    }
    st->cvec = cvec;
    if (t.map.size() >= t.sweep_at) {
        for (auto it = t.map.begin(); it != t.map.end();) {
            it = it->second.expired() ? t.map.erase(it) : std::next(it);
        }
        t.sweep_at = std::max<size_t>(64, 2 * t.map.size());
    }
    t.map.emplace(h, st);
    return st;
}

size_t state_n_interned() {
    StateTable & t = state_table();
    std::lock_guard<std::mutex> lk(t.mu);
    size_t n = 0;
    for (const auto & kv : t.map) {
        n += kv.second.expired() ? 0 : 1;
    }
    return n;
}

namespace {

struct TokenizeJob {
    const llama_vocab * vocab;
    const char * text;
    int32_t n_text;
    llama_token * out;
    int32_t n_max;
    bool add_special;
    bool parse_special;
    int32_t result = 0;
    std::exception_ptr error;
};

void * tokenize_job_main(void * arg) {
    auto * job = static_cast<TokenizeJob *>(arg);
    try {
        job->result = llama_tokenize(job->vocab, job->text, job->n_text, job->out, job->n_max,
                                     job->add_special, job->parse_special);
    } catch (...) {
        job->error = std::current_exception();
    }
    return nullptr;
}

}  // namespace

int32_t tokenize_safe(const llama_vocab * vocab, const char * text, int32_t n_text, llama_token * out,
                      int32_t n_max, bool add_special, bool parse_special) {
    if (n_text < TOKENIZE_DEEP_BYTES || llama_vocab_type(vocab) != LLAMA_VOCAB_TYPE_BPE) {
        return llama_tokenize(vocab, text, n_text, out, n_max, add_special, parse_special);
    }
    TokenizeJob job{vocab, text, n_text, out, n_max, add_special, parse_special};
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    size_t stack = (size_t{16} << 20) + static_cast<size_t>(n_text) * 1024;
    stack = (stack + page - 1) / page * page;
    auto refuse = [&](int err) {
        return Error(ErrorKind::OutOfMemory,
                     "tokenizing " + std::to_string(n_text) + " bytes with this vocabulary's BPE pre-tokenizer "
                     "(llama.cpp runs its regex with std::regex, which recurses once per character) needs a " +
                     std::to_string(stack >> 20) + " MiB stack, and the system refused it (" + std::strerror(err) +
                     "): tokenize the text in smaller pieces");
    };
    // Address space only: MAP_NORESERVE keeps the heuristic overcommit check
    // out of it, and pages are committed as the recursion touches them (a
    // text without long runs touches a few).  The lowest page is a guard.
    void * base = mmap(nullptr, stack + page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
#ifdef MAP_STACK
                           | MAP_STACK
#endif
                       , -1, 0);
    if (base == MAP_FAILED) {
        throw refuse(errno);
    }
    struct Unmap {
        void * p;
        size_t n;
        ~Unmap() { munmap(p, n); }
    } unmap{base, stack + page};
    mprotect(base, page, PROT_NONE);
    pthread_attr_t attr;
    int rc = pthread_attr_init(&attr);
    if (rc != 0) {
        throw refuse(rc);
    }
    rc = pthread_attr_setstack(&attr, static_cast<char *>(base) + page, stack);
    pthread_t th;
    if (rc == 0) {
        rc = pthread_create(&th, &attr, tokenize_job_main, &job);
    }
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        throw refuse(rc);
    }
    pthread_join(th, nullptr);
    if (job.error) {
        std::rethrow_exception(job.error);
    }
    return job.result;
}

int32_t wpm_long_words_to_unk(const llama_vocab * vocab, llama_token unk, llama_token * tokens, int32_t n) {
    if (llama_vocab_type(vocab) != LLAMA_VOCAB_TYPE_WPM) {
        return n;
    }
    constexpr int32_t kMaxWordChars = 100;  // BertTokenizer's max_input_chars_per_word
    static const std::string kWordStart = "\xe2\x96\x81";  // the phantom space the converter puts on word starts
    if (unk < 0) {
        return n;
    }
    auto n_chars = [](const char * s) {
        int32_t k = 0;
        for (; *s; ++s) {
            k += (static_cast<unsigned char>(*s) & 0xC0) != 0x80;  // count UTF-8 lead bytes
        }
        return k;
    };
    int32_t w = 0;  // write index
    int32_t i = 0;
    while (i < n) {
        const char * text = llama_vocab_get_text(vocab, tokens[i]);
        const bool special = llama_vocab_get_attr(vocab, tokens[i]) &
                             (LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_UNKNOWN | LLAMA_TOKEN_ATTR_USER_DEFINED);
        if (special || !text || std::strncmp(text, kWordStart.c_str(), kWordStart.size()) != 0) {
            tokens[w++] = tokens[i++];
            continue;
        }
        // a word: this token and the continuation pieces after it
        int32_t j = i + 1;
        int32_t chars = n_chars(text) - 1;
        while (j < n) {
            const char * t = llama_vocab_get_text(vocab, tokens[j]);
            const bool sp = llama_vocab_get_attr(vocab, tokens[j]) &
                            (LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_UNKNOWN | LLAMA_TOKEN_ATTR_USER_DEFINED);
            if (sp || !t || std::strncmp(t, kWordStart.c_str(), kWordStart.size()) == 0) {
                break;
            }
            chars += n_chars(t);
            ++j;
        }
        if (chars > kMaxWordChars) {
            tokens[w++] = unk;
        } else {
            for (int32_t k = i; k < j; ++k) {
                tokens[w++] = tokens[k];
            }
        }
        i = j;
    }
    return w;
}

void tokenize_many(const llama_vocab * vocab, llama_token unk,
                   const std::vector<std::pair<const char *, int32_t>> & texts, bool add_special, bool parse_special, int32_t max_tokens, bool truncate,
                   std::vector<llama_token> & flat, std::vector<int64_t> & offsets) {
    offsets.clear();
    offsets.reserve(texts.size() + 1);
    offsets.push_back(static_cast<int64_t>(flat.size()));
    const int32_t n_suffix = add_special ? (llama_vocab_get_add_eos(vocab) ? 1 : 0) +
                                               (llama_vocab_get_add_sep(vocab) ? 1 : 0)
                                         : 0;
    std::vector<llama_token> buf;
    for (size_t i = 0; i < texts.size(); ++i) {
        const char * p = texts[i].first;
        const int32_t n_text = texts[i].second;
        buf.resize(static_cast<size_t>(n_text) + 8);
        int32_t n = tokenize_safe(vocab, p, n_text, buf.data(), static_cast<int32_t>(buf.size()), add_special,
                                  parse_special);
        if (n == INT32_MIN) {
            throw Error(ErrorKind::InvalidArgument, "input " + std::to_string(i) + ": too many tokens for int32");
        }
        if (n < 0) {
            buf.resize(static_cast<size_t>(-n));
            n = tokenize_safe(vocab, p, n_text, buf.data(), static_cast<int32_t>(buf.size()), add_special,
                              parse_special);
            if (n < 0) {
                throw Error(ErrorKind::InvalidArgument, "input " + std::to_string(i) + ": tokenization failed");
            }
        }
        n = wpm_long_words_to_unk(vocab, unk, buf.data(), n);
        if (n == 0) {
            llama_token t = llama_vocab_bos(vocab);
            if (t < 0) {
                t = llama_vocab_eos(vocab);
            }
            if (t < 0) {
                throw Error(ErrorKind::InvalidArgument, "input " + std::to_string(i) +
                                                            " has no tokens and the model has no BOS or EOS "
                                                            "token to stand in for it");
            }
            buf[0] = t;
            n = 1;
        }
        if (max_tokens > 0 && n > max_tokens) {
            if (!truncate) {
                throw Error(ErrorKind::ContextOverflow, "input " + std::to_string(i) + " has " + std::to_string(n) +
                                                            " tokens, more than the limit of " +
                                                            std::to_string(max_tokens) +
                                                            ": shorten it or pass truncate=True");
            }
            const int32_t keep_tail = std::min(n_suffix, max_tokens - 1);
            std::copy(buf.begin() + (n - keep_tail), buf.begin() + n, buf.begin() + (max_tokens - keep_tail));
            n = max_tokens;
        }
        flat.insert(flat.end(), buf.begin(), buf.begin() + n);
        offsets.push_back(static_cast<int64_t>(flat.size()));
    }
}

// ---------------------------------------------------------------------------
// Control vectors

namespace {

void check_range(const llama_model * model, int32_t start, int32_t end) {
    int32_t n_layer = llama_model_n_layer(model);
    if (start < 1 || end >= n_layer || start > end) {
        throw Error(ErrorKind::ControlVector,
                    "control vector layer range [" + std::to_string(start) + ", " + std::to_string(end) +
                        "] is invalid: need 1 <= layer_start <= layer_end <= " + std::to_string(n_layer - 1) +
                        " (this model has " + std::to_string(n_layer) + " layers; layer 0 takes no control vector)");
    }
}

void check_finite(const std::vector<float> & v) {
    for (size_t i = 0; i < v.size(); ++i) {
        if (!std::isfinite(v[i])) {
            throw Error(ErrorKind::ControlVector,
                        "control vector has a non-finite value (NaN or inf) at flat index " + std::to_string(i));
        }
    }
}

// Checks the data and computes the hash State interning compares first.
ControlVectorPtr seal(const std::shared_ptr<ControlVector> & cv) {
    check_finite(cv->data);
    uint64_t h = 1469598103934665603ull ^ (uint64_t) cv->n_embd;
    auto mix = [&h](uint64_t v) {
        h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        h *= 1099511628211ull;
    };
    mix((uint64_t) (uint32_t) cv->layer_start << 32 | (uint32_t) cv->layer_end);
    const auto * w = reinterpret_cast<const uint32_t *>(cv->data.data());
    for (size_t i = 0; i < cv->data.size(); ++i) {
        mix(w[i]);
    }
    cv->hash = h;
    cv->serial = next_serial();
    return cv;
}

}  // namespace

ControlVectorPtr cvec_from_rows(const llama_model * model, const float * rows, size_t n_floats,
                                int32_t layer_start, int32_t layer_end) {
    check_range(model, layer_start, layer_end);
    const int32_t n_embd = llama_model_n_embd(model);
    const size_t n_rows = (size_t) (layer_end - layer_start + 1);
    if (n_floats != n_rows * (size_t) n_embd) {
        if (n_floats % (size_t) n_embd != 0) {
            throw Error(ErrorKind::ControlVector,
                        "control vector rows have " + std::to_string(n_floats) +
                            " floats, not a multiple of this model's n_embd=" + std::to_string(n_embd));
        }
        throw Error(ErrorKind::ControlVector,
                    "control vector has " + std::to_string(n_floats / n_embd) + " rows for layers [" +
                        std::to_string(layer_start) + ", " + std::to_string(layer_end) + "], which need " +
                        std::to_string(n_rows) + " rows of n_embd=" + std::to_string(n_embd));
    }
    auto cv = std::make_shared<ControlVector>();
    cv->n_embd = n_embd;
    cv->layer_start = layer_start;
    cv->layer_end = layer_end;
    cv->data.assign((size_t) n_embd * layer_end, 0.0f);
    std::memcpy(cv->data.data() + (size_t) (layer_start - 1) * n_embd, rows, n_floats * sizeof(float));
    return seal(cv);
}

ControlVectorPtr cvec_from_padded(const llama_model * model, const float * flat, size_t n_floats,
                                  int32_t layer_start, int32_t layer_end) {
    check_range(model, layer_start, layer_end);
    const int32_t n_embd = llama_model_n_embd(model);
    const size_t need = (size_t) n_embd * layer_end;
    if (n_floats < need) {
        throw Error(ErrorKind::ControlVector,
                    "control vector data has " + std::to_string(n_floats) + " floats; layer_end=" +
                        std::to_string(layer_end) + " needs at least n_embd * layer_end = " +
                        std::to_string(n_embd) + " * " + std::to_string(layer_end) + " = " + std::to_string(need) +
                        " (the padded format starts at layer 1)");
    }
    if (n_floats % (size_t) n_embd != 0) {
        throw Error(ErrorKind::ControlVector,
                    "control vector data has " + std::to_string(n_floats) +
                        " floats, not a multiple of this model's n_embd=" + std::to_string(n_embd));
    }
    auto cv = std::make_shared<ControlVector>();
    cv->n_embd = n_embd;
    cv->layer_start = layer_start;
    cv->layer_end = layer_end;
    cv->data.assign(flat, flat + need);
    // Layers outside [start, end] are not applied by llama.cpp; zero them so
    // that equal effects compare equal.
    std::fill(cv->data.begin(), cv->data.begin() + (size_t) (layer_start - 1) * n_embd, 0.0f);
    return seal(cv);
}

ControlVectorPtr cvec_from_gguf(const llama_model * model, const std::string & path, float scale,
                                int32_t layer_start, int32_t layer_end) {
    check_gguf_file(path);
    if (!std::isfinite(scale)) {
        throw Error(ErrorKind::ControlVector, "control vector scale must be finite");
    }
    const int32_t n_embd = llama_model_n_embd(model);
    const int32_t n_layer = llama_model_n_layer(model);
    // Metadata only (no_alloc): the tensor data is read below with every
    // offset and size checked against the file.  Letting gguf allocate the
    // data itself would trust the header's sizes: a file claiming a huge
    // tensor made ggml_init abort the process (found by tools/fuzz.py; the
    // reproducer is in tests/hardening/test_corpus.py).
    ggml_context * gctx = nullptr;
    take_last_log_error();
    gguf_init_params params = {/*no_alloc=*/true, /*ctx=*/&gctx};
    gguf_context * g = gguf_init_from_file(path.c_str(), params);
    if (g == nullptr) {
        throw Error(ErrorKind::InvalidGGUF, with_reason(path + ": cannot read control-vector GGUF"));
    }
    struct Guard {
        gguf_context * g;
        ggml_context * c;
        FILE * f = nullptr;
        ~Guard() {
            gguf_free(g);
            if (c) ggml_free(c);
            if (f) std::fclose(f);
        }
    } guard{g, gctx};
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
        const int e = errno;
        throw Error(ErrorKind::Load, path + ": " + std::strerror(e), e);
    }
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    guard.f = std::fopen(path.c_str(), "rb");
    if (guard.f == nullptr) {
        const int e = errno;
        throw Error(ErrorKind::Load, path + ": " + std::strerror(e), e);
    }
    const uint64_t data_offset = gguf_get_data_offset(g);

    std::vector<float> data((size_t) n_embd * (n_layer - 1), 0.0f);
    std::vector<float> row(n_embd);
    int32_t lo = INT32_MAX, hi = 0;
    const int64_t n_tensors = gguf_get_n_tensors(g);
    for (int64_t i = 0; i < n_tensors; ++i) {
        std::string name = gguf_get_tensor_name(g, i);
        if (name.rfind("direction.", 0) != 0) {
            continue;  // other tensors are not ours to interpret
        }
        char * end = nullptr;
        const char * num = name.c_str() + 10;
        errno = 0;
        long il = std::strtol(num, &end, 10);
        if (end == num || *end != '\0' || errno != 0) {
            throw Error(ErrorKind::ControlVector, path + ": tensor '" + name + "' has no valid layer number");
        }
        if (il < 1 || il >= n_layer) {
            throw Error(ErrorKind::ControlVector,
                        path + ": tensor '" + name + "' is for layer " + std::to_string(il) +
                            ", outside [1, " + std::to_string(n_layer - 1) + "] of this model");
        }
        ggml_tensor * t = ggml_get_tensor(gctx, name.c_str());
        if (t == nullptr || t->type != GGML_TYPE_F32 || ggml_n_dims(t) != 1) {
            throw Error(ErrorKind::ControlVector, path + ": tensor '" + name + "' must be a 1-D F32 tensor");
        }
        if (t->ne[0] != n_embd) {
            throw Error(ErrorKind::ControlVector,
                        path + ": tensor '" + name + "' has " + std::to_string(t->ne[0]) +
                            " values; this model's n_embd is " + std::to_string(n_embd) +
                            " (control vector made for another model?)");
        }
        const uint64_t off = data_offset + gguf_get_tensor_offset(g, i);
        const uint64_t nbytes = sizeof(float) * (uint64_t) n_embd;
        if (off < data_offset || off > file_size || nbytes > file_size - off) {
            throw Error(ErrorKind::InvalidGGUF, path + ": tensor '" + name + "' lies outside the file (truncated?)");
        }
        if (fseeko(guard.f, (off_t) off, SEEK_SET) != 0 || std::fread(row.data(), 1, nbytes, guard.f) != nbytes) {
            throw Error(ErrorKind::InvalidGGUF, path + ": cannot read tensor '" + name + "'");
        }
        const float * src = row.data();
        float * dst = data.data() + (size_t) (il - 1) * n_embd;
        for (int32_t j = 0; j < n_embd; ++j) {
            dst[j] += scale * src[j];
        }
        lo = std::min<int32_t>(lo, (int32_t) il);
        hi = std::max<int32_t>(hi, (int32_t) il);
    }
    if (hi == 0) {
        throw Error(ErrorKind::ControlVector, path + ": no 'direction.N' tensors: not a control-vector GGUF");
    }
    int32_t s = layer_start > 0 ? layer_start : lo;
    int32_t e = layer_end > 0 ? layer_end : hi;
    check_range(model, s, e);
    auto cv = std::make_shared<ControlVector>();
    cv->n_embd = n_embd;
    cv->layer_start = s;
    cv->layer_end = e;
    cv->data.assign(data.begin(), data.begin() + (size_t) n_embd * e);
    std::fill(cv->data.begin(), cv->data.begin() + (size_t) (s - 1) * n_embd, 0.0f);
    return seal(cv);
}

ControlVectorPtr cvec_sum(const std::vector<ControlVectorPtr> & parts, const std::vector<float> & scales) {
    if (parts.empty()) {
        throw Error(ErrorKind::ControlVector, "cannot sum an empty list of control vectors");
    }
    if (parts.size() != scales.size()) {
        throw Error(ErrorKind::InvalidArgument, "one scale per control vector is needed");
    }
    int32_t n_embd = parts[0]->n_embd, lo = INT32_MAX, hi = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        if (parts[i]->n_embd != n_embd) {
            throw Error(ErrorKind::ControlVector, "control vectors to sum have different n_embd (" +
                                                      std::to_string(n_embd) + " vs " +
                                                      std::to_string(parts[i]->n_embd) + ")");
        }
        if (!std::isfinite(scales[i])) {
            throw Error(ErrorKind::ControlVector, "control vector scale must be finite");
        }
        lo = std::min(lo, parts[i]->layer_start);
        hi = std::max(hi, parts[i]->layer_end);
    }
    auto cv = std::make_shared<ControlVector>();
    cv->n_embd = n_embd;
    cv->layer_start = lo;
    cv->layer_end = hi;
    cv->data.assign((size_t) n_embd * hi, 0.0f);
    for (size_t i = 0; i < parts.size(); ++i) {
        const auto & p = parts[i]->data;
        for (size_t j = 0; j < p.size(); ++j) {
            cv->data[j] += scales[i] * p[j];
        }
    }
    return seal(cv);
}

// ---------------------------------------------------------------------------
// Layer outputs (control-vector training)

namespace {

struct LayerCapture {
    int32_t n_layer;
    int32_t n_embd;
    float * dst = nullptr;      // n_layer x n_embd of the prompt being decoded
    std::vector<uint8_t> seen;
    std::string error;
};

// ggml's scheduler asks (ask=true) for each graph node whether the callback
// wants it, then calls it again (ask=false) once such a node is computed.
bool capture_layer_output(ggml_tensor * t, bool ask, void * user) {
    auto * c = static_cast<LayerCapture *>(user);
    if (std::strncmp(t->name, "l_out-", 6) != 0) {
        return !ask;
    }
    char * end = nullptr;
    const long il = std::strtol(t->name + 6, &end, 10);
    if (end == t->name + 6 || *end != '\0' || il < 0 || il >= c->n_layer) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    if (t->type != GGML_TYPE_F32 || t->ne[0] != c->n_embd || t->ne[1] < 1) {
        c->error = std::string("unexpected layer output ") + t->name;
        return false;  // stops the computation
    }
    // the last row: the prompt's last token (the last layer keeps only the
    // rows whose logits are asked for, here that one)
    ggml_backend_tensor_get(t, c->dst + (size_t) il * c->n_embd, (size_t) (t->ne[1] - 1) * t->nb[1],
                            (size_t) c->n_embd * sizeof(float));
    c->seen[il] = 1;
    return true;
}

}  // namespace

void layer_outputs(const ModelPtr & model, const llama_token * tokens, const int64_t * offsets,
                   int32_t n_prompts, int32_t n_threads, float * out) {
    const llama_model * m = model.get();
    const llama_vocab * vocab = llama_model_get_vocab(m);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    int64_t longest = 0;
    for (int32_t i = 0; i < n_prompts; ++i) {
        const int64_t n = offsets[i + 1] - offsets[i];
        if (n < 1) {
            throw Error(ErrorKind::InvalidArgument, "prompt " + std::to_string(i) + " has no tokens");
        }
        longest = std::max(longest, n);
        for (int64_t j = offsets[i]; j < offsets[i + 1]; ++j) {
            if (tokens[j] < 0 || tokens[j] >= n_vocab) {
                throw Error(ErrorKind::Token, "prompt " + std::to_string(i) + ": token id " +
                                                  std::to_string(tokens[j]) + " is outside [0, " +
                                                  std::to_string(n_vocab) + ")");
            }
        }
    }
    const int32_t n_ctx_train = llama_model_n_ctx_train(m);
    if (longest > n_ctx_train) {
        throw Error(ErrorKind::ContextOverflow, "a prompt of " + std::to_string(longest) +
                                                    " tokens is longer than the model's context of " +
                                                    std::to_string(n_ctx_train));
    }
    LayerCapture cap;
    cap.n_layer = llama_model_n_layer(m);
    cap.n_embd = llama_model_n_embd(m);
    llama_context_params p = llama_context_default_params();
    p.n_ctx = (uint32_t) longest;
    p.n_batch = (uint32_t) longest;
    p.n_ubatch = (uint32_t) longest;
    p.n_seq_max = 1;
    p.n_threads = n_threads;
    p.n_threads_batch = n_threads;
    p.no_perf = true;
    p.cb_eval = capture_layer_output;
    p.cb_eval_user_data = &cap;
    std::unique_ptr<llama_context, decltype(&llama_free)> ctx(llama_init_from_model(const_cast<llama_model *>(m), p),
                                                             &llama_free);
    if (!ctx) {
        throw Error(ErrorKind::OutOfMemory, with_reason("cannot create a context for the layer outputs"));
    }
    for (int32_t i = 0; i < n_prompts; ++i) {
        llama_memory_clear(llama_get_memory(ctx.get()), true);
        cap.dst = out + (size_t) i * cap.n_layer * cap.n_embd;
        cap.seen.assign((size_t) cap.n_layer, 0);
        const int32_t n = (int32_t) (offsets[i + 1] - offsets[i]);
        llama_batch b = llama_batch_get_one(const_cast<llama_token *>(tokens + offsets[i]), n);
        const int32_t rc = llama_decode(ctx.get(), b);
        if (!cap.error.empty()) {
            throw Error(ErrorKind::Decode, cap.error);
        }
        if (rc != 0) {
            throw Error(ErrorKind::Decode, "decoding prompt " + std::to_string(i) + " failed (" +
                                               std::to_string(rc) + ")");
        }
        for (int32_t il = 0; il < cap.n_layer; ++il) {
            if (!cap.seen[il]) {
                throw Error(ErrorKind::Decode, "this model's graph has no output for layer " + std::to_string(il) +
                                                   " (l_out-" + std::to_string(il) + ")");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Context

// ---------------------------------------------------------------------------
// SIGINT watching.  CPython's own C handler only sets a flag that Python code
// polls, and the token loop runs without Python; so while a main-thread call
// runs, a handler of ours counts SIGINTs and then calls the previous handler
// (CPython's), which still sees the signal and raises KeyboardInterrupt once
// the call returns.  Installed on first use, restored when the last watcher
// ends (unless someone replaced it meanwhile).

namespace {

std::atomic<uint64_t> g_sigint_count{0};
std::mutex g_sigint_mu;
int g_sigint_users = 0;
struct sigaction g_sigint_prev;

void on_sigint(int sig, siginfo_t * info, void * uctx) {
    g_sigint_count.fetch_add(1, std::memory_order_relaxed);
    if (g_sigint_prev.sa_flags & SA_SIGINFO) {
        if (g_sigint_prev.sa_sigaction != nullptr) {
            g_sigint_prev.sa_sigaction(sig, info, uctx);
        }
    } else if (g_sigint_prev.sa_handler != SIG_DFL && g_sigint_prev.sa_handler != SIG_IGN) {
        g_sigint_prev.sa_handler(sig);
    }
}

void sigint_acquire() {
    std::lock_guard<std::mutex> lk(g_sigint_mu);
    if (g_sigint_users++ == 0) {
        struct sigaction sa;
        std::memset(&sa, 0, sizeof(sa));
        sa.sa_sigaction = on_sigint;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, &g_sigint_prev);
    }
}

void sigint_release() {
    std::lock_guard<std::mutex> lk(g_sigint_mu);
    if (--g_sigint_users == 0) {
        struct sigaction cur;
        if (sigaction(SIGINT, nullptr, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigint) {
            sigaction(SIGINT, &g_sigint_prev, nullptr);
        }
    }
}

}  // namespace

void Context::watch_sigint(bool on) {
    if (on == watch_sigint_) {
        return;
    }
    if (on) {
        sigint_acquire();
        sigint_start_ = g_sigint_count.load(std::memory_order_relaxed);
        watch_sigint_ = true;
    } else {
        watch_sigint_ = false;
        sigint_release();
    }
}

void Context::throw_cancelled(const char * what) const {
    if (interrupted()) {
        throw Error(ErrorKind::Interrupted, std::string(what) + " was interrupted (SIGINT)", 2);
    }
    throw Error(ErrorKind::Aborted, std::string(what) + " was cancelled", 2);
}

bool Context::interrupted() const {
    return watch_sigint_ && g_sigint_count.load(std::memory_order_relaxed) != sigint_start_;
}

bool Context::abort_cb(void * data) {
    auto * c = static_cast<Context *>(data);
    return c->abort_.load(std::memory_order_relaxed) || c->interrupted();
}

namespace {

// The pooling a context will use: the one asked for, else the model's own
// ("<arch>.pooling_type"; none when the key is missing).
enum llama_pooling_type effective_pooling(const llama_model * model, enum llama_pooling_type asked) {
    if (asked != LLAMA_POOLING_TYPE_UNSPECIFIED) {
        return asked;
    }
    char arch[128];
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch)) < 0) {
        return LLAMA_POOLING_TYPE_NONE;
    }
    char val[32];
    const std::string key = std::string(arch) + ".pooling_type";
    if (llama_model_meta_val_str(model, key.c_str(), val, sizeof(val)) < 0) {
        return LLAMA_POOLING_TYPE_NONE;
    }
    return static_cast<enum llama_pooling_type>(std::atoi(val));
}

int64_t pad_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Parameter relations llama.cpp asserts on (aborting the process) while it
// builds a context, checked first.
void check_context_params(const llama_model * model, const llama_context_params & p) {
    const int64_t n_seq = std::max<uint32_t>(1, p.n_seq_max);
    // The n_ctx asked for (0: the trained length), before llama.cpp pads it.
    // With causal attention llama.cpp caps n_batch at this value.
    const int64_t n_ctx_raw = p.n_ctx > 0 ? p.n_ctx : llama_model_n_ctx_train(model);
    // llama_context reserves one output row per sequence, within n_batch
    // (GGML_ASSERT n_outputs_max <= cparams.n_outputs_max in output_reserve).
    if (n_seq > std::min<int64_t>(p.n_batch, n_ctx_raw)) {
        throw Error(ErrorKind::InvalidArgument,
                    "n_seq_max=" + std::to_string(n_seq) + " exceeds n_batch=" + std::to_string(p.n_batch) +
                        (n_ctx_raw < (int64_t) p.n_batch ? " capped at n_ctx=" + std::to_string(n_ctx_raw)
                                                         : std::string()) +
                        ": llama.cpp reserves an output row per sequence within n_batch; raise n_batch (and "
                        "n_ctx) or lower n_seq_max");
    }
    // Mean (and rank) pooling multiplies the token outputs by an
    // n_tokens x n_seqs matrix.  llama.cpp reserves its graphs with n_tokens
    // rounded up to a multiple of n_seq_max but the outputs not, so the
    // shapes disagree (GGML_ASSERT ggml_can_mul_mat) unless the reserve size
    // min(n_ctx, n_batch, n_ubatch) is already such a multiple.
    if (p.embeddings) {
        const enum llama_pooling_type pt = effective_pooling(model, p.pooling_type);
        if (pt == LLAMA_POOLING_TYPE_MEAN || pt == LLAMA_POOLING_TYPE_RANK) {
            int64_t n_ctx = n_ctx_raw;
            n_ctx = p.kv_unified ? pad_to(n_ctx, 256) : pad_to(std::max<int64_t>(1, n_ctx / n_seq), 256) * n_seq;
            const int64_t n_ubatch = std::min(p.n_ubatch, p.n_batch);
            // non-causal models (BERT) reserve min(padded n_ctx, n_ubatch) tokens; causal ones at most
            // the unpadded n_ctx (their n_batch is capped there): both must be multiples
            const int64_t t_pad = std::min<int64_t>({n_ctx, (int64_t) p.n_batch, n_ubatch});
            const int64_t t_raw = std::min<int64_t>(t_pad, n_ctx_raw);
            const int64_t t = t_raw % n_seq != 0 ? t_raw : t_pad;
            if (t % n_seq != 0) {
                const int64_t fix = pad_to(t, n_seq);
                throw Error(ErrorKind::InvalidArgument,
                            "with " + std::string(pt == LLAMA_POOLING_TYPE_MEAN ? "mean" : "rank") +
                                " pooling, min(n_ctx, n_batch, n_ubatch) = " + std::to_string(t) +
                                " must be a multiple of n_seq_max=" + std::to_string(n_seq) +
                                " (llama.cpp's pooling graph needs it): e.g. n_batch=n_ubatch=" +
                                std::to_string(fix) + (n_ctx_raw < fix ? " and n_ctx=" + std::to_string(fix) : ""));
            }
        }
    }
}

}  // namespace

Context::Context(const ModelPtr & model_ref, llama_context_params params, int32_t max_positions)
    : model_own_(model_ref), state_(state_base()) {
    llama_model * model = model_ref.get();
    check_context_params(model, params);
    params.abort_callback = &Context::abort_cb;
    params.abort_callback_data = this;
#ifdef LLAMA_HAS_FA_KV_F32
    // Patch 0014: an encoder's K and V reach flash attention in F32, not cast
    // to F16 and widened again by the CPU kernels (two copies per layer).  GPU
    // builds keep the cast: their kernels want F16 K/V.
    params.fa_kv_f32 = params.embeddings && !llama_supports_gpu_offload();
#endif
    take_last_log_error();
    ctx_ = llama_init_from_model(model, params);
    if (ctx_ == nullptr) {
        std::string why = trim(take_last_log_error());
        const ErrorKind kind = classify_log(why, ErrorKind::InvalidArgument);
        throw Error(kind, "cannot create context" + (why.empty() ? std::string() : ": " + why));
    }
    model_ = model;
    vocab_ = llama_model_get_vocab(model);
    n_vocab_ = llama_vocab_n_tokens(vocab_);
    n_ctx_ = (int32_t) llama_n_ctx(ctx_);
    n_ctx_seq_ = (int32_t) llama_n_ctx_seq(ctx_);
    // llama.cpp pads n_ctx up (to 256); the caller's n_ctx is the limit
    // llamax enforces, so a context behaves the same whatever the padding.
    if (params.n_ctx > 0) {
        n_ctx_ = std::min<int32_t>(n_ctx_, (int32_t) params.n_ctx);
        n_ctx_seq_ = std::min<int32_t>(n_ctx_seq_, (int32_t) params.n_ctx);
    }
    // Learned position embeddings (BERT, GPT-2, ...) have n_ctx_train rows: a
    // position past them aborts in ggml_get_rows.
    if (max_positions > 0) {
        n_ctx_ = std::min(n_ctx_, max_positions * std::max<int32_t>(1, (int32_t) llama_n_seq_max(ctx_)));
        n_ctx_seq_ = std::min(n_ctx_seq_, max_positions);
    }
    n_batch_ = (int32_t) llama_n_batch(ctx_);
    n_seq_max_ = (int32_t) llama_n_seq_max(ctx_);
    out_capacity_ = n_seq_max_;  // llama.cpp reserves this many outputs at creation
    has_memory_ = llama_get_memory(ctx_) != nullptr;
    embeddings_ = params.embeddings;
    kv_unified_ = params.kv_unified;
    // Without KV memory (encoders) or with non-causal attention, llama.cpp
    // needs a whole batch in one ubatch (it asserts n_ubatch >= n_tokens).
    n_call_max_ = (!has_memory_ || !llama_get_causal_attn(ctx_)) ? (int32_t) llama_n_ubatch(ctx_) : n_batch_;
    owned_add(ctx_);
    try {
        set_threads(params.n_threads, params.n_threads_batch);
    } catch (...) {
        owned_remove(ctx_);
        llama_free(ctx_);  // the destructor won't run for a constructor that throws
        ctx_ = nullptr;
        free_threadpools();
        throw;
    }
}

Context::~Context() {
    watch_sigint(false);
    if (ctx_ != nullptr) {
        owned_remove(ctx_);
        llama_free(ctx_);
    }
    free_threadpools();
}

void Context::free_threadpools() {
    if (tp_batch_ != nullptr && tp_batch_ != tp_) {
        ggml_threadpool_free(tp_batch_);
    }
    if (tp_ != nullptr) {
        ggml_threadpool_free(tp_);
    }
    tp_ = tp_batch_ = nullptr;
}

namespace {
std::atomic<SgemmFn> g_embedding_sgemm{nullptr};
}  // namespace

void set_embedding_sgemm(SgemmFn fn) { g_embedding_sgemm.store(fn); }

SgemmFn embedding_sgemm() { return g_embedding_sgemm.load(); }

void Context::set_threads(int32_t n_threads, int32_t n_threads_batch) {
    if (n_threads < 1 || n_threads_batch < 1 || n_threads > GGML_MAX_N_THREADS ||
        n_threads_batch > GGML_MAX_N_THREADS) {
        throw Error(ErrorKind::InvalidArgument, "thread counts must be in [1, " +
                                                    std::to_string(GGML_MAX_N_THREADS) + "]");
    }
    llama_detach_threadpool(ctx_);
    free_threadpools();
    // Embedding contexts multiply float weights from packed copies (patch
    // 0010, packed_gemm.h), with an external SGEMM for what those kernels
    // leave (patch 0005), and take flash attention's tiled kernel for
    // inputs of any length (0007); generation keeps ggml's kernels, whose
    // numbers do not depend on how many sequences are decoded together.  (A
    // tree given with LLAMAX_LLAMA_CPP_DIR, built unpatched, has neither.)
    ggml_threadpool_params p = ggml_threadpool_params_default(n_threads);
    // No spinning between graphs: a worker waits for the next graph asleep.
    // llama.cpp's tools spin (poll 50: about 6.5 M pause loops, tens of ms),
    // which is free when nothing else wants the core; llamax shares the cores
    // with its own event loop, the HTTP clients and the sampling between
    // decodes.  Serving 8 streams on 2 cores: 86 / 75 tok/s at poll 50, 94 /
    // 87 at poll 0 (alternating); one stream: equal within noise.
    p.poll = 0;
#ifdef GGML_THREADPOOL_HAS_SGEMM
    sgemm_ = embeddings_ ? embedding_sgemm() : nullptr;
    p.sgemm = sgemm_;
#else
    sgemm_ = nullptr;
#endif
#ifdef GGML_THREADPOOL_HAS_FA_TILED_MIN_ROWS
    p.fa_tiled_min_rows = embeddings_ ? 1 : 0;
#endif
    tp_ = ggml_threadpool_new(&p);
    if (n_threads_batch != n_threads) {
        ggml_threadpool_params pb = p;
        pb.n_threads = n_threads_batch;
        tp_batch_ = ggml_threadpool_new(&pb);
    } else {
        tp_batch_ = tp_;
    }
    if (tp_ == nullptr || tp_batch_ == nullptr) {
        free_threadpools();
        sgemm_ = nullptr;
        packed_.reset();
        if (deterministic_) {
            // ggml's per-graph pools would run the fast kernels: not silently
            throw Error(ErrorKind::OutOfMemory, "could not make the thread pools deterministic decoding runs on");
        }
        llama_set_n_threads(ctx_, n_threads, n_threads_batch);  // ggml's per-graph pools
        return;
    }
#ifdef GGML_THREADPOOL_HAS_MUL_MAT_HOOK
    // and multiply the model's float weights from packed copies (patch 0010)
    packed_ = (embeddings_ && packed::enabled()) ? packed::store_for(model_) : nullptr;
    if (packed_) {
        ggml_threadpool_set_mul_mat_hook(tp_, packed::mul_mat_hook, packed_.get());
        if (tp_batch_ != tp_) {
            ggml_threadpool_set_mul_mat_hook(tp_batch_, packed::mul_mat_hook, packed_.get());
        }
    }
#else
    packed_.reset();
#endif
#ifdef GGML_THREADPOOL_HAS_USE_REF
    ggml_threadpool_set_use_ref(tp_, deterministic_);
    ggml_threadpool_set_use_ref(tp_batch_, deterministic_);
#endif
#ifdef GGML_THREADPOOL_HAS_FA_SPLIT_KV
    // A lone query row's attention summed over the cache in order, as each
    // row of a batch is (patch 0015): a token's numbers are then the same
    // decoded alone or in a batch (speculative drafts verified together give
    // plain greedy decoding's answer) and at any thread count.  With patch
    // 0016 every row then sums the cache in fixed 256-cell chunks merged in
    // order, a lone row's chunks over all threads (ggml's split's speed).
    // LLAMAX_FA_SPLIT_KV=1 keeps ggml's split, to measure what this costs.
    const char * split_env = std::getenv("LLAMAX_FA_SPLIT_KV");
    const bool split_kv = split_env != nullptr && std::string(split_env) == "1";
    ggml_threadpool_set_fa_split_kv(tp_, split_kv);
    ggml_threadpool_set_fa_split_kv(tp_batch_, split_kv);
#endif
    llama_attach_threadpool(ctx_, tp_, tp_batch_ == tp_ ? nullptr : tp_batch_);
    llama_set_n_threads(ctx_, n_threads, n_threads_batch);
}

void Context::set_deterministic(bool on) {
#ifdef GGML_THREADPOOL_HAS_USE_REF
    if (on && tp_ == nullptr) {
        throw Error(ErrorKind::InvalidArgument,
                    "deterministic decoding needs llamax's own thread pools, and this context could not make "
                    "them (it runs on ggml's per-graph pools)");
    }
    deterministic_ = on;
    if (tp_ != nullptr) {
        ggml_threadpool_set_use_ref(tp_, on);
        ggml_threadpool_set_use_ref(tp_batch_, on);
    }
#else
    if (on) {
        throw Error(ErrorKind::InvalidArgument,
                    "deterministic decoding needs llamax's patched llama.cpp (patch 0012); this build's "
                    "llama.cpp (LLAMAX_LLAMA_CPP_DIR) is unpatched");
    }
#endif
}

void Context::set_lora_table(int32_t n_slots, int32_t max_rank) {
#ifdef LLAMA_HAS_LORA_TABLE
    if (n_slots < 1 || n_slots > 4096 || max_rank < 1 || max_rank > 4096) {
        throw Error(ErrorKind::InvalidArgument, "max_lora_slots must be in [1, 4096] and max_lora_rank in [1, 4096]");
    }
    if (!state_->adapters.empty() || per_seq_ || table_info_.n_slots > 0) {
        throw Error(ErrorKind::InvalidArgument, "a LoRA table is set once, before any adapter is applied");
    }
    if (llama_lora_table_init(ctx_, n_slots, max_rank) != 0) {
        throw Error(ErrorKind::InvalidArgument, "llama.cpp refused the LoRA table");
    }
    snap_table_info();
#else
    (void) n_slots;
    (void) max_rank;
    throw Error(ErrorKind::InvalidArgument,
                "a LoRA table needs llamax's patched llama.cpp (patch 0013); this build's llama.cpp "
                "(LLAMAX_LLAMA_CPP_DIR) is unpatched");
#endif
}

bool Context::lora_table_fits(const AdapterPtr & adapter) {
#ifdef LLAMA_HAS_LORA_TABLE
    return adapter && llama_lora_table_fits(ctx_, adapter->ptr) == 1;
#else
    (void) adapter;
    return false;
#endif
}

void Context::snap_table_info() {
#ifdef LLAMA_HAS_LORA_TABLE
    llama_lora_table_info li;
    llama_lora_table_get_info(ctx_, &li);
    LoraTableInfo out;
    out.n_slots = li.n_slots;
    out.max_rank = li.max_rank;
    out.n_filled = li.n_filled;
    out.n_per_row = li.n_per_row;
    out.n_table = li.n_table;
    out.n_fallback = li.n_fallback;
    out.n_fills = li.n_fills;
    out.n_evictions = li.n_evictions;
    out.n_bytes = li.n_bytes;
    std::lock_guard<std::mutex> lk(info_mu_);
    table_info_ = out;
#endif
}

bool Context::set_state(const StatePtr & want_in) {
    const StatePtr & want = want_in ? want_in : state_base();
    if (want == state_ && !per_seq_) {
        return false;
    }
    for (const auto & p : want->adapters) {
        if (p.first->model.get() != model_) {
            throw Error(ErrorKind::AdapterMismatch,
                        "adapter " + p.first->path + " was loaded for another model than this context's");
        }
    }
    if (want->cvec && want->cvec->n_embd != llama_model_n_embd(model_)) {
        throw Error(ErrorKind::ControlVector, "control vector n_embd " + std::to_string(want->cvec->n_embd) +
                                                  " != model n_embd " + std::to_string(llama_model_n_embd(model_)));
    }
#ifdef LLAMA_HAS_ADAPTERS_LORA_SEQ
    if (deterministic_ && !want->adapters.empty()) {
        // One arithmetic for an adapter set, alone or beside others: the
        // per-sequence path scales each delta by alpha/rank, then by the
        // token's scale; the plain path by the product of the two, which
        // rounds differently.  So a set alone is applied per sequence too
        // (every sequence at its scales), as the batcher mixes sets.
        if (per_seq_ && det_state_ == want) {
            return false;
        }
        std::vector<AdapterPtr> ads;
        for (const auto & p : want->adapters) {
            ads.push_back(p.first);
        }
        std::sort(ads.begin(), ads.end(), [](const AdapterPtr & a, const AdapterPtr & b) {
            return std::less<llama_adapter_lora *>()(a->ptr, b->ptr);
        });
        std::vector<float> sc(ads.size() * (size_t) n_seq_max_);
        for (size_t a = 0; a < ads.size(); ++a) {
            for (const auto & p : want->adapters) {
                if (p.first == ads[a]) {
                    std::fill(sc.begin() + (ptrdiff_t) (a * (size_t) n_seq_max_),
                              sc.begin() + (ptrdiff_t) ((a + 1) * (size_t) n_seq_max_), p.second);
                }
            }
        }
        set_state_per_seq(want->cvec ? state_intern(model_, {}, {}, want->cvec) : state_base(), ads, sc);
        det_state_ = want;
        return true;
    }
#endif
    det_state_.reset();
    // Only what differs reaches llama.cpp (each call re-reserves its graph).
    bool same_adapters = !per_seq_ && want->adapters.size() == state_->adapters.size();
    for (size_t i = 0; same_adapters && i < want->adapters.size(); ++i) {
        same_adapters = want->adapters[i].first == state_->adapters[i].first &&
                        std::memcmp(&want->adapters[i].second, &state_->adapters[i].second, sizeof(float)) == 0;
    }
    const ControlVectorPtr & cv = want->cvec;
    const bool same_cvec = cv == state_->cvec || (cv && state_->cvec && cv->same_as(*state_->cvec));
    if (!same_adapters) {
        // In one canonical order (by the adapter's address), here and in
        // set_state_per_seq: llama.cpp adds the adapters' deltas in the order
        // of its set, and floating-point addition is not associative, so a
        // state applied alone and the same state served per sequence must
        // hand llama.cpp their adapters the same way to compute the same numbers.
        std::vector<std::pair<llama_adapter_lora *, float>> order;
        for (const auto & p : want->adapters) {
            order.emplace_back(p.first->ptr, p.second);
        }
        std::sort(order.begin(), order.end(),
                  [](const auto & a, const auto & b) { return std::less<llama_adapter_lora *>()(a.first, b.first); });
        std::vector<llama_adapter_lora *> ptrs;
        std::vector<float> sc;
        for (const auto & p : order) {
            ptrs.push_back(p.first);
            sc.push_back(p.second);
        }
        int32_t rc = llama_set_adapters_lora(ctx_, ptrs.empty() ? nullptr : ptrs.data(), ptrs.size(),
                                             sc.empty() ? nullptr : sc.data());
        ++n_state_calls_;
        if (rc != 0) {
            // llama.cpp replaced its set before refusing: nothing is applied now
            llama_set_adapters_lora(ctx_, nullptr, 0, nullptr);
            state_ = state_->cvec ? state_intern(model_, {}, {}, state_->cvec) : state_base();
            per_seq_ = false;
            per_seq_adapters_.clear();
            snap_table_info();
            throw Error(ErrorKind::AdapterMismatch, with_reason("llama.cpp refused the adapter set"), rc);
        }
        per_seq_ = false;  // (llama_set_adapters_lora ends per-sequence scales too)
        per_seq_adapters_.clear();
    }
    if (!same_cvec) {
        int32_t rc = cv ? llama_set_adapter_cvec(ctx_, cv->data.data(), cv->data.size(), cv->n_embd,
                                                 cv->layer_start, cv->layer_end)
                        : llama_set_adapter_cvec(ctx_, nullptr, 0, 0, 0, 0);
        ++n_state_calls_;
        if (rc != 0) {
            // the adapters are `want`'s now; the control vector is unknown: clear it
            std::vector<AdapterPtr> ads;
            std::vector<float> sc;
            for (const auto & p : want->adapters) {
                ads.push_back(p.first);
                sc.push_back(p.second);
            }
            llama_set_adapter_cvec(ctx_, nullptr, 0, 0, 0, 0);
            state_ = state_intern(model_, ads, sc, nullptr);
            snap_table_info();
            throw Error(ErrorKind::ControlVector,
                        with_reason(cv ? "llama.cpp refused the control vector"
                                       : "llama.cpp refused to clear the control vector"), rc);
        }
    }
    state_ = want;
    snap_table_info();
    return true;
}

void Context::set_state_per_seq(const StatePtr & cv_state, const std::vector<AdapterPtr> & adapters,
                                const std::vector<float> & scales) {
    if (!cv_state->adapters.empty()) {
        throw Error(ErrorKind::InvalidArgument, "set_state_per_seq: the base state must have no adapters");
    }
    saved_valid_ = false;  // (logits under per-sequence adapters describe no plain state)
    if (scales.size() != adapters.size() * (size_t) n_seq_max_) {
        throw Error(ErrorKind::InvalidArgument, "set_state_per_seq: one scale per adapter and sequence is needed");
    }
    for (const auto & a : adapters) {
        if (!a || a->model.get() != model_) {
            throw Error(ErrorKind::AdapterMismatch, "an adapter was loaded for another model than this context's");
        }
    }
    for (float f : scales) {
        if (!std::isfinite(f)) {
            throw Error(ErrorKind::InvalidArgument, "adapter scale must be finite");
        }
    }
    // the control vector: as set_state would, keeping whatever adapters are applied
    const ControlVectorPtr & cv = cv_state->cvec;
    if (!(cv == state_->cvec || (cv && state_->cvec && cv->same_as(*state_->cvec)))) {
        int32_t rc = cv ? llama_set_adapter_cvec(ctx_, cv->data.data(), cv->data.size(), cv->n_embd,
                                                 cv->layer_start, cv->layer_end)
                        : llama_set_adapter_cvec(ctx_, nullptr, 0, 0, 0, 0);
        ++n_state_calls_;
        if (rc != 0) {
            llama_set_adapter_cvec(ctx_, nullptr, 0, 0, 0, 0);
            llama_set_adapters_lora(ctx_, nullptr, 0, nullptr);
            state_ = state_base();
            per_seq_ = false;
            per_seq_adapters_.clear();
            snap_table_info();
            throw Error(ErrorKind::ControlVector, with_reason("llama.cpp refused the control vector"), rc);
        }
    }
    std::vector<llama_adapter_lora *> ptrs;
    for (const auto & a : adapters) {
        ptrs.push_back(a->ptr);
    }
    // (the same set with other scales re-reserves nothing: the scales are graph inputs)
    if (!per_seq_ || adapters != per_seq_adapters_) {
        ++n_state_calls_;
    }
#ifdef LLAMA_HAS_ADAPTERS_LORA_SEQ
    if (llama_set_adapters_lora_seq(ctx_, ptrs.data(), ptrs.size(), scales.data(), n_seq_max_) != 0) {
        // (no adapter is applied now: llama.cpp cleared them, or never set them)
        llama_set_adapters_lora(ctx_, nullptr, 0, nullptr);
        per_seq_ = false;
        per_seq_adapters_.clear();
        state_ = cv_state;
        det_state_.reset();
        snap_table_info();
        throw Error(ErrorKind::InvalidArgument, with_reason("llama.cpp refused the per-sequence adapter scales"));
    }
#else
    throw Error(ErrorKind::InvalidArgument,
                "this llama.cpp was built without llamax's patch 0004 (per-sequence LoRA scales)");
#endif
    per_seq_ = !adapters.empty();
    per_seq_adapters_ = adapters;  // held while applied
    per_seq_scales_ = scales;
    state_ = cv_state;
    det_state_.reset();  // (set_state sets it again when it is the caller)
    snap_table_info();
}

bool Context::per_seq_covers(const State & st, llama_seq_id seq) const {
    if (!per_seq_ || seq < 0 || seq >= n_seq_max_) {
        return false;
    }
    for (size_t a = 0; a < per_seq_adapters_.size(); ++a) {
        const float got = per_seq_scales_[a * (size_t) n_seq_max_ + (size_t) seq];
        float want = 0.0f;
        for (const auto & p : st.adapters) {
            if (p.first == per_seq_adapters_[a]) {
                want = p.second;
            }
        }
        if (std::memcmp(&got, &want, sizeof(float)) != 0) {
            return false;
        }
    }
    for (const auto & p : st.adapters) {  // none of its adapters missing from the union
        if (std::find(per_seq_adapters_.begin(), per_seq_adapters_.end(), p.first) == per_seq_adapters_.end()) {
            return false;
        }
    }
    return true;
}

bool Context::has_saved_logits(llama_seq_id seq) const {
    return saved_valid_ && (!per_seq_ || det_state_) && seq == saved_seq_ && saved_state_ == applied_state()->id &&
           !prompt_logits_.empty() &&
           llama_memory_seq_pos_max(llama_get_memory(ctx_), seq) + 1 == saved_pos_;
}

void Context::invalidate_saved(llama_seq_id seq, llama_pos p0) {
    if (saved_valid_ && (seq < 0 || seq == saved_seq_) && p0 < saved_pos_) {
        saved_valid_ = false;
    }
}

void Context::check_seq(llama_seq_id seq) const {
    if (seq < 0 || seq >= n_seq_max_) {
        throw Error(ErrorKind::InvalidArgument, "sequence id " + std::to_string(seq) + " is out of range [0, " +
                                                    std::to_string(n_seq_max_) +
                                                    "): raise n_seq_max when creating the context");
    }
}

void Context::check_tokens(const llama_token * tokens, int32_t n) const {
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab_) {
            throw Error(ErrorKind::Token, "token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                              " is out of range [0, " + std::to_string(n_vocab_) + ")");
        }
    }
}

void Context::raw_decode(llama_batch & batch, int32_t n_outputs) {
    if (deterministic_ && tp_ == nullptr) {  // (set_threads could not remake the pools)
        throw Error(ErrorKind::OutOfMemory, "this deterministic context lost its thread pools (out of memory "
                                            "in set_threads): nothing decodes on the fast kernels in its place");
    }
    if (saved_valid_) {
        if (batch.pos == nullptr) {
            // positions continue each sequence: at or past saved_pos_ while
            // the saved prompt is intact (an edit below it invalidated already)
        } else {
            for (int32_t i = 0; i < batch.n_tokens && saved_valid_; ++i) {
                const bool mine = batch.seq_id == nullptr
                                      ? saved_seq_ == 0
                                      : std::find(batch.seq_id[i], batch.seq_id[i] + batch.n_seq_id[i], saved_seq_) !=
                                            batch.seq_id[i] + batch.n_seq_id[i];
                if (mine && batch.pos[i] < saved_pos_) {
                    saved_valid_ = false;
                }
            }
        }
    }
    take_last_log_error();
    int32_t rc = llama_decode(ctx_, batch);
    if (rc == 0) {
        last_n_outputs_ = n_outputs;
        out_capacity_ = std::max<int64_t>(out_capacity_, outputs_reserved_for(batch.n_tokens, n_outputs));
        return;
    }
    last_n_outputs_ = 0;
    if (rc == 1) {
        throw Error(ErrorKind::KVCacheFull,
                    "no KV cache slot for a batch of " + std::to_string(batch.n_tokens) +
                        " tokens: the context is full (clear or trim the KV cache, or raise n_ctx)", rc);
    }
    if (rc == 2) {
        throw_cancelled("decode");
    }
    throw Error(ErrorKind::Decode, with_reason("llama_decode failed with code " + std::to_string(rc)), rc);
}

int32_t Context::decode(const llama_token * tokens, int32_t n, const llama_pos * pos, const llama_seq_id * seq,
                        const int8_t * logits) {
    abort_.store(false, std::memory_order_relaxed);  // a cancel between calls is not for this one
    if (n <= 0) {
        throw Error(ErrorKind::InvalidArgument, "cannot decode an empty batch");
    }
    if (n > n_call_max_) {
        const bool ub = n_call_max_ < n_batch_;
        throw Error(ErrorKind::InvalidArgument,
                    "batch of " + std::to_string(n) + " tokens exceeds " + (ub ? "n_ubatch=" : "n_batch=") +
                        std::to_string(n_call_max_) +
                        (ub ? " (this model needs a whole batch in one ubatch)" : "") +
                        ": split it or raise " + (ub ? "n_ubatch" : "n_batch") + " when creating the context");
    }
    check_tokens(tokens, n);
    pos_buf_.resize(n);
    nseq_buf_.assign(n, 1);
    seq_buf_.resize(n);
    seqp_buf_.resize(n);
    out_buf_.resize(n);
    llama_memory_t mem = llama_get_memory(ctx_);
    // next position per sequence, for rows without explicit positions
    std::vector<llama_pos> next(n_seq_max_, -1);
    int32_t n_out = 0;
    for (int32_t i = 0; i < n; ++i) {
        llama_seq_id s = seq ? seq[i] : 0;
        check_seq(s);
        seq_buf_[i] = s;
        seqp_buf_[i] = &seq_buf_[i];
        llama_pos p;
        if (pos) {
            p = pos[i];
        } else {
            if (next[s] < 0) {
                next[s] = llama_memory_seq_pos_max(mem, s) + 1;
            }
            p = next[s]++;
        }
        if (p < 0 || p >= n_ctx_seq_) {
            throw Error(ErrorKind::ContextOverflow, "position " + std::to_string(p) + " of token " +
                                                        std::to_string(i) + " is outside the context [0, " +
                                                        std::to_string(n_ctx_seq_) + ")");
        }
        pos_buf_[i] = p;
        // with embeddings on (or no KV memory) llama.cpp outputs every row
        int8_t o = outputs_all() ? 1 : logits ? (logits[i] ? 1 : 0) : (i == n - 1 ? 1 : 0);
        out_buf_[i] = o;
        n_out += o;
    }
    llama_batch batch = {n, const_cast<llama_token *>(tokens), nullptr, pos_buf_.data(), nseq_buf_.data(),
                         seqp_buf_.data(), out_buf_.data()};
    raw_decode(batch, n_out);
    return n_out;
}

int32_t Context::embed(const llama_token * tokens, const int64_t * offsets, int32_t n_inputs, float * out,
                       bool normalize) {
    abort_.store(false, std::memory_order_relaxed);
    saved_valid_ = false;  // the KV is cleared below
    const enum llama_pooling_type pt = llama_pooling_type(ctx_);
    if (pt == LLAMA_POOLING_TYPE_NONE || pt == LLAMA_POOLING_TYPE_RANK || pt == LLAMA_POOLING_TYPE_UNSPECIFIED) {
        throw Error(ErrorKind::InvalidArgument,
                    "pooled embeddings need a context made with embeddings=True and pooling mean, cls or last");
    }
    if (n_inputs <= 0) {
        throw Error(ErrorKind::InvalidArgument, "no inputs to embed");
    }
    if (offsets[0] != 0) {
        throw Error(ErrorKind::InvalidArgument, "offsets must start at 0");
    }
    for (int32_t i = 0; i < n_inputs; ++i) {
        const int64_t len = offsets[i + 1] - offsets[i];
        if (len <= 0) {
            throw Error(ErrorKind::InvalidArgument,
                        "input " + std::to_string(i) + " has no tokens (offsets must increase strictly)");
        }
        const int64_t limit = std::min<int64_t>(n_call_max_, n_ctx_seq_);
        if (len > limit) {
            throw Error(ErrorKind::ContextOverflow, "input " + std::to_string(i) + " has " + std::to_string(len) +
                                                        " tokens, more than fit in one sequence (" +
                                                        std::to_string(limit) + "): truncate it");
        }
    }
    const int64_t total = offsets[n_inputs];
    for (int64_t k = 0; k < total; ++k) {
        if (tokens[k] < 0 || tokens[k] >= n_vocab_) {
            throw Error(ErrorKind::Token, "token id " + std::to_string(tokens[k]) + " at flat index " +
                                              std::to_string(k) + " is out of range [0, " + std::to_string(n_vocab_) +
                                              ")");
        }
    }
    const int32_t n_embd = llama_model_n_embd(model_);
    llama_memory_t mem = llama_get_memory(ctx_);
    int32_t n_batches = 0;
    int32_t i = 0;
    while (i < n_inputs) {
        // as many whole inputs as fit
        int32_t j = i;
        while (j < n_inputs && j - i < n_seq_max_ && offsets[j + 1] - offsets[i] <= n_call_max_) {
            ++j;
        }
        const int32_t n = static_cast<int32_t>(offsets[j] - offsets[i]);
        pos_buf_.resize(n);
        nseq_buf_.assign(n, 1);
        seq_buf_.resize(n);
        seqp_buf_.resize(n);
        out_buf_.assign(n, 1);
        for (int32_t k = i; k < j; ++k) {
            const int32_t b = static_cast<int32_t>(offsets[k] - offsets[i]);
            const int32_t e = static_cast<int32_t>(offsets[k + 1] - offsets[i]);
            for (int32_t t = b; t < e; ++t) {
                pos_buf_[t] = t - b;
                seq_buf_[t] = k - i;
            }
        }
        for (int32_t t = 0; t < n; ++t) {
            seqp_buf_[t] = &seq_buf_[t];
        }
        if (mem) {
            llama_memory_clear(mem, true);
        }
        if (abort_.load(std::memory_order_relaxed) || interrupted()) {
            throw_cancelled("embedding");
        }
        llama_batch batch = {n, const_cast<llama_token *>(tokens + offsets[i]), nullptr, pos_buf_.data(),
                             nseq_buf_.data(), seqp_buf_.data(), out_buf_.data()};
        raw_decode(batch, n);
        ++n_batches;
        for (int32_t k = i; k < j; ++k) {
            const float * v = llama_get_embeddings_seq(ctx_, k - i);
            if (!v) {
                throw Error(ErrorKind::Decode, with_reason("llama.cpp returned no pooled embedding"));
            }
            float * dst = out + static_cast<int64_t>(k) * n_embd;
            if (normalize) {
                double ss = 0.0;
                for (int32_t d = 0; d < n_embd; ++d) {
                    ss += static_cast<double>(v[d]) * v[d];
                }
                const float inv = ss > 0.0 ? static_cast<float>(1.0 / std::sqrt(ss)) : 1.0f;
                for (int32_t d = 0; d < n_embd; ++d) {
                    dst[d] = v[d] * inv;
                }
            } else {
                std::memcpy(dst, v, sizeof(float) * n_embd);
            }
        }
        i = j;
    }
    if (mem) {
        llama_memory_clear(mem, true);
    }
    return n_batches;
}

int32_t find_draft(const std::vector<llama_token> & hist, int32_t max_ngram, int32_t n_max, llama_token * out);

// How many of the available drafts a verify decode should carry, from what
// this generation measured: the seconds per token out of plain decodes and
// of verify decodes (kept drafts + the token sampled after them).  Drafting
// goes on while it yields tokens faster than plain decoding, with as many
// drafts as the last verify kept plus one (twice as many after a verify that
// kept all); otherwise plain decodes, with a draft now and then to look
// again.  (On a CPU with a small model a batch costs nearly its length in
// single decodes: only long runs of kept drafts pay.  Acceptance comes in
// runs -- a copied passage -- so it is measured, not modelled.)
struct DraftPlanner {
    explicit DraftPlanner(int32_t max_k) : max_k(max_k), want(max_k) {}
    int32_t max_k;
    int32_t want;            // drafts for the next verify
    double s_plain = 0.0;    // decayed mean seconds per token: plain decodes ...
    double s_draft = 0.0;    // ... and verify decodes
    int32_t n_plain = 0;     // plain decodes timed (the first one, a warm-up, is not counted)
    int32_t streak = 0;      // consecutive choices of one kind, to re-measure the other now and then

    int32_t plan(int32_t available) {
        if (available <= 0) {
            return 0;
        }
        if (n_plain < 2) {
            return 0;  // plain decodes first: their time is the yardstick
        }
        const bool drafting = s_draft <= 0.0 || s_draft < 0.95 * s_plain;
        if (++streak >= (drafting ? 16 : 64)) {
            streak = 0;
            return drafting ? 0 : std::min(available, 4);  // look at the other side again
        }
        return drafting ? std::min(available, want) : 0;
    }
    static double mix(double old, double x) { return old > 0.0 ? 0.7 * old + 0.3 * x : x; }
    void plain(double secs) {
        if (n_plain++ > 0) {
            s_plain = mix(s_plain, secs);
        }
    }
    void verified(double secs, int32_t k, int32_t n_kept, bool rejected) {
        s_draft = mix(s_draft, secs / (n_kept + 1));
        want = rejected ? std::max(1, n_kept + 1) : std::min(max_k, 2 * k);
    }
};

GenResult Context::generate(llama_sampler * smpl, const llama_token * prompt, int32_t n_prompt,
                            const GenParams & gp, token_cb_fn cb, void * user) {
    abort_.store(false, std::memory_order_relaxed);  // a cancel between requests is not for this one
    if (!has_memory_) {
        throw Error(ErrorKind::InvalidArgument,
                    "this model has no KV memory (an encoder-only/embedding model): it can't generate; "
                    "use decode() with embeddings=True");
    }
    check_seq(gp.seq_id);
    check_tokens(prompt, n_prompt);
    if (gp.n_logprobs < -1 || gp.n_logprobs > n_vocab_) {
        throw Error(ErrorKind::InvalidArgument, "logprobs must be between 0 and the vocabulary size (" +
                                                    std::to_string(n_vocab_) + ")");
    }
    for (const auto & s : gp.stop_sequences) {
        if (s.empty()) {
            throw Error(ErrorKind::InvalidArgument, "a stop token sequence is empty");
        }
        check_tokens(s.data(), (int32_t) s.size());
    }
    llama_memory_t mem = llama_get_memory(ctx_);
    llama_pos pos = llama_memory_seq_pos_max(mem, gp.seq_id) + 1;
    if (n_prompt <= 0 && !has_saved_logits(gp.seq_id)) {
        throw Error(ErrorKind::InvalidArgument,
                    "empty prompt: generation needs at least one new token to decode (a BOS token at least); "
                    "an empty prompt continues only right after a prompt this context decoded, under the same "
                    "state, with nothing decoded or removed below its end since");
    }
    if ((int64_t) pos + n_prompt > n_ctx_seq_) {
        throw Error(ErrorKind::ContextOverflow,
                    "prompt of " + std::to_string(n_prompt) + " tokens" +
                        (pos > 0 ? " after " + std::to_string(pos) + " cached ones" : std::string()) +
                        " does not fit in the context of " + std::to_string(n_ctx_seq_) +
                        " tokens: shorten it or raise n_ctx");
    }
    GenResult res;
    // Prompt, in n_batch chunks (or chunks aligned to gp.chunk positions);
    // only the last token needs logits.
    if (gp.chunk < 0) {
        throw Error(ErrorKind::InvalidArgument, "chunk must be >= 0");
    }
    const int32_t chunk = gp.chunk > 0 ? std::min(gp.chunk, n_call_max_) : n_call_max_;
    const bool aligned = gp.chunk > 0;
    std::vector<llama_pos> pbuf(chunk);
    std::vector<int32_t> nsbuf(chunk, 1);
    llama_seq_id sid = gp.seq_id;
    std::vector<llama_seq_id *> spbuf(chunk, &sid);
    std::vector<int8_t> obuf(chunk, 0);
    for (int32_t off = 0; off < n_prompt;) {
        int32_t n = std::min(chunk, n_prompt - off);
        if (aligned) {  // end at the next multiple of chunk
            n = std::min(n, chunk - (int32_t) (pos % chunk));
        }
        for (int32_t i = 0; i < n; ++i) {
            pbuf[i] = pos + i;
            obuf[i] = 0;
        }
        bool last = off + n == n_prompt;
        if (outputs_all()) {  // llama.cpp outputs every row anyway: say so
            std::fill(obuf.begin(), obuf.begin() + n, 1);
        } else if (last) {
            obuf[n - 1] = 1;
        }
        llama_batch b = {n, const_cast<llama_token *>(prompt + off), nullptr, pbuf.data(), nsbuf.data(),
                         spbuf.data(), obuf.data()};
        raw_decode(b, outputs_all() ? n : last ? 1 : 0);
        pos += n;
        off += n;
        res.n_prompt += n;
    }
    bool saved = res.n_prompt == 0;
    if (!saved) {
        // keep the prompt's final logits: a repeat of this prompt under the
        // same state can then start sampling without decoding anything
        const float * lg = llama_get_logits_ith(ctx_, -1);
        if (lg != nullptr) {
            prompt_logits_.assign(lg, lg + n_vocab_);
            saved_valid_ = true;
            saved_seq_ = gp.seq_id;
            saved_pos_ = pos;
            saved_state_ = applied_state()->id;
        }
    }
    const int32_t max_tokens = gp.max_tokens < 0 ? INT32_MAX : gp.max_tokens;
    if (max_tokens == 0) {
        res.finish = Finish::Length;
        return res;
    }
    if (gp.draft_ngram < 0 || gp.draft_n < 0) {
        throw Error(ErrorKind::InvalidArgument, "draft_ngram and draft_n must be >= 0");
    }
    // speculative decoding: at most n_call_max_ tokens per verify decode
    const int32_t draft_n = gp.draft_ngram > 0 ? std::min(gp.draft_n, n_call_max_ - 1) : 0;
    std::vector<llama_token> hist;  // history + prompt + output, for the n-gram lookup
    std::vector<llama_token> vbuf;  // a verify batch: the sampled token, then the drafts
    std::vector<llama_pos> vpos;
    std::vector<int8_t> vout;
    std::vector<llama_seq_id *> vseq;
    std::vector<int32_t> vns;
    if (draft_n > 0) {
        hist.reserve(gp.history.size() + n_prompt + 256);
        hist.assign(gp.history.begin(), gp.history.end());
        hist.insert(hist.end(), prompt, prompt + n_prompt);
        vbuf.resize(draft_n + 1);
        vpos.resize(draft_n + 1);
        vout.assign(draft_n + 1, 1);
        vseq.assign(draft_n + 1, &sid);
        vns.assign(draft_n + 1, 1);
    }
    llama_token tok;
    int8_t one = 1;
    DraftPlanner planner(draft_n);
    double t_verify = 0.0;
    int32_t n_draft = 0;   // drafts of the last verify decode ...
    int32_t row = 0;       // ... and the output row the next token is sampled from
    float lp = 0.0f;  // the sampled token's logprob and the likeliest, when asked for
    std::vector<std::pair<llama_token, float>> top;
    std::vector<std::pair<float, llama_token>> lp_scratch;
    for (;;) {
        // The row this token is sampled from: the saved prompt logits, the
        // last decode's only row, or row `row` of a verify decode (whose
        // logprobs are this token's own, not the verify batch's last row's).
        const float * lg;
        if (saved) {
            lg = prompt_logits_.data();
        } else {
            lg = llama_get_logits_ith(ctx_, n_draft > 0 ? row : -1);
            if (lg == nullptr) {
                throw Error(ErrorKind::Decode, with_reason("no logits after decode"));
            }
        }
        saved = false;
        if (gp.plain_greedy) {
            // A chain that is only llama.cpp's greedy sampler picks the first
            // maximum logit; doing that directly skips building the
            // n_vocab-sized candidate array every token.
            tok = greedy_pick(lg, n_vocab_);
            llama_sampler_accept(smpl, tok);
        } else {
            tok = sample_chain(smpl, gp.grammar, lg);
        }
        if (gp.n_logprobs >= 0) {
            token_logprobs(lg, n_vocab_, tok, gp.n_logprobs, lp_scratch, lp, top);
        }
        bool in_kv = false;  // tok is a kept draft: its KV is in place
        if (n_draft > 0) {
            // Row `row` followed draft row-1 (row 0: the token before the
            // drafts).  A sampled token equal to draft `row` keeps it: its
            // KV is in place, and row+1's logits follow it.  Otherwise the
            // drafts from `row` on are dropped and `tok` is decoded next.
            if (row < n_draft && tok == vbuf[row + 1]) {
                in_kv = true;
                ++res.n_accepted;
                ++row;
                ++pos;
            } else {
                llama_memory_seq_rm(llama_get_memory(ctx_), gp.seq_id, pos, -1);
                planner.verified(t_verify, n_draft, row, row < n_draft);
                n_draft = 0;
            }
        }
        bool keep_going = true;  // (a draft accepted above is already in the KV)
        if (!gp.ignore_eos && llama_vocab_is_eog(vocab_, tok)) {
            res.finish = Finish::Eog;
            keep_going = false;
        } else {
            res.tokens.push_back(tok);
            if (draft_n > 0) {
                hist.push_back(tok);
            }
            if (cb != nullptr) {
                int r = cb(user, tok, lp, top.data(), gp.n_logprobs >= 0 ? (int32_t) top.size() : -1);
                if (r != 0) {
                    res.finish = Finish::Callback;  // r < 0: the caller re-raises
                    keep_going = false;
                }
            }
            for (const auto & s : gp.stop_sequences) {
                if (keep_going && res.tokens.size() >= s.size() &&
                    std::equal(s.begin(), s.end(), res.tokens.end() - (ptrdiff_t) s.size())) {
                    res.finish = Finish::StopSequence;
                    keep_going = false;
                }
            }
            if (keep_going && (int32_t) res.tokens.size() >= max_tokens) {
                res.finish = Finish::Length;
                keep_going = false;
            }
            // prompt + output never exceed the context (as llama-cpp-python
            // and OpenAI count): this token's cell is the last one
            if (keep_going && pos + 1 >= n_ctx_seq_) {
                res.finish = Finish::ContextFull;
                keep_going = false;
            }
        }
        if (!keep_going) {
            if (n_draft > 0) {
                // The KV ends as without drafts: the prompt and every output
                // token but the last (never decoded there), nothing after.
                llama_memory_seq_rm(llama_get_memory(ctx_), gp.seq_id, in_kv ? pos - 1 : pos, -1);
            }
            return res;
        }
        if (abort_.load(std::memory_order_relaxed) || interrupted()) {
            throw_cancelled("generation");
        }
        if (n_draft > 0) {
            continue;  // the next row of the verify decode
        }
        int32_t k = 0;
        if (draft_n > 0) {
            // no more drafts than tokens still wanted, or room in the context
            // (k kept drafts and the token sampled after them make k + 1)
            int32_t cap = (int32_t) std::min<int64_t>(
                draft_n, std::min<int64_t>((int64_t) max_tokens - (int64_t) res.tokens.size() - 1,
                                           (int64_t) n_ctx_seq_ - pos - 1));
            k = cap > 0 ? find_draft(hist, gp.draft_ngram, cap, vbuf.data() + 1) : 0;
            if (gp.draft_adaptive) {
                k = planner.plan(k);  // how many of them are worth verifying
            }
        }
        ++res.n_decodes;
        if (k == 0) {
            llama_batch b = {1, &tok, nullptr, &pos, nsbuf.data(), spbuf.data(), &one};
            const auto t0 = std::chrono::steady_clock::now();
            raw_decode(b, 1);
            if (draft_n > 0) {
                planner.plain(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            }
            ++pos;
            continue;
        }
        vbuf[0] = tok;
        for (int32_t i = 0; i <= k; ++i) {
            vpos[i] = pos + i;
        }
        llama_batch b = {k + 1, vbuf.data(), nullptr, vpos.data(), vns.data(), vseq.data(), vout.data()};
        const auto t0 = std::chrono::steady_clock::now();
        raw_decode(b, k + 1);
        t_verify = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        ++pos;
        res.n_drafted += k;
        n_draft = k;
        row = 0;
    }
}

int32_t find_draft(const std::vector<llama_token> & hist, int32_t max_ngram, int32_t n_max, llama_token * out) {
    // The longest n-gram ending `hist` that also occurs earlier, at its
    // first occurrence with at least one token after it: those tokens.
    const int64_t len = (int64_t) hist.size();
    for (int64_t n = std::min<int64_t>(max_ngram, len - 1); n >= 1; --n) {
        const llama_token * tail = hist.data() + len - n;
        for (int64_t i = 0; i + n < len; ++i) {
            if (std::equal(tail, tail + n, hist.data() + i)) {
                const int64_t start = i + n;
                const int64_t m = std::min<int64_t>(n_max, len - start);
                std::copy(hist.data() + start, hist.data() + start + m, out);
                return (int32_t) m;
            }
        }
    }
    return 0;
}

llama_token greedy_pick(const float * lg, int32_t n_vocab) {
    int32_t best = 0;
    float bv = lg[0];
    bool nan = bv != bv;
    for (int32_t i = 1; i < n_vocab; ++i) {
        if (lg[i] > bv) {
            bv = lg[i];
            best = i;
        } else if (lg[i] != lg[i]) {
            nan = true;
        }
    }
    if (nan) {
        throw Error(ErrorKind::InvalidArgument,
                    "the model's logits are not finite (NaN): an adapter scale or control vector this large "
                    "overflows the model; use smaller ones");
    }
    return best;
}

void token_logprobs(const float * logits, int32_t n_vocab, llama_token tok, int32_t k,
                    std::vector<std::pair<float, llama_token>> & scratch, float & logprob,
                    std::vector<std::pair<llama_token, float>> & top) {
    float mx = logits[0];
    for (int32_t i = 1; i < n_vocab; ++i) {
        mx = std::max(mx, logits[i]);
    }
    double sum = 0.0;  // (a NaN logit makes it NaN, and so every logprob: the caller reports that)
    for (int32_t i = 0; i < n_vocab; ++i) {
        sum += std::exp((double) logits[i] - mx);
    }
    const float lse = mx + (float) std::log(sum);
    logprob = logits[tok] - lse;
    top.clear();
    k = std::min(k, n_vocab);
    if (k > 0) {
        scratch.resize(n_vocab);
        for (int32_t i = 0; i < n_vocab; ++i) {
            scratch[i] = {logits[i], i};
        }
        std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(), [](const auto & a, const auto & b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        top.reserve(k);
        for (int32_t i = 0; i < k; ++i) {
            top.emplace_back(scratch[i].second, scratch[i].first - lse);
        }
    }
}

llama_token Context::sample(llama_sampler * chain, llama_sampler * grammar, int32_t row) {
    abort_.store(false, std::memory_order_relaxed);  // a cancel between calls is not for this one
    if (row < 0 || row >= last_n_outputs_) {
        throw Error(ErrorKind::InvalidArgument, "output row " + std::to_string(row) + " is out of range for " +
                                                    std::to_string(last_n_outputs_) + " outputs");
    }
    // llama_get_logits_ith takes negative indices from the end of the outputs
    const float * lg = llama_get_logits_ith(ctx_, row - last_n_outputs_);
    if (lg == nullptr) {
        throw Error(ErrorKind::InvalidArgument, with_reason("no logits for output row " + std::to_string(row)));
    }
    return sample_chain(chain, grammar, lg);
}

llama_token Context::sample_logits(llama_sampler * chain, llama_sampler * grammar, const float * logits) {
    abort_.store(false, std::memory_order_relaxed);
    return sample_chain(chain, grammar, logits);
}

std::vector<uint8_t> Context::state_seq_get(llama_seq_id seq) {
    check_seq(seq);
    std::vector<uint8_t> out(llama_state_seq_get_size(ctx_, seq));
    size_t n = out.empty() ? 0 : llama_state_seq_get_data(ctx_, out.data(), out.size(), seq);
    out.resize(n);
    return out;
}

void Context::state_seq_set(const uint8_t * data, size_t n, llama_seq_id seq) {
    check_seq(seq);
    invalidate_saved(seq, 0);
    llama_memory_seq_rm(llama_get_memory(ctx_), seq, -1, -1);
    if (n == 0) {
        return;
    }
    if (llama_state_seq_set_data(ctx_, data, n, seq) != n) {
        llama_memory_seq_rm(llama_get_memory(ctx_), seq, -1, -1);
        throw Error(ErrorKind::InvalidArgument,
                    "the saved sequence state does not fit this context (another model, KV cache type or size, "
                    "or truncated data)");
    }
}

// patch 0011: the calling thread's grammar-parser step budget starts afresh
extern "C" void llamax_grammar_reset_steps(void);

void accept_checked(llama_sampler * chain, llama_sampler * grammar, llama_token token) {
    if (grammar != nullptr) {
        llama_token_data one = {token, 0.0f, 0.0f};
        llama_token_data_array arr = {&one, 1, -1, false};
        try {
            llama_sampler_apply(grammar, &arr);  // const for grammars: no state change
        } catch (const std::exception & e) {  // patch 0011's bounds on parse stacks
            throw Error(ErrorKind::Grammar, e.what());
        }
        if (std::isinf(one.logit) && one.logit < 0) {
            throw Error(ErrorKind::Grammar, "token " + std::to_string(token) +
                                                " is not allowed by the grammar at this point");
        }
    }
    try {
        llama_sampler_accept(chain, token);
    } catch (const std::exception & e) {
        throw Error(ErrorKind::Grammar, std::string("the sampler could not accept token ") +
                                            std::to_string(token) + ": " + e.what());
    }
}

// Greedy under a grammar without judging the whole vocabulary: the best
// candidates, best first (ties to the lower id, as the greedy sampler breaks
// them), are put to the grammar one at a time, and the first it allows is
// the pick: the argmax of what the grammar allows, the same token as masking
// every candidate and taking the maximum.  -1 when none of the first few is
// allowed (or all of them are banned): the caller masks everything.
// LLAMAX_GRAMMAR_MASK_ALL=1 turns the shortcut below off (the tests compare
// the two ways; read once).
static bool mask_all_candidates() {
    static const bool on = [] {
        const char * v = std::getenv("LLAMAX_GRAMMAR_MASK_ALL");
        return v != nullptr && std::strcmp(v, "1") == 0;
    }();
    return on;
}

static llama_token greedy_under_grammar(llama_sampler * grammar, const llama_token_data_array & arr) {
    constexpr size_t kTries = 16;
    // NaN ranks lowest (and then ends the search below): comparisons with it
    // would break the order
    auto key = [&](size_t i) { const float l = arr.data[i].logit; return l == l ? l : -INFINITY; };
    auto better = [&](size_t a, size_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); };
    size_t best[kTries];
    size_t k = 0;
    for (size_t i = 0; i < arr.size; ++i) {  // the kTries best, best first, in one pass
        if (k == kTries && !better(i, best[k - 1])) {
            continue;
        }
        size_t j = k < kTries ? k++ : kTries - 1;
        for (; j > 0 && better(i, best[j - 1]); --j) {
            best[j] = best[j - 1];
        }
        best[j] = i;
    }
    for (size_t j = 0; j < k; ++j) {
        llama_token_data one = arr.data[best[j]];
        if (!(one.logit > -INFINITY)) {
            return -1;  // banned from here on (or NaN): the full path says which
        }
        llama_token_data_array single = {&one, 1, -1, false};
        try {
            llama_sampler_apply(grammar, &single);
        } catch (const std::exception & e) {  // patch 0011's bounds on parse stacks
            throw Error(ErrorKind::Grammar, e.what());
        }
        if (one.logit > -INFINITY) {
            return one.id;
        }
    }
    return -1;
}

llama_token sample_logits_with(llama_sampler * chain, llama_sampler * grammar, const float * logits,
                               int32_t n_vocab, std::vector<llama_token_data> & cand,
                               void (*stop)(void * user), void * user) {
    cand.resize(n_vocab);
    for (int32_t i = 0; i < n_vocab; ++i) {
        cand[i] = llama_token_data{i, logits[i], 0.0f};
    }
    llama_token_data_array arr = {cand.data(), cand.size(), -1, false};
    if (grammar == nullptr) {
        llama_sampler_apply(chain, &arr);
    } else {
        // What the chain's apply does, sampler by sampler, except that the
        // grammar sees the candidates in slices: its work per token can
        // explode on ambiguous grammars, and between slices a cancel or
        // Ctrl-C stops it.  Each candidate is judged on its own, so slicing
        // changes no result.  The parser's step budget (patch 0011) is per
        // token: it starts from zero here, whatever this thread did before.
        llamax_grammar_reset_steps();
        const int n = llama_sampler_chain_n(chain);
        for (int i = 0; i < n; ++i) {
            llama_sampler * s = llama_sampler_chain_get(chain, i);
            if (s != grammar) {
                llama_sampler_apply(s, &arr);
                continue;
            }
            if (i == n - 2 && !mask_all_candidates() &&
                std::strcmp(llama_sampler_name(llama_sampler_chain_get(chain, n - 1)), "greedy") == 0) {
                const llama_token id = greedy_under_grammar(grammar, arr);
                if (id >= 0) {
                    accept_checked(chain, nullptr, id);
                    return id;
                }
            }
            constexpr size_t kSlice = 2048;
            for (size_t off = 0; off < arr.size; off += kSlice) {
                llama_token_data_array part = {arr.data + off, std::min(kSlice, arr.size - off), -1, false};
                try {
                    llama_sampler_apply(grammar, &part);
                } catch (const std::exception & e) {  // patch 0011's bounds on parse stacks
                    throw Error(ErrorKind::Grammar, e.what());
                }
                if (stop != nullptr) {
                    stop(user);
                }
            }
        }
    }
    if (arr.selected < 0 || arr.selected >= (int64_t) arr.size) {
        throw Error(ErrorKind::Decode, "the sampler chain selected no token");
    }
    const llama_token_data & pick = arr.data[arr.selected];
    // Every candidate banned: greedy then picks the first, a random draw the
    // last -- a token nothing allowed.  Under a grammar a pick at -inf is
    // always a dead end, whatever p the draw gave it (top_k=1 leaves one
    // candidate at -inf with p = 1: accepting it -- an end-of-generation
    // token the grammar can't end on -- is a GGML_ABORT in llama.cpp).
    if (grammar != nullptr && !(pick.logit > -INFINITY)) {
        throw Error(ErrorKind::Grammar,
                    "no token satisfies the grammar here (a dead end: the grammar allows nothing, or "
                    "logit_bias bans every token it allows)");
    }
    if (!(pick.logit > -INFINITY) && !(pick.p > 0.0f)) {
        if (grammar != nullptr) {
            throw Error(ErrorKind::Grammar,
                        "no token satisfies the grammar here (a dead end: the grammar allows nothing, or "
                        "logit_bias bans every token it allows)");
        }
        if (pick.logit != pick.logit) {  // NaN: the logits are not numbers
            throw Error(ErrorKind::InvalidArgument,
                        "the model's logits are not finite (NaN): an adapter scale or control vector this large "
                        "overflows the model; use smaller ones");
        }
        throw Error(ErrorKind::InvalidArgument, "every token is banned (logit_bias): nothing can be sampled");
    }
    // The grammar already set every token it rejects to -inf and a dead end
    // is caught above, so the pick needs no second grammar test (nullptr).
    const llama_token id = pick.id;
    accept_checked(chain, nullptr, id);
    return id;
}

llama_token Context::sample_chain(llama_sampler * chain, llama_sampler * grammar, const float * logits) {
    auto stop = [](void * user) {
        const auto * c = static_cast<const Context *>(user);
        if (c->abort_.load(std::memory_order_relaxed) || c->interrupted()) {
            c->throw_cancelled("sampling under the grammar");
        }
    };
    return sample_logits_with(chain, grammar, logits, n_vocab_, cand_, stop, this);
}

namespace {

struct ReasoningBudget {
    enum Phase { Before, Inside, Forcing, Done };
    const llama_vocab * vocab;
    int32_t budget;
    std::string start, end;
    std::vector<llama_token> forced;
    bool started_open;
    Phase phase = Before;
    std::string text;        // Before: the output so far; Inside: its tail (to find `end` across pieces)
    int32_t n_inside = 0;    // tokens accepted inside the open section
    size_t n_forced = 0;     // forced tokens accepted

    void restart() {
        text.clear();
        n_inside = 0;
        n_forced = 0;
        phase = Before;
        if (started_open) {
            open_at(0);
        }
    }
    // The section is open; `from` = where its text begins in `text`.
    void open_at(size_t from) {
        text.erase(0, from);
        phase = Inside;
        check_inside();
    }
    void check_inside() {
        if (text.find(end) != std::string::npos) {
            phase = Done;
            text.clear();
            return;
        }
        if (text.size() > end.size() + 256) {  // keep only what may still hold the start of `end`
            text.erase(0, text.size() - end.size());
        }
        if (n_inside >= budget) {
            phase = forced.empty() ? Done : Forcing;
            text.clear();
        }
    }
    void accept(llama_token tok) {
        switch (phase) {
            case Done:
                return;
            case Forcing:
                if (tok == forced[n_forced] && ++n_forced < forced.size()) {
                    return;
                }
                phase = Done;
                return;
            case Before:
            case Inside:
                break;
        }
        char buf[256];
        int32_t n = llama_token_to_piece(vocab, tok, buf, sizeof buf, 0, false);
        std::string piece;
        if (n >= 0) {
            piece.assign(buf, (size_t) n);
        } else {
            piece.resize((size_t) -n);
            n = llama_token_to_piece(vocab, tok, piece.data(), (int32_t) piece.size(), 0, false);
            piece.resize(n > 0 ? (size_t) n : 0);
        }
        if (phase == Inside) {
            ++n_inside;
            text += piece;
            check_inside();
            return;
        }
        text += piece;
        const size_t lead = text.find_first_not_of(" \t\r\n\v\f");
        if (lead == std::string::npos) {
            if (text.size() > 4096) {  // only whitespace, for long: no section here
                phase = Done;
                text.clear();
            }
            return;
        }
        const std::string_view rest(text.data() + lead, text.size() - lead);
        if (rest.size() >= start.size() && rest.compare(0, start.size(), start) == 0) {
            open_at(lead + start.size());  // (the token that completed `start` is not counted)
        } else if (start.compare(0, rest.size(), rest) != 0) {
            phase = Done;  // the output does not begin with the section
            text.clear();
        }
    }
    void apply(llama_token_data_array * cur) const {
        if (phase != Forcing) {
            return;
        }
        const llama_token want = forced[n_forced];
        for (size_t i = 0; i < cur->size; ++i) {
            if (cur->data[i].id != want) {
                cur->data[i].logit = -INFINITY;
            }
        }
    }
};

const char * rb_name(const llama_sampler *) { return "llamax-reasoning-budget"; }
void rb_accept(llama_sampler * s, llama_token tok) { static_cast<ReasoningBudget *>(s->ctx)->accept(tok); }
void rb_apply(llama_sampler * s, llama_token_data_array * cur) { static_cast<ReasoningBudget *>(s->ctx)->apply(cur); }
void rb_reset(llama_sampler * s) { static_cast<ReasoningBudget *>(s->ctx)->restart(); }
llama_sampler * rb_clone(const llama_sampler * s);
void rb_free(llama_sampler * s) { delete static_cast<ReasoningBudget *>(s->ctx); }

llama_sampler_i rb_iface() {
    llama_sampler_i i{};
    i.name = rb_name;
    i.accept = rb_accept;
    i.apply = rb_apply;
    i.reset = rb_reset;
    i.clone = rb_clone;
    i.free = rb_free;
    return i;
}

llama_sampler_i kReasoningBudgetIface = rb_iface();

llama_sampler * rb_clone(const llama_sampler * s) {
    auto * copy = new ReasoningBudget(*static_cast<const ReasoningBudget *>(s->ctx));
    return llama_sampler_init(&kReasoningBudgetIface, copy);
}

}  // namespace

llama_sampler * reasoning_budget_init(const llama_vocab * vocab, int32_t budget, const std::string & start,
                                      const std::string & end, const std::vector<llama_token> & forced,
                                      bool started_open) {
    if (budget < 0) {
        throw Error(ErrorKind::InvalidArgument, "the reasoning budget must be >= 0 tokens");
    }
    if (start.empty() || end.empty()) {
        throw Error(ErrorKind::InvalidArgument, "the reasoning section's start and end tags must not be empty");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token t : forced) {
        if (t < 0 || t >= n_vocab) {
            throw Error(ErrorKind::InvalidArgument, "a forced token id is out of the vocabulary");
        }
    }
    auto * rb = new ReasoningBudget{vocab, budget, start, end, forced, started_open};
    rb->restart();
    return llama_sampler_init(&kReasoningBudgetIface, rb);
}

int64_t gbnf_max_nesting(const std::string & t) {
    int64_t depth = 0, deepest = 0;
    for (size_t i = 0; i < t.size(); ++i) {
        const char ch = t[i];
        if (ch == '"' || ch == '[') {  // a literal or a class: skip to its end, honouring escapes
            const char close = ch == '"' ? '"' : ']';
            for (++i; i < t.size() && t[i] != close; ++i) {
                if (t[i] == '\\') {
                    ++i;
                }
            }
        } else if (ch == '#') {
            while (i < t.size() && t[i] != '\n' && t[i] != '\r') {
                ++i;
            }
        } else if (ch == '(') {
            deepest = std::max(deepest, ++depth);
        } else if (ch == ')') {
            depth = std::max<int64_t>(0, depth - 1);
        }
    }
    return deepest;
}

void Context::kv_clear() {
    saved_valid_ = false;
    llama_memory_clear(llama_get_memory(ctx_), true);
}

bool Context::kv_remove(llama_seq_id seq, llama_pos p0, llama_pos p1) {
    if (seq != -1) {  // -1: every sequence; other negatives assert in llama.cpp
        check_seq(seq);
    }
    if (p1 < 0 || p1 > std::max<llama_pos>(p0, 0)) {  // a non-empty range from max(p0, 0)
        invalidate_saved(seq, std::max<llama_pos>(p0, 0));
    }
    return llama_memory_seq_rm(llama_get_memory(ctx_), seq, p0, p1);
}

void Context::kv_copy(llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1) {
    check_seq(src);
    check_seq(dst);
    if (src == dst) {
        return;
    }
    // Without a unified KV buffer each sequence has its own stream, and
    // llama.cpp copies only whole streams (it asserts on a partial range).
    if (!kv_unified_ && n_seq_max_ > 1 && (p0 > 0 || p1 >= 0)) {
        throw Error(ErrorKind::InvalidArgument,
                    "with kv_unified=False only whole sequences can be copied (p0 and p1 left at -1); "
                    "the copy replaces all of the destination sequence");
    }
    invalidate_saved(dst, 0);
    llama_memory_seq_cp(llama_get_memory(ctx_), src, dst, p0, p1);
}

void Context::kv_keep(llama_seq_id seq) {
    check_seq(seq);
    if (seq != saved_seq_) {
        saved_valid_ = false;
    }
    llama_memory_seq_keep(llama_get_memory(ctx_), seq);
}

llama_pos Context::seq_pos_max(llama_seq_id seq) {
    check_seq(seq);
    return llama_memory_seq_pos_max(llama_get_memory(ctx_), seq);
}

}  // namespace llamax
