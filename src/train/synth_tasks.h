#pragma once
// Example data made from templates (no downloads): small tasks with a checkable answer, for
// post-training tests, examples and demos. Every completion ends with a line "#### ANSWER", the
// fixed answer format that verifiers look for.
#include <cstdint>
#include <string>
#include <vector>

namespace pollen::train {

struct SynthExample {
  std::string prompt;      // the user's message
  std::string completion;  // the assistant's reply, ending with "\n#### " + answer
  std::string answer;
};

// "arithmetic": "What is 37 + 45?" -> "37 + 45 = 82\n#### 82" (sums and differences of numbers
// of at most `digits` digits: below 100 by default); "reverse": a random lower-case word spelt
// backwards; "upper": a word in upper case.
std::vector<std::string> synth_task_names();
// `count` examples of `task`, the same for the same seed (and digits, 1 to 9, arithmetic only).
std::vector<SynthExample> synth_examples(const std::string& task, int64_t count, uint64_t seed,
                                         int digits = 2);

// One line of SFT JSONL (no newline): {"messages": [{user: prompt}, {assistant: completion}]}.
std::string sft_jsonl_line(const SynthExample& example);

}  // namespace pollen::train
