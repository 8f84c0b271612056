// Unit tests of the batcher's plain-data decisions (csrc/batch_plan.h): no
// model, no llama.cpp.  Built and run by tests/core/test_batch_plan.py.
#include "batch_plan.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace llamax::plan;

static int failures = 0;
static int checks = 0;

#define CHECK(cond) do { ++checks; if (!(cond)) { ++failures; \
    std::fprintf(stderr, "%s:%d: %s: CHECK(%s) failed\n", __FILE__, __LINE__, current, #cond); } } while (0)

static const char * current = "";

static std::vector<uint64_t> run_groups(std::vector<SeqView> running, int32_t n_slots, int32_t quantum, int steps,
                                        GroupState & st, int * switches = nullptr) {
    std::vector<uint64_t> out;
    for (int i = 0; i < steps; ++i) {
        if (pick_group(running, n_slots, quantum, st) && switches != nullptr) {
            ++*switches;
        }
        out.push_back(st.cur);
    }
    return out;
}

static void test_groups() {
    current = "first pick: the group of the first ready slot from rr";
    {
        GroupState st;
        bool sw = pick_group({{1, 20, true}, {0, 10, true}}, 4, 3, st);
        CHECK(!sw && st.have && st.cur == 10 && st.rr == 1 && st.quantum_left == 2);
    }
    current = "a group keeps the context for its quantum while others wait, then the next one has it";
    {
        GroupState st;
        int switches = 0;
        auto seq = run_groups({{0, 10, true}, {1, 20, true}}, 2, 2, 6, st, &switches);
        CHECK((seq == std::vector<uint64_t>{10, 10, 20, 20, 10, 10}));
        CHECK(switches == 2);
    }
    current = "with nobody else waiting, the group runs on past its quantum";
    {
        GroupState st;
        auto seq = run_groups({{0, 10, true}, {1, 20, false}}, 2, 1, 4, st);
        CHECK((seq == std::vector<uint64_t>{10, 10, 10, 10}));
    }
    current = "three groups, quantum 1: round robin in slot order";
    {
        GroupState st;
        auto seq = run_groups({{2, 30, true}, {0, 10, true}, {1, 20, true}}, 3, 1, 6, st);
        CHECK((seq == std::vector<uint64_t>{10, 20, 30, 10, 20, 30}));
    }
    current = "the current group with no ready sequence gives way at once";
    {
        GroupState st;
        pick_group({{0, 10, true}, {1, 20, true}}, 2, 100, st);
        CHECK(st.cur == 10);
        bool sw = pick_group({{0, 10, false}, {1, 20, true}}, 2, 100, st);
        CHECK(sw && st.cur == 20 && st.quantum_left == 99);
    }
    current = "nobody ready: nothing changes";
    {
        GroupState st;
        pick_group({{0, 10, true}}, 2, 2, st);
        GroupState before = st;
        bool sw = pick_group({{0, 10, false}, {1, 20, false}}, 2, 2, st);
        CHECK(!sw && st.cur == before.cur && st.rr == before.rr && st.quantum_left == before.quantum_left);
    }
    current = "rr wraps: the search starts after the last group's slot, cyclically";
    {
        GroupState st;
        st.have = true;
        st.cur = 99;      // a group that has left
        st.rr = 3;
        pick_group({{1, 10, true}, {3, 30, true}, {2, 20, true}}, 4, 1, st);
        CHECK(st.cur == 30 && st.rr == 0);
        pick_group({{1, 10, true}, {3, 30, true}, {2, 20, true}}, 4, 1, st);
        CHECK(st.cur == 10 && st.rr == 2);
    }
}

static std::vector<int32_t> iota(int32_t from, int32_t n) {
    std::vector<int32_t> v(n);
    for (int32_t i = 0; i < n; ++i) {
        v[i] = from + i;
    }
    return v;
}

static Member generating(int32_t seq, int32_t next, int32_t pos, bool ready = true) {
    Member m;
    m.seq = seq;
    m.ready = ready;
    m.next = next;
    m.pos = pos;
    return m;
}

static Member prompt(int32_t seq, const std::vector<int32_t> & toks, int32_t n_fed = 0) {
    Member m;
    m.seq = seq;
    m.n_prompt = (int32_t) toks.size();
    m.n_fed = n_fed;
    m.pos = n_fed;
    m.prompt = toks.data();
    return m;
}

static const Follow always = [](int32_t, Member &) { return true; };

static void test_batches() {
    BatchPlan b;
    current = "generating sequences first, one token each, each its own output row";
    {
        std::vector<int32_t> p = iota(100, 5);
        std::vector<Member> g = {prompt(2, p), generating(0, 7, 40), generating(1, 8, 12, false), generating(3, 9, 3)};
        BatchPolicy pol;
        pol.budget = 64;
        pol.prompt_step = 8;
        compose_batch(g, pol, always, b);
        CHECK((b.tok == std::vector<int32_t>{7, 9, 100, 101, 102, 103, 104}));
        CHECK((b.pos == std::vector<int32_t>{40, 3, 0, 1, 2, 3, 4}));
        CHECK((b.seq == std::vector<int32_t>{0, 3, 2, 2, 2, 2, 2}));
        CHECK((b.out == std::vector<int8_t>{1, 1, 0, 0, 0, 0, 1}));
        CHECK(b.parts.size() == 3 && b.parts[0].member == 1 && b.parts[0].row == 0 && b.parts[0].chunk == 0);
        CHECK(b.parts[2].member == 0 && b.parts[2].chunk == 5 && b.parts[2].row == 6);
        CHECK(b.n_out == 3 && !b.long_chunk && !b.shorts_only && !b.newcomer_step);
    }
    current = "the budget bounds the batch";
    {
        std::vector<int32_t> p = iota(0, 50);
        std::vector<Member> g = {generating(0, 1, 1), generating(1, 2, 2), generating(2, 3, 3), prompt(3, p)};
        BatchPolicy pol;
        pol.budget = 2;
        pol.prompt_step = 8;
        compose_batch(g, pol, always, b);
        CHECK(b.tok.size() == 2 && b.parts.size() == 2);
        pol.budget = 10;
        compose_batch(g, pol, always, b);
        CHECK(b.tok.size() == 3 + 7);  // the long prompt fills the room left, with others active: at most prompt_step
        CHECK(b.parts.back().chunk == 7 && b.parts.back().row == -1 && b.long_chunk && b.min_left == 50);
    }
    current = "prompts shortest first; alone, a long prompt goes in n_batch at a time";
    {
        std::vector<int32_t> a = iota(0, 30), c = iota(500, 3);
        std::vector<Member> g = {prompt(0, a), prompt(1, c)};
        BatchPolicy pol;
        pol.budget = 64;
        pol.prompt_step = 4;
        pol.last_shorts_only = true;  // (so that the long one is not left out this step)
        compose_batch(g, pol, always, b);
        CHECK(b.parts.size() == 2 && b.parts[0].member == 1 && b.parts[0].chunk == 3 && b.parts[1].chunk == 4);
        std::vector<Member> one = {prompt(0, a)};
        pol.alone = true;
        compose_batch(one, pol, always, b);
        CHECK(b.parts.size() == 1 && b.parts[0].chunk == 30 && b.parts[0].row == 29 && b.n_out == 1);
    }
    current = "a short prompt waiting: long prompts sit the step out, not twice in a row";
    {
        std::vector<int32_t> a = iota(0, 30), c = iota(500, 3);
        std::vector<Member> g = {prompt(0, a), prompt(1, c), generating(2, 5, 9)};
        BatchPolicy pol;
        pol.budget = 64;
        pol.prompt_step = 4;
        compose_batch(g, pol, always, b);
        CHECK(b.shorts_only && b.parts.size() == 2 && b.parts[1].member == 1 && !b.long_chunk);
        pol.last_shorts_only = true;
        compose_batch(g, pol, always, b);
        CHECK(!b.shorts_only && b.parts.size() == 3 && b.long_chunk);
    }
    current = "with the prefix cache aligned, every chunk ends at a multiple of the chunk size";
    {
        std::vector<int32_t> a = iota(0, 100);
        std::vector<Member> g = {prompt(0, a, 10)};
        BatchPolicy pol;
        pol.budget = 512;
        pol.prompt_step = 4;
        pol.align = true;
        pol.prefix_chunk = 32;
        pol.alone = true;
        compose_batch(g, pol, always, b);
        CHECK(b.parts.size() == 1 && b.parts[0].chunk == 22 && b.pos.front() == 10 && b.pos.back() == 31);
        CHECK(b.tok.front() == 10 && b.parts[0].row == -1 && b.n_out == 0);
    }
    current = "a newcomers' step: only newcomers' prompts, nobody generates";
    {
        std::vector<int32_t> a = iota(0, 3), c = iota(50, 2);
        Member n = prompt(1, c);
        n.newcomer = true;
        std::vector<Member> g = {generating(0, 5, 9), prompt(2, a), n};
        BatchPolicy pol;
        pol.budget = 64;
        pol.prompt_step = 4;
        pol.newcomer_steps = true;
        compose_batch(g, pol, always, b);
        CHECK(b.newcomer_step && b.parts.size() == 1 && b.parts[0].member == 2 && (b.tok == std::vector<int32_t>{50, 51}));
        pol.newcomer_steps = false;  // (the last step was one)
        compose_batch(g, pol, always, b);
        CHECK(!b.newcomer_step && b.parts.size() == 3);
    }
    current = "a follower waits for its leader, or goes on from where the leader's cells end";
    {
        std::vector<int32_t> a = iota(0, 20);
        std::vector<Member> g = {prompt(0, a), prompt(1, a)};
        BatchPolicy pol;
        pol.budget = 64;
        pol.prompt_step = 32;
        compose_batch(g, pol, [](int32_t i, Member &) { return i == 0; }, b);
        CHECK(b.parts.size() == 1 && b.parts[0].member == 0 && b.parts[0].chunk == 20);
        compose_batch(g, pol, [](int32_t i, Member & m) {
            if (i == 1) { m.n_fed = 16; m.pos = 16; }  // the leader's 16 cells copied
            return true;
        }, b);
        CHECK(b.parts.size() == 2 && b.parts[1].chunk == 4 && b.tok.back() == 19 && b.pos.back() == 19);
        CHECK(g[1].n_fed == 16);  // (the group shows what the hook did)
    }
    current = "nothing to do: an empty plan";
    {
        std::vector<Member> g = {generating(0, 1, 1, false)};
        BatchPolicy pol;
        pol.budget = 8;
        compose_batch(g, pol, always, b);
        CHECK(b.tok.empty() && b.parts.empty() && b.n_out == 0);
    }
}

int main() {
    test_groups();
    test_batches();
    std::printf("%d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
