// The batcher's two decisions per step as plain-data functions (no llama.cpp,
// no locks, no model): which state group runs, and which tokens go into the
// decode.  Batcher::step (batcher.cpp) calls them, then decodes, then
// advances the sequences; tests/core/test_batch_plan.py compiles
// tests/core/batch_plan_test.cpp against this file alone and checks them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace llamax {
namespace plan {

// A running sequence as the group rotation sees it.
struct SeqView {
    int32_t slot = -1;   // its slot (sequence id)
    uint64_t key = 0;    // its scheduling group (its state, or its control vector when sets mix)
    bool ready = true;   // not waiting for a token sampled off the batcher thread
};

// The rotation, carried from one step to the next.
struct GroupState {
    bool have = false;           // cur means something
    uint64_t cur = 0;            // the group being served
    size_t rr = 0;               // the slot to look from for the next group
    int32_t quantum_left = 0;    // steps the current group may still take while others wait
};

// Which group runs this step.  The current one, while it has a ready
// sequence and its quantum lasts (or nobody else waits); otherwise the group
// of the first ready sequence of another group at or after slot `rr`
// (cyclically), else of any ready sequence: every group gets the context in
// turn.  Returns true when the group changed from another one.  Running
// sequences with none ready: nothing changes (the caller steps only when
// one is ready).
bool pick_group(const std::vector<SeqView> & running, int32_t n_slots, int32_t quantum, GroupState & st);

// A sequence of the chosen group as the batch composer sees it.
struct Member {
    int32_t seq = -1;              // sequence id
    bool ready = true;             // not waiting for a sampled token
    bool newcomer = false;         // a newcomer's short prompt (Batcher::newcomer)
    int32_t next = 0;              // the token to feed when generating
    int32_t pos = 0;               // the position of its next token
    int32_t n_fed = 0;             // prompt tokens decoded (or copied) so far
    int32_t n_prompt = 0;
    const int32_t * prompt = nullptr;
};

struct BatchPolicy {
    int32_t budget = 0;            // tokens per decode (n_batch)
    int32_t prompt_step = 0;       // a prompt with at most this many tokens left is short
    int32_t prefix_chunk = 0;      // with align: chunks end at its multiples (the prefix cache)
    bool align = false;
    bool alone = false;            // one sequence and nobody waiting: prompts go in n_batch at a time
    bool newcomer_steps = false;   // a step may be a newcomers' step (a reserve, and the last step was not one)
    bool last_shorts_only = false; // the last step left long prompts out for short ones
};

// One sequence's part of the batch.
struct Part {
    int32_t member = -1;   // index into the group
    int32_t chunk = 0;     // prompt tokens fed this step (0: one generated token)
    int32_t row = -1;      // its output row (-1: none this step: a prompt chunk short of its end)
};

struct BatchPlan {
    std::vector<int32_t> tok, pos, seq;
    std::vector<int8_t> out;        // 1: the row's logits are wanted
    std::vector<Part> parts;        // in batch order
    bool newcomer_step = false;     // only newcomers' prompts this step (the others sit it out)
    bool shorts_only = false;       // long prompts were left out for short ones
    bool long_chunk = false;        // a chunk of a long prompt (more than prompt_step left) is in it
    int32_t min_left = INT32_MAX;   // the least prompt left among those long ones
    int32_t n_out = 0;              // rows with logits wanted
    void clear();
};

// follow(i, m): group[i] may share its prompt with a leader that decodes it;
// true when it can go into this batch (the hook may have copied the leader's
// cells and moved m.n_fed / m.pos on), false when it waits a step.
using Follow = std::function<bool(int32_t, Member &)>;

// The tokens of this step's decode.  Generating sequences first (one token
// each, unless it is a newcomers' step), then prompts, shortest remaining
// first: a short one (a chat turn) goes in whole; while one waits, long
// prompts sit the step out (not twice in a row); with others active a long
// prompt goes in prompt_step tokens a step (alone, n_batch); with align,
// every chunk ends at a multiple of prefix_chunk.  Up to budget tokens.
void compose_batch(std::vector<Member> & group, const BatchPolicy & p, const Follow & follow, BatchPlan & out);

}  // namespace plan
}  // namespace llamax
