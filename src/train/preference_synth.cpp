#include "train/preference_synth.h"

#include <cctype>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "base/error.h"
#include "base/files.h"
#include "base/rng.h"

namespace pollen::train {
namespace {

using json = nlohmann::ordered_json;

struct Example {
  std::string prompt, chosen, rejected;
};

// Operands below `limit`.
Example arithmetic(Rng& rng, uint64_t limit) {
  const int64_t a = static_cast<int64_t>(rng.below(limit)),
                b = static_cast<int64_t>(rng.below(limit));
  const bool plus = rng.below(2) == 0;
  const int64_t answer = plus ? a + b : a - b;
  const int64_t off = static_cast<int64_t>(rng.below(9)) + 1;
  const int64_t wrong = rng.below(2) == 0 ? answer + off : answer - off;
  const std::string expr = std::to_string(a) + (plus ? " + " : " - ") + std::to_string(b);
  return {"What is " + expr + "?", expr + " = " + std::to_string(answer) + ".",
          expr + " = " + std::to_string(wrong) + "."};
}

std::string in_case(std::string s, bool upper) {
  for (char& ch : s)
    ch = static_cast<char>(upper ? std::toupper(static_cast<unsigned char>(ch))
                                 : std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

Example letter_case(Rng& rng) {
  static constexpr std::string_view kThings[] = {"cat",  "dog", "bird", "fish", "tree",
                                                 "rock", "sun", "moon", "star", "rain"};
  static constexpr std::string_view kColours[] = {"red", "blue", "green", "black", "white"};
  const std::string thing(kThings[rng.below(std::size(kThings))]);
  const std::string colour(kColours[rng.below(std::size(kColours))]);
  const bool upper = rng.below(2) == 0;
  const std::string reply = "The " + thing + " is " + colour + ".";
  return {std::string("Reply in ") + (upper ? "upper" : "lower") + " case: what colour is the " +
              thing + "?",
          in_case(reply, upper), in_case(reply, !upper)};
}

json prompt_field(const std::string& prompt, bool messages) {
  if (!messages) return "Question: " + prompt + "\nAnswer: ";
  return json::array({json{{"role", "user"}, {"content", prompt}}});
}

}  // namespace

void write_preference_synth(const PreferenceSynthOptions& options,
                            const std::filesystem::path& out) {
  POLLEN_CHECK(options.task == "arithmetic" || options.task == "case",
               "synth: --task must be \"arithmetic\" or \"case\", got \"", options.task, "\"");
  POLLEN_CHECK(options.count > 0, "synth: --count must be positive");
  POLLEN_CHECK(options.digits >= 1 && options.digits <= 9, "synth: --digits must be 1 to 9, got ",
               options.digits);
  uint64_t limit = 1;
  for (int d = 0; d < options.digits; ++d) limit *= 10;
  Rng rng(options.seed);
  std::string text;
  for (int64_t i = 0; i < options.count; ++i) {
    const Example e = options.task == "arithmetic" ? arithmetic(rng, limit) : letter_case(rng);
    const json prompt = prompt_field(e.prompt, options.messages);
    if (options.responses) {
      text += json{{"prompt", prompt}, {"response", e.chosen}, {"preferred", true}}.dump() + "\n";
      text +=
          json{{"prompt", prompt}, {"response", e.rejected}, {"preferred", false}}.dump() + "\n";
    } else {
      text +=
          json{{"prompt", prompt}, {"chosen", e.chosen}, {"rejected", e.rejected}}.dump() + "\n";
    }
  }
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
  write_file_atomic(out, text);
}

}  // namespace pollen::train
