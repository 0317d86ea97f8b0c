#pragma once
// Document quality filters with datatrove's defaults. Each takes the text and returns the
// reason it drops the document (a short snake_case name that goes into the manifest), or
// nullptr to keep it. Each has its own options and can run alone.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pollen {
class ConfigTable;
}

namespace pollen::data {

struct LengthFilter {
  bool enabled = true;
  int64_t min_chars = 1;         // bytes of UTF-8
  int64_t max_chars = 10000000;  // 10 MB
  int64_t min_words = 0;
  int64_t max_words = 0;  // 0: no bound
  const char* check(std::string_view text) const;
};

// Gopher quality rules (Rae et al. 2021, as datatrove's GopherQualityFilter). A threshold of 0
// turns its rule off, as in datatrove.
struct GopherQualityFilter {
  bool enabled = true;
  int64_t min_doc_words = 50;
  int64_t max_doc_words = 100000;
  double min_avg_word_length = 3;
  double max_avg_word_length = 10;
  double max_symbol_word_ratio = 0.1;      // '#' and ellipses per word
  double max_bullet_lines_ratio = 0.9;     // lines starting with a bullet
  double max_ellipsis_lines_ratio = 0.3;   // lines ending with "..." or "…"
  double max_non_alpha_words_ratio = 0.8;  // at least this share of words must hold a letter
  int64_t min_stop_words = 2;              // of: the be to of and that have with
  const char* check(std::string_view text) const;
};

// Gopher repetition rules (datatrove's GopherRepetitionFilter). top_n_grams: (n, f) drops the
// document when its most frequent n-gram covers more than f of its bytes; dup_n_grams: (n, f)
// drops it when the n-grams repeated (non-overlapping) cover more than f.
struct GopherRepetitionFilter {
  bool enabled = true;
  double dup_line_frac = 0.3;
  double dup_para_frac = 0.3;
  double dup_line_char_frac = 0.2;
  double dup_para_char_frac = 0.2;
  std::vector<std::pair<int, double>> top_n_grams{{2, 0.2}, {3, 0.18}, {4, 0.16}};
  std::vector<std::pair<int, double>> dup_n_grams{{5, 0.15}, {6, 0.14}, {7, 0.13},
                                                  {8, 0.12}, {9, 0.11}, {10, 0.10}};
  const char* check(std::string_view text) const;

 private:
  const char* ngram_rules(const std::vector<std::string_view>& words, double len) const;
};

// C4's line rules (Raffel et al. 2020, as datatrove's C4QualityFilter): drops lines without
// terminal punctuation, with fewer than min_words_per_line words, with a word longer than
// max_word_length, mentioning javascript or a policy; drops the whole document on "lorem
// ipsum", a curly bracket, or fewer than min_num_sentences sentences. Rewrites the text.
struct C4Filter {
  bool enabled = false;
  bool remove_citations = true;
  bool filter_no_terminal_punct = true;
  int64_t min_num_sentences = 5;
  int64_t min_words_per_line = 3;
  int64_t max_word_length = 1000;
  bool filter_lorem_ipsum = true;
  bool filter_javascript = true;
  bool filter_curly_bracket = true;
  bool filter_policy = true;
  // Returns the drop reason or nullptr; on keep, `out` holds the rewritten text and
  // `lines_removed` how many lines went.
  const char* apply(std::string_view text, std::string& out, int64_t& lines_removed) const;
};

// FineWeb's line heuristics (datatrove's FineWebQualityFilter).
struct FineWebFilter {
  bool enabled = false;
  double line_punct_thr = 0.12;
  bool line_punct_exclude_zero = false;
  double short_line_thr = 0.67;
  int64_t short_line_length = 30;  // in characters, as datatrove's len(line)
  double char_duplicates_ratio = 0.01;
  double new_line_ratio = 0.3;
  const char* check(std::string_view text) const;
};

// Reads each filter's table ("length", "gopher_quality", ...) from `config`; absent tables
// keep the defaults.
void load_filter(ConfigTable& t, LengthFilter& f);
void load_filter(ConfigTable& t, GopherQualityFilter& f);
void load_filter(ConfigTable& t, GopherRepetitionFilter& f);
void load_filter(ConfigTable& t, C4Filter& f);
void load_filter(ConfigTable& t, FineWebFilter& f);

}  // namespace pollen::data
