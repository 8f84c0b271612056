// The batcher's per-step decisions as plain data (batch_plan.h).
#include "batch_plan.h"

#include <algorithm>
#include <climits>

namespace llamax {
namespace plan {

bool pick_group(const std::vector<SeqView> & running, int32_t n_slots, int32_t quantum, GroupState & st) {
    bool cur_alive = false, other_waits = false;
    for (const auto & s : running) {
        if (s.ready) {
            (st.have && s.key == st.cur ? cur_alive : other_waits) = true;
        }
    }
    if (cur_alive && !(other_waits && st.quantum_left <= 0)) {
        --st.quantum_left;
        return false;
    }
    const SeqView * pick = nullptr;
    for (int32_t k = 0; k < n_slots && pick == nullptr; ++k) {
        const int32_t slot = (int32_t) ((st.rr + (size_t) k) % (size_t) n_slots);
        for (const auto & s : running) {
            if (s.slot == slot && s.ready && (!st.have || s.key != st.cur)) {
                pick = &s;
                break;
            }
        }
    }
    for (size_t i = 0; pick == nullptr && i < running.size(); ++i) {
        if (running[i].ready) {
            pick = &running[i];
        }
    }
    if (pick == nullptr) {
        return false;
    }
    const bool switched = st.have && pick->key != st.cur;
    st.cur = pick->key;
    st.have = true;
    st.rr = (size_t) (pick->slot + 1) % (size_t) n_slots;
    st.quantum_left = quantum - 1;
    return switched;
}

void BatchPlan::clear() {
    tok.clear();
    pos.clear();
    seq.clear();
    out.clear();
    parts.clear();
    newcomer_step = shorts_only = long_chunk = false;
    min_left = INT32_MAX;
    n_out = 0;
}

void compose_batch(std::vector<Member> & group, const BatchPolicy & p, const Follow & follow, BatchPlan & out) {
    out.clear();
    if (p.newcomer_steps) {
        for (const auto & m : group) {
            out.newcomer_step = out.newcomer_step || m.newcomer;
        }
    }
    const int32_t n = (int32_t) group.size();
    for (int32_t i = 0; i < n; ++i) {
        const Member & m = group[i];
        if (!out.newcomer_step && m.n_fed == m.n_prompt && m.ready && (int32_t) out.tok.size() < p.budget) {
            out.parts.push_back({i, 0, (int32_t) out.tok.size()});
            out.tok.push_back(m.next);
            out.pos.push_back(m.pos);
            out.seq.push_back(m.seq);
            out.out.push_back(1);
        }
    }
    std::vector<int32_t> prompts;
    for (int32_t i = 0; i < n; ++i) {
        const Member & m = group[i];
        if (m.n_fed < m.n_prompt && (!out.newcomer_step || m.newcomer)) {
            prompts.push_back(i);
        }
    }
    std::stable_sort(prompts.begin(), prompts.end(), [&](int32_t a, int32_t b) {
        return group[a].n_prompt - group[a].n_fed < group[b].n_prompt - group[b].n_fed;
    });
    bool any_short = false, any_long = false;
    for (int32_t i : prompts) {
        (group[i].n_prompt - group[i].n_fed <= p.prompt_step ? any_short : any_long) = true;
    }
    out.shorts_only = any_short && any_long && !p.last_shorts_only;
    for (int32_t i : prompts) {
        Member & m = group[i];
        const int32_t left = m.n_prompt - m.n_fed;
        if (out.shorts_only && left > p.prompt_step) {
            continue;
        }
        if (!follow(i, m)) {
            continue;
        }
        const int32_t room = p.budget - (int32_t) out.tok.size();
        if (room <= 0) {
            break;
        }
        int32_t k = std::min(room, m.n_prompt - m.n_fed);
        if (p.align) {  // end at the next multiple of the chunk (a cold run's chunks and a cached one's match)
            k = std::min(k, p.prefix_chunk - (int32_t) (m.pos % p.prefix_chunk));
        } else if (!p.alone) {
            k = std::min(k, p.prompt_step);
        }
        if (left > p.prompt_step) {
            out.long_chunk = true;
            out.min_left = std::min(out.min_left, left);
        }
        for (int32_t j = 0; j < k; ++j) {
            out.tok.push_back(m.prompt[m.n_fed + j]);
            out.pos.push_back(m.pos + j);
            out.seq.push_back(m.seq);
            out.out.push_back(0);
        }
        int32_t row = -1;
        if (m.n_fed + k == m.n_prompt) {
            out.out.back() = 1;
            row = (int32_t) out.tok.size() - 1;
        }
        out.parts.push_back({i, k, row});
    }
    for (int8_t o : out.out) {
        out.n_out += o;
    }
}

}  // namespace plan
}  // namespace llamax
