#include "train/verifiers.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <regex>
#include <string>
#include <vector>

#include "base/error.h"

namespace pollen::train {
namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

std::string collapse_spaces(std::string_view s) {
  std::string out;
  for (char c : trim(s)) {
    if (is_space(c)) {
      if (out.back() != ' ') out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

constexpr std::string_view kUnicodeMinus = "\xE2\x88\x92";  // U+2212

// A number starting at s[i] (a digit, or '.' before a digit), read as far as it goes:
// digits, then ",ddd" groups while exactly three digits follow, then ".digits". Sets *end.
std::optional<double> read_unsigned(std::string_view s, size_t i, size_t* end) {
  std::string digits;
  size_t j = i;
  while (j < s.size() && is_digit(s[j])) digits += s[j++];
  const bool leading_group_ok = !digits.empty() && digits.size() <= 3;
  while (leading_group_ok && j + 3 < s.size() && s[j] == ',' && is_digit(s[j + 1]) &&
         is_digit(s[j + 2]) && is_digit(s[j + 3]) && (j + 4 >= s.size() || !is_digit(s[j + 4]))) {
    digits.append(s.substr(j + 1, 3));
    j += 4;
  }
  if (j + 1 < s.size() && s[j] == '.' && is_digit(s[j + 1])) {
    digits += '.';
    ++j;
    while (j < s.size() && is_digit(s[j])) digits += s[j++];
  }
  if (digits.empty() || digits == ".") return std::nullopt;
  // An exponent (1e-7, 2.5E3): 'e' or 'E', an optional sign, digits.
  if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
    size_t k = j + 1;
    if (k < s.size() && (s[k] == '-' || s[k] == '+')) ++k;
    if (k < s.size() && is_digit(s[k])) {
      digits += 'e';
      digits.append(s.substr(j + 1, k - (j + 1)));
      while (k < s.size() && is_digit(s[k])) digits += s[k++];
      j = k;
    }
  }
  *end = j;
  // strtod, not stod: a run of 400 digits is out of double's range (inf, or 0 for 0.000...1),
  // which stod would throw for, ending a run on one sampled completion.
  return std::strtod(digits.c_str(), nullptr);
}

// The sign written just before position i (and where it starts), if any.
int sign_before(std::string_view s, size_t i, size_t* start) {
  *start = i;
  if (i >= 1 && (s[i - 1] == '-' || s[i - 1] == '+')) {
    *start = i - 1;
    return s[i - 1] == '-' ? -1 : 1;
  }
  if (i >= kUnicodeMinus.size() &&
      s.substr(i - kUnicodeMinus.size(), kUnicodeMinus.size()) == kUnicodeMinus) {
    *start = i - kUnicodeMinus.size();
    return -1;
  }
  return 1;
}

bool starts_number(std::string_view s, size_t i) {
  return is_digit(s[i]) || (s[i] == '.' && i + 1 < s.size() && is_digit(s[i + 1]));
}

AnswerExtraction::Mode extraction_mode(ConfigTable& table) {
  const std::string mode = table.get_string("extract", "marker");
  if (mode == "marker") return AnswerExtraction::Mode::marker;
  if (mode == "last_line") return AnswerExtraction::Mode::last_line;
  if (mode == "whole") return AnswerExtraction::Mode::whole;
  fail(table.where("extract"), ": expected \"marker\", \"last_line\" or \"whole\", got \"", mode,
       "\"");
}

std::string regex_escape(std::string_view text) {
  static const std::string special = "\\^$.|?*+()[]{}-/";
  std::string out;
  for (char c : text) {
    if (special.find(c) != std::string::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::optional<std::string> extract_answer(std::string_view completion,
                                          const AnswerExtraction& extraction) {
  std::string_view found;
  switch (extraction.mode) {
    case AnswerExtraction::Mode::marker: {
      const size_t at = completion.rfind(extraction.marker);
      if (extraction.marker.empty() || at == std::string_view::npos) return std::nullopt;
      found = completion.substr(at + extraction.marker.size());
      found = found.substr(0, found.find('\n'));
      break;
    }
    case AnswerExtraction::Mode::last_line: {
      std::string_view rest = trim(completion);
      const size_t nl = rest.rfind('\n');
      found = nl == std::string_view::npos ? rest : rest.substr(nl + 1);
      break;
    }
    case AnswerExtraction::Mode::whole:
      found = completion;
      break;
  }
  found = trim(found);
  if (found.empty()) return std::nullopt;
  return std::string(found);
}

std::optional<double> parse_number(std::string_view text) {
  text = trim(text);
  if (text.empty()) return std::nullopt;
  int sign = 1;
  if (text.front() == '-' || text.front() == '+') {
    sign = text.front() == '-' ? -1 : 1;
    text.remove_prefix(1);
  } else if (text.starts_with(kUnicodeMinus)) {
    sign = -1;
    text.remove_prefix(kUnicodeMinus.size());
  }
  if (text.empty() || !starts_number(text, 0)) return std::nullopt;
  size_t end = 0;
  const std::optional<double> value = read_unsigned(text, 0, &end);
  if (!value || end != text.size() || !std::isfinite(*value)) return std::nullopt;
  return sign * *value;
}

std::optional<double> last_number(std::string_view text) {
  std::optional<double> last;
  size_t i = 0;
  while (i < text.size()) {
    // A number starts at a digit (or ".5") that does not continue a word or another number.
    const bool continues =
        i > 0 && (std::isalnum(static_cast<unsigned char>(text[i - 1])) || text[i - 1] == '.');
    if (!starts_number(text, i) || continues) {
      ++i;
      continue;
    }
    size_t end = 0, start = 0;
    const std::optional<double> value = read_unsigned(text, i, &end);
    if (!value) {
      ++i;
      continue;
    }
    int sign = sign_before(text, i, &start);
    // "3-5" is two numbers, not 3 and -5: a sign counts only when it does not follow a digit.
    if (start < i && start > 0 && std::isalnum(static_cast<unsigned char>(text[start - 1])))
      sign = 1;
    last = sign * *value;
    i = end;
  }
  return last;
}

double exact_match_reward(std::string_view completion, std::string_view answer,
                          const AnswerExtraction& extraction) {
  const std::optional<std::string> found = extract_answer(completion, extraction);
  return found && collapse_spaces(*found) == collapse_spaces(answer) ? 1.0 : 0.0;
}

double numeric_match_reward(std::string_view completion, double answer,
                            const AnswerExtraction& extraction, double abs_tol, double rel_tol) {
  const std::optional<std::string> found = extract_answer(completion, extraction);
  if (!found) return 0.0;
  const std::optional<double> value = last_number(*found);
  if (!value) return 0.0;
  return std::abs(*value - answer) <= std::max(abs_tol, rel_tol * std::abs(answer)) ? 1.0 : 0.0;
}

RewardFunction make_verifier(ConfigTable& table) {
  const std::string kind = table.get_string("kind", "numeric");
  AnswerExtraction extraction;
  RewardFunction reward;
  if (kind == "exact" || kind == "numeric") {
    extraction.mode = extraction_mode(table);
    extraction.marker = table.get_string("marker", extraction.marker);
    POLLEN_CHECK(extraction.mode != AnswerExtraction::Mode::marker || !extraction.marker.empty(),
                 table.where("marker"), ": must not be empty when extract = \"marker\"");
  }
  if (kind == "exact") {
    reward = [extraction](std::string_view, std::string_view completion, std::string_view answer) {
      return exact_match_reward(completion, answer, extraction);
    };
  } else if (kind == "numeric") {
    const double abs_tol = table.get_double("abs_tol", 1e-6);
    const double rel_tol = table.get_double("rel_tol", 0.0);
    POLLEN_CHECK(abs_tol >= 0, table.where("abs_tol"), ": must be >= 0, got ", abs_tol);
    POLLEN_CHECK(rel_tol >= 0, table.where("rel_tol"), ": must be >= 0, got ", rel_tol);
    reward = [extraction, abs_tol, rel_tol](std::string_view, std::string_view completion,
                                            std::string_view answer) {
      const std::optional<double> expected = parse_number(answer);
      POLLEN_CHECK(expected.has_value(), "numeric verifier: the reference answer \"",
                   answer.substr(0, 80), answer.size() > 80 ? "..." : "",
                   "\" is not a finite number");
      return numeric_match_reward(completion, *expected, extraction, abs_tol, rel_tol);
    };
  } else if (kind == "regex") {
    const std::string pattern = table.require_string("pattern");
    const bool uses_answer = pattern.find("{answer}") != std::string::npos;
    auto compile = [pattern, where = table.where("pattern")](std::string_view answer) {
      std::string text = pattern;
      for (size_t at; (at = text.find("{answer}")) != std::string::npos;)
        text.replace(at, 8, regex_escape(answer));
      try {
        return std::regex(text, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        fail(where, ": not a valid regular expression (ECMAScript): ", e.what());
      }
    };
    const std::regex fixed = compile("");  // checks the pattern now, whether or not it has {answer}
    reward = [compile, fixed, uses_answer](std::string_view, std::string_view completion,
                                           std::string_view answer) {
      const std::regex re = uses_answer ? compile(answer) : fixed;
      return std::regex_search(completion.begin(), completion.end(), re) ? 1.0 : 0.0;
    };
  } else {
    fail(table.where("kind"), ": expected \"exact\", \"numeric\" or \"regex\", got \"", kind, "\"");
  }
  // Keys of another kind (left from switching kind with --set) are named with the kinds they
  // belong to, not only as unknown keys.
  struct Owner {
    const char* key;
    std::vector<std::string> kinds;
  };
  const Owner owners[] = {{"abs_tol", {"numeric"}},
                          {"rel_tol", {"numeric"}},
                          {"extract", {"exact", "numeric"}},
                          {"marker", {"exact", "numeric"}},
                          {"pattern", {"regex"}}};
  for (const Owner& o : owners) {
    const bool belongs = std::find(o.kinds.begin(), o.kinds.end(), kind) != o.kinds.end();
    POLLEN_CHECK(belongs || !table.has(o.key), table.where(o.key), " applies to kind = \"",
                 o.kinds.front(), o.kinds.size() > 1 ? "\" or \"" + o.kinds.back() : "",
                 "\" only, and kind is \"", kind, "\"");
  }
  return reward;
}

}  // namespace pollen::train
