// Curation stages on crafted documents: UTF-8, filters, MinHash, PII, decontamination.
//
// The filter tests put each rule's threshold between a pair of documents: one just inside it
// (kept, or dropped by another, named rule) and one just past it, with the arithmetic in a
// comment. Every ratio is built from whole numbers so that the two sides are exact.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/config.h"
#include "base/error.h"
#include "base/rng.h"
#include "data/decontam.h"
#include "data/filters.h"
#include "data/minhash.h"
#include "data/pii.h"
#include "data/text.h"

using namespace pollen;
using namespace pollen::data;

namespace {

// A plain English paragraph that every default filter keeps.
std::string good_text() {
  return "The history of the river valley is long and varied. Farmers settled there with their "
         "families and built small villages along the banks. Over the centuries the towns grew, "
         "and trade with the coast brought new goods and ideas to the region. Today the valley "
         "is known for its orchards, its old stone bridges and the festivals that mark the "
         "harvest each autumn.\nVisitors come to walk the trails and to see the mills that "
         "still stand by the water. Local museums keep records of the floods and of the people "
         "who rebuilt their homes after each one.";
}

std::string words(int n, const std::string& w = "word") {
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? " " : "") + w + std::to_string(i);
  return s;
}

// A filter's decision as text: the drop reason, or "kept".
std::string verdict(const char* reason) {
  return reason ? reason : "kept";
}

// `n` more words: " w" n times.
std::string times(int n, const std::string& w) {
  std::string s;
  for (int i = 0; i < n; ++i) s += " " + w;
  return s;
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? sep : "") + parts[i];
  return s;
}

// A word of `n` copies of the letter `c`.
std::string run(char c, int n) {
  return std::string(static_cast<size_t>(n), c);
}

// A line of exactly `bytes` bytes and `n_words` words that no other `id` repeats, ending with
// `end`: "l<id> w w wxxxx.".
std::string text_line(int id, int bytes, int n_words = 4, char end = '.') {
  std::string s = "l" + std::to_string(id);
  for (int i = 1; i < n_words; ++i) s += " w";
  EXPECT_LT(static_cast<int>(s.size()), bytes) << "line " << id << " cannot be that short";
  s += run('x', bytes - 1 - static_cast<int>(s.size()));
  return s + end;
}

// Ten Cyrillic letters: 10 characters in 20 bytes of UTF-8.
const char* const kCyrillic10 = "\u0430\u0431\u0432\u0433\u0434\u0435\u0436\u0437\u0438\u0439";

}  // namespace

TEST(Text, Utf8ValidationAndRepair) {
  EXPECT_TRUE(utf8_valid("plain ascii"));
  EXPECT_TRUE(utf8_valid("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"));
  EXPECT_FALSE(utf8_valid("bad \xC3"));
  EXPECT_FALSE(utf8_valid("overlong \xC0\xAF"));
  EXPECT_FALSE(utf8_valid("surrogate \xED\xA0\x80"));
  std::string out;
  EXPECT_EQ(utf8_repair("a\xFF"
                        "b\xE2\x82",
                        out),
            2u);
  EXPECT_EQ(out,
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD");
}

TEST(Filters, LengthBounds) {
  LengthFilter f;
  // Defaults: at least one byte, at most 10 MB, no word bounds.
  EXPECT_EQ(verdict(f.check("")), "too_short");
  EXPECT_EQ(verdict(f.check("x")), "kept");
  EXPECT_EQ(verdict(f.check(std::string(10000000, 'x'))), "kept");
  EXPECT_EQ(verdict(f.check(std::string(10000001, 'x'))), "too_long");
  // Bytes from 5 to 20, both included.
  f.min_chars = 5;
  f.max_chars = 20;
  EXPECT_EQ(verdict(f.check("abcd")), "too_short");
  EXPECT_EQ(verdict(f.check("abcde")), "kept");
  EXPECT_EQ(verdict(f.check(run('x', 20))), "kept");
  EXPECT_EQ(verdict(f.check(run('x', 21))), "too_long");
  // Bytes of UTF-8, not characters: "éé" is 2 characters in 4 bytes, "ééa" 5 bytes.
  EXPECT_EQ(verdict(f.check("\u00e9\u00e9")), "too_short");
  EXPECT_EQ(verdict(f.check("\u00e9\u00e9a")), "kept");
  // Words from 2 to 3, both included.
  f.min_chars = 1;
  f.min_words = 2;
  f.max_words = 3;
  EXPECT_EQ(verdict(f.check("one")), "too_few_words");
  EXPECT_EQ(verdict(f.check("one two")), "kept");
  EXPECT_EQ(verdict(f.check("one two six")), "kept");
  EXPECT_EQ(verdict(f.check("one two six ten")), "too_many_words");
}

TEST(Filters, GopherQuality) {
  GopherQualityFilter f;
  EXPECT_EQ(f.check(good_text()), nullptr);
  EXPECT_STREQ(f.check("the cat and the dog"), "gopher_too_few_words");
  EXPECT_STREQ(f.check("the and of to " + words(60, "extraordinarilylongish")),
               "gopher_long_mean_word");
  // Word length is in characters, as datatrove's len(): six Cyrillic letters are 12 bytes.
  EXPECT_EQ(f.check("the and of to " + words(60, "\u043f\u0440\u0438\u0432\u0435\u0442")), nullptr);
  std::string hashes = good_text();
  for (int i = 0; i < 30; ++i) hashes += " #tag";
  EXPECT_STREQ(f.check(hashes), "gopher_hash_ratio");
  std::string bullets;
  for (int i = 0; i < 30; ++i) bullets += "- the item number " + std::to_string(i) + " of list\n";
  EXPECT_STREQ(f.check(bullets), "gopher_bullet_lines");
  std::string ellipsis;
  for (int i = 0; i < 20; ++i) ellipsis += "and then the story went on and on with\n";
  for (int i = 0; i < 20; ++i) ellipsis += "to be continued with more of the same...\n";
  EXPECT_STREQ(f.check(ellipsis), "gopher_ellipsis_lines");
  std::string numbers = "the and of ";
  for (int i = 0; i < 80; ++i) numbers += std::to_string(1000 + i) + " ";
  EXPECT_STREQ(f.check(numbers), "gopher_non_alpha_words");
  std::string no_stop;
  for (int i = 0; i < 60; ++i) no_stop += "apple banana cherry ";
  f.min_stop_words = 2;
  EXPECT_STREQ(f.check(no_stop), "gopher_few_stop_words");
}

// The Gopher quality documents below start with "the and" (two stop words of three letters) and
// add words: "the and" + times(48, "house") is 50 words with a mean length of 246 / 50 = 4.92,
// which every rule keeps. A word counts (towards the word bounds and the mean length) when it
// holds a byte other than ASCII punctuation. The ratio rules are tested on 1000 or 10000 words,
// or 1000 lines, so that one word or line more moves a ratio by at most 0.33% of its threshold.
TEST(Filters, GopherQualityWordCounts) {
  GopherQualityFilter f;
  // At least 50 counting words: 2 + 47 = 49 are too few, 2 + 48 = 50 are kept.
  EXPECT_EQ(verdict(f.check("the and" + times(47, "house"))), "gopher_too_few_words");
  EXPECT_EQ(verdict(f.check("the and" + times(48, "house"))), "kept");
  // Words of punctuation alone do not count: 49 words plus "--" and "!!" are still 49.
  EXPECT_EQ(verdict(f.check("the and" + times(47, "house") + " -- !!")), "gopher_too_few_words");
  // At most 100000: 2 + 99998 are kept, 2 + 99999 = 100001 are too many.
  EXPECT_EQ(verdict(f.check("the and" + times(99998, "house"))), "kept");
  EXPECT_EQ(verdict(f.check("the and" + times(99999, "house"))), "gopher_too_many_words");
  // Without a lower bound, a text without a counting word has no mean length to judge.
  f.min_doc_words = 0;
  EXPECT_EQ(verdict(f.check("")), "gopher_no_words");
  EXPECT_EQ(verdict(f.check(";; !! --")), "gopher_no_words");
  // One counting word of three letters passes the length rules; 1 of its 3 words holds a letter.
  EXPECT_EQ(verdict(f.check(";; !! abc")), "gopher_non_alpha_words");
}

TEST(Filters, GopherQualityMeanWordLength) {
  GopherQualityFilter f;
  // At least 3 characters: 2 * 3 + 998 * 3 = 3000 in 1000 words is 3.0, kept; one "abc" cut to
  // "ab" makes 2999 / 1000 = 2.999.
  EXPECT_EQ(verdict(f.check("the and" + times(998, "abc"))), "kept");
  EXPECT_EQ(verdict(f.check("the and" + times(997, "abc") + " ab")), "gopher_short_mean_word");
  // Words of punctuation alone are left out of the mean: "--" and "::" leave it at 3.0.
  EXPECT_EQ(verdict(f.check("the and" + times(998, "abc") + " -- ::")), "kept");
  // At most 10: 6 + 996 * 10 + 2 * 17 = 10000 in 1000 words is 10.0, kept; one word of 18
  // letters instead of 17 makes 10001 / 1000 = 10.001.
  const std::string ten = run('t', 10), seventeen = run('s', 17);
  EXPECT_EQ(verdict(f.check("the and" + times(996, ten) + times(2, seventeen))), "kept");
  EXPECT_EQ(
      verdict(f.check("the and" + times(996, ten) + times(1, seventeen) + " " + run('s', 18))),
      "gopher_long_mean_word");
  // Characters, not bytes: 996 words of ten Cyrillic letters (20 bytes each) still mean 10.0.
  EXPECT_EQ(verdict(f.check("the and" + times(996, kCyrillic10) + times(2, seventeen))), "kept");
}

TEST(Filters, GopherQualitySymbolRatios) {
  GopherQualityFilter f;
  // '#' per word at most 0.1: 1000 of 10000 words as "#house" is 0.1, kept; 1001 is 0.1001.
  EXPECT_EQ(verdict(f.check("the and" + times(8998, "house") + times(1000, "#house"))), "kept");
  EXPECT_EQ(verdict(f.check("the and" + times(8997, "house") + times(1001, "#house"))),
            "gopher_hash_ratio");
  // Every word is in the denominator, punctuation alone included: 1001 '#' in 10000 counting
  // words and 10 of "--" is 1001 / 10010 = 0.1.
  EXPECT_EQ(
      verdict(f.check("the and" + times(8997, "house") + times(1001, "#house") + times(10, "--"))),
      "kept");
  // "..." and "…" per word at most 0.1: 800 "house..." and 200 "house…" in 10000 words is 0.1,
  // kept; 800 and 201 is 0.1001. The text ends with a plain word: no line ends with an ellipsis.
  EXPECT_EQ(verdict(f.check("the and" + times(800, "house...") + times(200, "house\u2026") +
                            times(8998, "house"))),
            "kept");
  EXPECT_EQ(verdict(f.check("the and" + times(800, "house...") + times(201, "house\u2026") +
                            times(8997, "house"))),
            "gopher_ellipsis_ratio");
  // Counted without overlap, as Python's str.count: "......" is two, so 800 + 198 + 2 = 1000 is
  // kept and 800 + 199 + 2 = 1001 is not.
  EXPECT_EQ(verdict(f.check("the and" + times(800, "house...") + times(198, "house\u2026") +
                            times(1, "house......") + times(8999, "house"))),
            "kept");
  EXPECT_EQ(verdict(f.check("the and" + times(800, "house...") + times(199, "house\u2026") +
                            times(1, "house......") + times(8998, "house"))),
            "gopher_ellipsis_ratio");
}

TEST(Filters, GopherQualityLineRules) {
  GopherQualityFilter f;
  // Lines starting with "-" or "•" (after leading whitespace) at most 90%: of 1000 lines of five
  // words, 900 bullets is 0.9, kept; 901 is 0.901.
  auto bullets = [](int n) {
    std::vector<std::string> lines;
    const char* marks[] = {"-", "\u2022", "  -"};
    for (int i = 0; i < 1000; ++i)
      lines.push_back(std::string(i < n ? marks[i % 3] : "") + "item the house and garden");
    return join(lines, "\n");
  };
  EXPECT_EQ(verdict(f.check(bullets(900))), "kept");
  EXPECT_EQ(verdict(f.check(bullets(901))), "gopher_bullet_lines");
  // Lines ending with "..." or "…" (before trailing whitespace) at most 30%: of 1000 lines of
  // six words, 300 is 0.3, kept; 301 is 0.301 (301 ellipses in 6000 words: under 0.1 per word).
  auto ellipses = [](int n_lines, int n, bool blank_line) {
    std::vector<std::string> lines;
    const char* ends[] = {"...", "\u2026", "...  "};
    for (int i = 0; i < n_lines; ++i)
      lines.push_back(std::string("the house and garden stand here") + (i < n ? ends[i % 3] : "."));
    if (blank_line) lines.insert(lines.begin() + 1, "");
    return join(lines, "\n");
  };
  EXPECT_EQ(verdict(f.check(ellipses(1000, 300, false))), "kept");
  EXPECT_EQ(verdict(f.check(ellipses(1000, 301, false))), "gopher_ellipsis_lines");
  // A blank line is a line, as in Python's splitlines(): 300 of 999 lines is 0.3003, dropped,
  // and 300 of the same 999 and a blank one is 0.3, kept.
  EXPECT_EQ(verdict(f.check(ellipses(999, 300, false))), "gopher_ellipsis_lines");
  EXPECT_EQ(verdict(f.check(ellipses(999, 300, true))), "kept");
}

TEST(Filters, GopherQualityLettersAndStopWords) {
  GopherQualityFilter f;
  // At least 80% of words hold a letter: 800 of 1000 (200 of them "1234") is 0.8, kept; 799 is
  // 0.799.
  EXPECT_EQ(verdict(f.check("the and" + times(798, "house") + times(200, "1234"))), "kept");
  EXPECT_EQ(verdict(f.check("the and" + times(797, "house") + times(201, "1234"))),
            "gopher_non_alpha_words");
  // At least two distinct stop words (datatrove's set intersection): each of the eight with
  // another is enough; one, however often, is not.
  const std::vector<std::string> stop = {"the", "be", "to", "of", "and", "that", "have", "with"};
  for (size_t i = 0; i < stop.size(); ++i) {
    const std::string& s = stop[i];
    const std::string& other = stop[(i + 1) % stop.size()];
    EXPECT_EQ(verdict(f.check(s + " " + other + times(48, "house"))), "kept") << s;
    EXPECT_EQ(verdict(f.check(s + " " + s + times(48, "house"))), "gopher_few_stop_words") << s;
    EXPECT_EQ(verdict(f.check(s + times(49, "house"))), "gopher_few_stop_words") << s;
  }
  // Matched exactly, as datatrove's set lookup: "The" and "them" are not stop words.
  EXPECT_EQ(verdict(f.check("The and" + times(48, "house"))), "gopher_few_stop_words");
  EXPECT_EQ(verdict(f.check("them and" + times(48, "house"))), "gopher_few_stop_words");
}

// A threshold of 0 turns its rule off, as datatrove's `if self.<threshold> and ...`: each
// document below is dropped by that rule with the defaults and kept with the rule's key at 0
// (a maximum of 0 compared as a bound would drop it too).
TEST(Filters, GopherQualityZeroTurnsARuleOff) {
  std::vector<std::string> bullet_lines, ellipsis_lines;
  for (int i = 0; i < 100; ++i) {
    bullet_lines.push_back("- item the house and garden");
    ellipsis_lines.push_back("the house and garden stand here by the old mill on the river...");
  }
  struct Case {
    double GopherQualityFilter::*key;
    std::string text, reason;
  };
  const std::vector<Case> cases = {
      {&GopherQualityFilter::min_avg_word_length, "the and" + times(98, "ab"),
       "gopher_short_mean_word"},
      {&GopherQualityFilter::max_avg_word_length, "the and" + times(98, run('t', 11)),
       "gopher_long_mean_word"},
      {&GopherQualityFilter::max_symbol_word_ratio, "the and" + times(98, "#house"),
       "gopher_hash_ratio"},
      {&GopherQualityFilter::max_bullet_lines_ratio, join(bullet_lines, "\n"),
       "gopher_bullet_lines"},
      {&GopherQualityFilter::max_ellipsis_lines_ratio, join(ellipsis_lines, "\n"),
       "gopher_ellipsis_lines"},
      {&GopherQualityFilter::max_non_alpha_words_ratio, "the and" + times(98, "1234"),
       "gopher_non_alpha_words"},
  };
  for (const Case& c : cases) {
    GopherQualityFilter f;
    EXPECT_EQ(verdict(f.check(c.text)), c.reason);
    f.*c.key = 0;
    EXPECT_EQ(verdict(f.check(c.text)), "kept") << c.reason;
  }
  // The minimum counts: no stop words, then a single word.
  GopherQualityFilter f;
  EXPECT_EQ(verdict(f.check("house" + times(99, "house"))), "gopher_few_stop_words");
  f.min_stop_words = 0;
  EXPECT_EQ(verdict(f.check("house" + times(99, "house"))), "kept");
  f.min_doc_words = 0;
  EXPECT_EQ(verdict(f.check("house")), "kept");
  // With every maximum at 0, a document that breaks the word length, symbol and ellipsis line
  // maxima at once is kept.
  GopherQualityFilter all_off;
  all_off.max_avg_word_length = all_off.max_symbol_word_ratio = 0;
  all_off.max_bullet_lines_ratio = all_off.max_ellipsis_lines_ratio = 0;
  EXPECT_EQ(verdict(all_off.check("the and" + times(98, "#" + run('t', 12) + "..."))), "kept");
}

TEST(Filters, GopherRepetition) {
  GopherRepetitionFilter f;
  EXPECT_EQ(f.check(good_text()), nullptr);
  // 12 lines, 9 of them repeats: 0.75.
  std::string lines;
  for (int i = 0; i < 10; ++i) lines += "Buy now and save on every order today\n";
  lines += good_text();
  EXPECT_STREQ(f.check(lines), "repetition_dup_lines");
  std::string paras;
  for (int i = 0; i < 5; ++i) paras += "Same paragraph here with words.\n\n";
  paras += good_text();
  EXPECT_STREQ(f.check(paras), "repetition_dup_paragraphs");
  std::string ngram = good_text() + " ";
  for (int i = 0; i < 40; ++i) ngram += "click here ";
  EXPECT_STREQ(f.check(ngram), "repetition_top_ngram");
  // An empty text is dropped, as datatrove drops it ("empty"), with the length stage off too.
  EXPECT_STREQ(f.check(""), "repetition_empty");
}

// The repetition documents below are made of one-word paragraphs or lines, so that no 2-gram
// repeats and the n-gram rules keep them.
TEST(Filters, GopherRepetitionParagraphsAndLines) {
  GopherRepetitionFilter f;
  // `total` words of which `repeats` repeat "zzzzz": it stands at the odd places 1, 3, ...,
  // 2 * repeats + 1, and a 30-byte word of its own everywhere else. Repeated bytes are then far
  // under 20% of the text (5 bytes a repeat against 30 or more for each other word).
  auto parts = [](int total, int repeats) {
    std::vector<std::string> p;
    for (int i = 0; i < total; ++i) {
      const std::string own = "u" + std::to_string(i);
      p.push_back(i % 2 == 1 && i <= 2 * repeats + 1
                      ? "zzzzz"
                      : own + run('x', 30 - static_cast<int>(own.size())));
    }
    return p;
  };
  // Repeated paragraphs (split on runs of blank lines) at most 30%: 300 of 1000, kept; 301.
  EXPECT_EQ(verdict(f.check(join(parts(1000, 300), "\n\n"))), "kept");
  EXPECT_EQ(verdict(f.check(join(parts(1000, 301), "\n\n"))), "repetition_dup_paragraphs");
  EXPECT_EQ(verdict(f.check(join(parts(1000, 301), "\n\n\n\n"))), "repetition_dup_paragraphs");
  // Repeated lines at most 30%; separated by single newlines, all is one paragraph.
  EXPECT_EQ(verdict(f.check(join(parts(1000, 300), "\n"))), "kept");
  EXPECT_EQ(verdict(f.check(join(parts(1000, 301), "\n"))), "repetition_dup_lines");
  // Lines are split on runs of newlines as datatrove's re.split("\n+"), which leaves an empty
  // last line after a final newline: 9 lines with 3 repeats are 0.33, and with a final newline
  // 3 of 10, kept.
  EXPECT_EQ(verdict(f.check(join(parts(9, 3), "\n"))), "repetition_dup_lines");
  EXPECT_EQ(verdict(f.check(join(parts(9, 3), "\n") + "\n")), "kept");
  // Bytes of repeated paragraphs at most 20% of the text: a (200 bytes), b (297), c (297), a
  // with three "\n\n" is 1000 bytes, 200 of them repeated: 0.2, kept. With c of 296 bytes:
  // 200 / 999 = 0.2002. (One repeat in four paragraphs or lines is 0.25, under 0.3.)
  const std::string a = run('a', 200), b = run('b', 297);
  EXPECT_EQ(verdict(f.check(join({a, b, run('c', 297), a}, "\n\n"))), "kept");
  EXPECT_EQ(verdict(f.check(join({a, b, run('c', 296), a}, "\n\n"))),
            "repetition_dup_paragraph_chars");
  // Bytes of repeated lines at most 20%: a, b of 299, c of 298, a and three "\n" is 1000 bytes.
  EXPECT_EQ(verdict(f.check(join({a, run('b', 299), run('c', 298), a}, "\n"))), "kept");
  EXPECT_EQ(verdict(f.check(join({a, run('b', 299), run('c', 297), a}, "\n"))),
            "repetition_dup_line_chars");
}

// The most frequent n-gram (seen at least twice; its words joined by single spaces) covers at most
// 20%, 18%, 16% of the bytes for n = 2, 3, 4. Each document holds the n-gram twice, with a word
// of x and a word of y after it, and is 1000 bytes; one y fewer makes it 999.
TEST(Filters, GopherRepetitionTopNgrams) {
  GopherRepetitionFilter f;
  auto doc = [](const std::string& gram, int x, int y) {
    return gram + " " + run('x', x) + " " + gram + " " + run('y', y);
  };
  // 49 a and 50 b, 100 bytes: 2 * 100 / (100 + 1 + 398 + 1 + 100 + 1 + 399) = 0.2, kept;
  // 200 / 999 = 0.2002.
  const std::string two = run('a', 49) + " " + run('b', 50);
  EXPECT_EQ(verdict(f.check(doc(two, 398, 399))), "kept");
  EXPECT_EQ(verdict(f.check(doc(two, 398, 398))), "repetition_top_ngram");
  // 29 a, 29 b, 30 c, 90 bytes: 180 / (90 + 1 + 408 + 1 + 90 + 1 + 409) = 0.18, kept; 180 / 999.
  // (Its 2-grams cover 118 and 120.)
  const std::string three = run('a', 29) + " " + run('b', 29) + " " + run('c', 30);
  EXPECT_EQ(verdict(f.check(doc(three, 408, 409))), "kept");
  EXPECT_EQ(verdict(f.check(doc(three, 408, 408))), "repetition_top_ngram");
  // 19 a, 19 b, 19 c, 20 d, 80 bytes: 160 / (80 + 1 + 418 + 1 + 80 + 1 + 419) = 0.16, kept;
  // 160 / 999. (Its 3-grams cover 118 and 120, its 2-grams 78 and 80.)
  const std::string four =
      run('a', 19) + " " + run('b', 19) + " " + run('c', 19) + " " + run('d', 20);
  EXPECT_EQ(verdict(f.check(doc(four, 418, 419))), "kept");
  EXPECT_EQ(verdict(f.check(doc(four, 418, 418))), "repetition_top_ngram");
  // An n-gram seen once is no repetition (datatrove would drop this text: its one 2-gram is all
  // of it; docs/data.md).
  EXPECT_EQ(verdict(f.check("seen once")), "kept");
}

// Among n-grams seen equally often, the first seen is the most frequent, as in datatrove's
// Counter.most_common(1). "aaaaaaaaa b" (11 bytes) and "c d" (3) are both seen twice in 100
// bytes; "c d" is the first to be seen twice, but "aaaaaaaaa b" the first seen: 22 / 100 = 0.22
// is over 0.2 (with "c d", 6 / 100 would be kept).
TEST(Filters, GopherRepetitionTopNgramTiesGoToTheFirstSeen) {
  GopherRepetitionFilter f;
  const std::string text = "aaaaaaaaa b c d c d " + run('x', 68) + " aaaaaaaaa b";
  ASSERT_EQ(text.size(), 100u);
  EXPECT_EQ(verdict(f.check(text)), "repetition_top_ngram");
}

// The repeated n-grams (their words' bytes, without the spaces, each repeat counted once and
// without overlap) cover at most 15%, 14%, 13%, 12%, 11%, 10% of the bytes for n = 5 to 10,
// that is 10 * (20 - n) / 1000. With the top n-gram rules off, each document holds twice an
// n-gram of that many letters (n - 1 words of one letter, and the rest in one word), then a word
// of x and a word of y, and is 1000 bytes; one y fewer makes it 999. Only the n-gram repeats, so
// rule n alone can drop the document: shorter repeats cover no more bytes, with higher bounds.
TEST(Filters, GopherRepetitionDuplicatedNgrams) {
  GopherRepetitionFilter f;
  EXPECT_EQ(f.dup_n_grams, (std::vector<std::pair<int, double>>{
                               {5, 0.15}, {6, 0.14}, {7, 0.13}, {8, 0.12}, {9, 0.11}, {10, 0.10}}));
  f.top_n_grams.clear();
  for (int n = 5; n <= 10; ++n) {
    const int letters = 10 * (20 - n);
    std::string gram;
    for (int i = 0; i + 1 < n; ++i) gram += std::string(1, static_cast<char>('a' + i)) + " ";
    gram += run('z', letters - (n - 1));
    // 2 * (letters + n - 1) + x + y + 3 spaces = 1000.
    const int x = (997 - 2 * static_cast<int>(gram.size())) / 2;
    const int y = 997 - 2 * static_cast<int>(gram.size()) - x;
    const std::string kept = gram + " " + run('x', x) + " " + gram + " " + run('y', y);
    const std::string dropped = gram + " " + run('x', x) + " " + gram + " " + run('y', y - 1);
    ASSERT_EQ(kept.size(), 1000u);
    EXPECT_EQ(verdict(f.check(kept)), "kept") << n << "-grams: " << letters << " / 1000";
    EXPECT_EQ(verdict(f.check(dropped)), "repetition_dup_ngrams")
        << n << "-grams: " << letters << " / 999";
  }
}

TEST(Filters, C4LineRules) {
  C4Filter f;
  f.enabled = true;
  std::string out;
  int64_t removed = 0;
  std::string doc =
      "Menu\nThis is the first real sentence of the page. And a second one here.\n"
      "Please enable javascript to view this site properly.\n"
      "The third sentence sits on its own line here! Another one follows now.\n"
      "Read our privacy policy before you continue reading.\n"
      "A fourth sentence closes the text with a citation.[12]\n";
  EXPECT_EQ(f.apply(doc, out, removed), nullptr);
  EXPECT_EQ(removed, 3);
  EXPECT_EQ(out.find("Menu"), std::string::npos);
  EXPECT_EQ(out.find("javascript"), std::string::npos);
  EXPECT_EQ(out.find("[12]"), std::string::npos);
  EXPECT_STREQ(f.apply("Lorem ipsum dolor sit amet is here.", out, removed), "c4_lorem_ipsum");
  EXPECT_STREQ(f.apply(doc + "function f() { return 1; } is code.\n", out, removed),
               "c4_curly_bracket");
  EXPECT_STREQ(f.apply("Just one sentence here.", out, removed), "c4_too_few_sentences");
}

namespace {
// Four and five lines of one sentence each, which every C4 line rule keeps.
const char* const kFourSentences =
    "The first line has one sentence.\nThe second line has another.\n"
    "A third one is here.\nA fourth one follows it.";
const char* const kFiveSentences =
    "The first line has one sentence.\nThe second line has another.\n"
    "A third one is here.\nA fourth one follows it.\nThe fifth closes the text.";

struct C4Result {
  std::string verdict, out;
  int64_t removed = 0;
};
C4Result c4(const C4Filter& f, const std::string& text) {
  C4Result r;
  r.verdict = verdict(f.apply(text, r.out, r.removed));
  return r;
}
}  // namespace

// The thresholds: sentences per document, words per line, characters per word.
TEST(Filters, C4Thresholds) {
  C4Filter f;
  const std::string four = kFourSentences;
  // At least 5 sentences: 4 lines are too few, a fifth line makes 5.
  EXPECT_EQ(c4(f, four).verdict, "c4_too_few_sentences");
  C4Result r = c4(f, kFiveSentences);
  EXPECT_EQ(r.verdict, "kept");
  EXPECT_EQ(r.removed, 0);
  EXPECT_EQ(r.out, kFiveSentences);
  // A sentence ends with '.', '!' or '?' before a space or the line's end: "3.14" ends none, so
  // the line below counts 1 and the one after it 2.
  const std::string three =
      "The first line has one sentence.\nThe second line has another.\n"
      "A third one is here.";
  EXPECT_EQ(c4(f, three + "\nPi is 3.14 and e is 2.71 today.").verdict, "c4_too_few_sentences");
  EXPECT_EQ(c4(f, three + "\nPi is 3.14 today! And e is 2.71.").verdict, "kept");
  // At least 3 words a line: "Three words here." stays (5 sentences); "Two words." goes (4).
  EXPECT_EQ(c4(f, four + "\nThree words here.").verdict, "kept");
  r = c4(f, four + "\nTwo words.");
  EXPECT_EQ(r.verdict, "c4_too_few_sentences");
  EXPECT_EQ(r.removed, 1);
  // Words are counted before citations go, as in datatrove: "Two [1] words." is three words.
  r = c4(f, four + "\nTwo [1] words.");
  EXPECT_EQ(r.verdict, "kept");
  EXPECT_EQ(r.out, four + "\nTwo  words.");
  // No word over 1000 characters: a word of 1000 keeps its line, one of 1001 drops it.
  EXPECT_EQ(c4(f, four + "\nA long word " + run('x', 1000) + " here.").verdict, "kept");
  r = c4(f, four + "\nA long word " + run('x', 1001) + " here.");
  EXPECT_EQ(r.verdict, "c4_too_few_sentences");
  EXPECT_EQ(r.removed, 1);
  // Characters, not bytes: 1000 "é" are 2000 bytes and kept; 1001 are not.
  std::string e1000;
  for (int i = 0; i < 1000; ++i) e1000 += "\u00e9";
  EXPECT_EQ(c4(f, four + "\nA long word " + e1000 + " here.").verdict, "kept");
  EXPECT_EQ(c4(f, four + "\nA long word " + e1000 + "\u00e9 here.").verdict,
            "c4_too_few_sentences");
}

// The document rules (lorem ipsum, '{') look only at lines that the rules before them keep; the
// rules that drop single lines (javascript, policies, terminal punctuation); citations.
TEST(Filters, C4DocumentAndLineRules) {
  C4Filter f;
  const std::string four = kFourSentences, five = kFiveSentences;
  // "lorem ipsum", in any case, drops the document; on a line without terminal punctuation it is
  // gone before the check.
  EXPECT_EQ(c4(f, five + "\nSome Lorem Ipsum dolor sit amet.").verdict, "c4_lorem_ipsum");
  C4Result r = c4(f, five + "\nLorem ipsum dolor sit amet");
  EXPECT_EQ(r.verdict, "kept");
  EXPECT_EQ(r.removed, 1);
  // '{' drops the document, on a kept line; '}' does not.
  EXPECT_EQ(c4(f, five + "\nThe set {1, 2} is small.").verdict, "c4_curly_bracket");
  EXPECT_EQ(c4(f, five + "\nThe set {1, 2} is small").removed, 1);
  r = c4(f, five + "\nA closing } alone is fine.");
  EXPECT_EQ(r.verdict, "kept");
  EXPECT_EQ(r.removed, 0);
  // Lines mentioning javascript (any case) or a policy go; "a cookie" is no policy.
  for (const char* line : {"Please enable JavaScript to continue.", "Read the terms of use first.",
                           "See our privacy policy for more.", "Our cookie policy is short.",
                           "This site uses cookies to work.", "We explain our use of cookies.",
                           "We use cookies on every page."}) {
    r = c4(f, five + "\n" + line);
    EXPECT_EQ(r.verdict, "kept") << line;
    EXPECT_EQ(r.removed, 1) << line;
    EXPECT_EQ(r.out, five) << line;
  }
  EXPECT_EQ(c4(f, five + "\nThis site uses a cookie jar.").removed, 0);
  // Terminal punctuation: . ? ! " ' end a kept line; "..." does not.
  for (const char* line : {"Is this a question?", "What a line this is!", "She said \"it is.\"",
                           "He called it 'the end'"})
    EXPECT_EQ(c4(f, four + "\n" + line).verdict, "kept") << line;
  r = c4(f, five + "\nAnd so it goes on...");
  EXPECT_EQ(r.removed, 1);
  EXPECT_EQ(r.out, five);
  // Citations go: [1], [], [edit], [citation needed].
  r = c4(f, four + "\nA claim[1] with[] notes[edit] here[citation needed].");
  EXPECT_EQ(r.verdict, "kept");
  EXPECT_EQ(r.out, four + "\nA claim with notes here.");
  // Without a sentence minimum, a document whose every line goes is dropped, not kept empty.
  f.min_num_sentences = 0;
  EXPECT_EQ(c4(f, "no punctuation here\nnor here").verdict, "c4_no_lines_left");
  r = c4(f, "no punctuation here\nJust one sentence here.");
  EXPECT_EQ(r.verdict, "kept");
  EXPECT_EQ(r.out, "Just one sentence here.");
}

TEST(Filters, FineWebHeuristics) {
  FineWebFilter f;
  f.enabled = true;
  EXPECT_EQ(f.check(good_text()), nullptr);
  std::string no_punct;
  for (int i = 0; i < 10; ++i) no_punct += "a line without any final punctuation at all ok\n";
  EXPECT_STREQ(f.check(no_punct), "fineweb_line_punct");
  std::string short_lines;
  for (int i = 0; i < 10; ++i) short_lines += "Short " + std::to_string(i) + ".\n";
  EXPECT_STREQ(f.check(short_lines), "fineweb_short_lines");
  std::string dup = good_text() +
                    "\nThis exact line is repeated in the text again.\n"
                    "This exact line is repeated in the text again.";
  EXPECT_STREQ(f.check(dup), "fineweb_char_dup");
}

// FineWeb's thresholds compare as datatrove 0.10.1's: a document is dropped when fewer than 12%
// of its lines end with punctuation, when more than 67% are short, when repeated lines are more
// than 1% of its bytes; one at a bound is kept. The documents are made of text_line()s, unique,
// with no repeats unless said.
TEST(Filters, FineWebLineRatios) {
  FineWebFilter f;
  // Ending with . ' " ! ?: of 10000 lines of 40 bytes and 8 words, 1199 is 0.1199, dropped; 1200
  // is 0.12, kept. (9999 newlines in 80000 words is 0.125 for the list rule.)
  auto punct = [](int n, int blank_lines) {
    std::vector<std::string> lines;
    const char ends[] = "'\"!?.";
    for (int i = 0; i < 10000; ++i) lines.push_back(text_line(i, 40, 8, i < n ? ends[i % 5] : 'x'));
    for (int i = 0; i < blank_lines; ++i) lines.insert(lines.begin() + 1, "");
    return join(lines, "\n");
  };
  EXPECT_EQ(verdict(f.check(punct(1199, 0))), "fineweb_line_punct");
  EXPECT_EQ(verdict(f.check(punct(1200, 0))), "kept");
  // Blank lines are not lines (as datatrove strips them): 1200 of 10000 lines and 2000 blank
  // ones is still 0.12 (1200 / 12000 would be 0.1).
  EXPECT_EQ(verdict(f.check(punct(1200, 2000))), "kept");
  // line_punct_exclude_zero keeps a document without any such line, and only that one.
  EXPECT_EQ(verdict(f.check(punct(0, 0))), "fineweb_line_punct");
  FineWebFilter exclude_zero;
  exclude_zero.line_punct_exclude_zero = true;
  EXPECT_EQ(verdict(exclude_zero.check(punct(0, 0))), "kept");
  EXPECT_EQ(verdict(exclude_zero.check(punct(1199, 0))), "fineweb_line_punct");
  // Short lines, of at most 30 characters (bytes, in ASCII): 670 lines of 20 bytes, 329 of 40 and
  // one of 30 is 671 of 1000, 0.671, dropped; with that one of 31 bytes, 0.67, kept. (999
  // newlines in 4000 words.)
  auto short_lines = [](int boundary_bytes) {
    std::vector<std::string> lines;
    for (int i = 0; i < 670; ++i) lines.push_back(text_line(i, 20));
    for (int i = 670; i < 999; ++i) lines.push_back(text_line(i, 40));
    lines.push_back(text_line(999, boundary_bytes));
    return join(lines, "\n");
  };
  EXPECT_EQ(verdict(f.check(short_lines(30))), "fineweb_short_lines");
  EXPECT_EQ(verdict(f.check(short_lines(31))), "kept");
}

// A short line is one of at most short_line_length characters, as datatrove's len(line), not
// bytes: lines of 20 characters in 32 bytes (Cyrillic letters take two) are short.
TEST(Filters, FineWebShortLinesCountCharacters) {
  FineWebFilter f;
  std::vector<std::string> lines;
  for (int i = 0; i < 10; ++i)
    lines.push_back(times(6, "\u0451\u0436").substr(1) + " " + std::to_string(i) + ".");
  ASSERT_EQ(lines[0].size(), 32u);
  EXPECT_EQ(utf8_length(lines[0]), 20u);
  EXPECT_EQ(verdict(f.check(join(lines, "\n"))), "fineweb_short_lines");
  f.short_line_length = 19;  // one character less: no line is short
  EXPECT_EQ(verdict(f.check(join(lines, "\n"))), "kept");
}

TEST(Filters, FineWebRepeatsAndListRatio) {
  FineWebFilter f;
  // Repeated lines' bytes over the bytes that are not newlines: a 10-byte line twice and four of
  // 245 is 10 / (20 + 980) = 0.01, kept (at the bound); with one of 244, 10 / 999, dropped. (2
  // short lines of 6; 5 newlines in 24 words.)
  auto repeats = [](int last_bytes) {
    const std::string d = text_line(0, 10);
    return join(
        {d, text_line(1, 245), text_line(2, 245), text_line(3, 245), text_line(4, last_bytes), d},
        "\n");
  };
  EXPECT_EQ(verdict(f.check(repeats(244))), "fineweb_char_dup");
  EXPECT_EQ(verdict(f.check(repeats(245))), "kept");
  // Newlines per word at most 0.3: 301 lines of 40 bytes, 97 of 4 words and 204 of 3, is 300
  // newlines in 1000 words, kept; a final newline makes 301 / 1000.
  std::vector<std::string> lines;
  for (int i = 0; i < 301; ++i) lines.push_back(text_line(i, 40, i < 97 ? 4 : 3));
  EXPECT_EQ(verdict(f.check(join(lines, "\n"))), "kept");
  EXPECT_EQ(verdict(f.check(join(lines, "\n") + "\n")), "fineweb_list_ratio");
  // A text of blank lines has none to judge; a single "." is a line, and short.
  EXPECT_EQ(verdict(f.check("")), "fineweb_empty");
  EXPECT_EQ(verdict(f.check("\n \n\t\n")), "fineweb_empty");
  EXPECT_EQ(verdict(f.check(".")), "fineweb_short_lines");
}

// Synthetic near-duplicates with known Jaccard similarity of their 5-gram shingle sets: a base
// of N distinct words, and a copy whose last k words are replaced. Shared shingles are the
// N - 4 - k that do not touch a replaced word; the union adds the k new ones.
TEST(MinHash, RecallAndFalseMergesOnKnownJaccard) {
  MinHashOptions o;
  MinHasher h(o);
  const int m = o.signature_size();
  Rng rng(42);
  const int N = 200;
  auto make = [&](uint64_t tag, int keep, std::string& a, std::string& b) {
    a.clear();
    b.clear();
    for (int i = 0; i < N; ++i) {
      std::string w = "w" + std::to_string(tag) + "x" + std::to_string(i);
      a += w + " ";
      b += (i < keep ? w : "z" + std::to_string(tag) + "y" + std::to_string(i)) + " ";
    }
  };
  std::vector<uint32_t> sigs;
  std::vector<double> jac;
  for (int p = 0; p < 200; ++p) {
    // Half the pairs above 0.85, half below 0.5.
    int k = p % 2 == 0 ? static_cast<int>(rng.below(12)) : 80 + static_cast<int>(rng.below(60));
    int keep = N - k;
    double shared = std::max(0, N - 4 - k);
    double j = shared / (shared + 2.0 * (N - 4 - shared));
    jac.push_back(j);
    std::string a, b;
    make(static_cast<uint64_t>(p), keep, a, b);
    size_t at = sigs.size();
    sigs.resize(at + 2 * static_cast<size_t>(m));
    h.signature(a, &sigs[at]);
    h.signature(b, &sigs[at + static_cast<size_t>(m)]);
  }
  NearDupResult r = find_near_duplicates(sigs, 400, o);
  int high = 0, found = 0, low = 0, merged = 0;
  for (int p = 0; p < 200; ++p) {
    bool same = r.cluster[static_cast<size_t>(2 * p + 1)] == 2 * p;
    if (jac[static_cast<size_t>(p)] > 0.85) {
      ++high;
      found += same;
    } else if (jac[static_cast<size_t>(p)] < 0.5) {
      ++low;
      merged += same;
    }
  }
  ASSERT_GT(high, 50);
  ASSERT_GT(low, 50);
  EXPECT_GE(static_cast<double>(found) / high, 0.95) << found << " of " << high;
  EXPECT_LT(static_cast<double>(merged) / low, 0.01) << merged << " of " << low;
  // No pair across different bases is merged.
  for (int i = 0; i < 400; ++i) EXPECT_GE(r.cluster[static_cast<size_t>(i)], i - 1);
}

TEST(MinHash, ClustersAreConnectedComponentsKeepingTheFirst) {
  MinHashOptions o;
  MinHasher h(o);
  const int m = o.signature_size();
  std::string base = words(300);
  std::vector<std::string> docs = {base, words(300, "other"), base + " extra tail words here",
                                   base + " another different ending"};
  std::vector<uint32_t> sigs(docs.size() * static_cast<size_t>(m));
  for (size_t i = 0; i < docs.size(); ++i) h.signature(docs[i], &sigs[i * static_cast<size_t>(m)]);
  NearDupResult r = find_near_duplicates(sigs, 4, o);
  EXPECT_EQ(r.cluster, (std::vector<int64_t>{0, 1, 0, 0}));
  EXPECT_EQ(r.duplicates, 2);
}

// Documents without words (punctuation only, as code and tables have) share the empty signature
// but are not one another's near duplicates.
TEST(MinHash, DocumentsWithoutWordsAreNobodysDuplicates) {
  MinHashOptions o;
  MinHasher h(o);
  const int m = o.signature_size();
  const std::string base = words(300);
  std::vector<std::string> docs = {"+++ --- ***", base, "{ } ( ) [ ]", base, "!!!!! ?????"};
  std::vector<uint32_t> sigs(docs.size() * static_cast<size_t>(m));
  for (size_t i = 0; i < docs.size(); ++i) h.signature(docs[i], &sigs[i * static_cast<size_t>(m)]);
  NearDupResult r = find_near_duplicates(sigs, 5, o);
  EXPECT_EQ(r.cluster, (std::vector<int64_t>{0, 1, 2, 1, 4}));
  EXPECT_EQ(r.duplicates, 1);
}

TEST(Pii, PositivesAreRedactedWithTypedPlaceholders) {
  PiiOptions o;
  std::string out;
  auto counts = redact_pii(
      "Mail jane.doe+news@example.co.uk or call +1 415 555 2671 or (415) 555-2671. "
      "Server 192.168.10.20 and 2001:db8:85a3::8a2e:370:7334. Card 4111 1111 1111 1111, "
      "IBAN GB82 WEST 1234 5698 7654 32.",
      o, out);
  EXPECT_EQ(out,
            "Mail <EMAIL> or call <PHONE> or <PHONE>. Server <IP_ADDRESS> and <IP_ADDRESS>. "
            "Card <CREDIT_CARD>, IBAN <IBAN>.");
  EXPECT_EQ(counts.n[static_cast<int>(PiiType::email)], 1);
  EXPECT_EQ(counts.n[static_cast<int>(PiiType::phone)], 2);
  EXPECT_EQ(counts.n[static_cast<int>(PiiType::ip)], 2);
  EXPECT_EQ(counts.n[static_cast<int>(PiiType::credit_card)], 1);
  EXPECT_EQ(counts.n[static_cast<int>(PiiType::iban)], 1);
  EXPECT_EQ(redact_pii("DE89370400440532013000", o, out).total(), 1);
  EXPECT_EQ(redact_pii("card 5500-0000-0000-0004 ok", o, out).total(), 1);
  for (const char* ip : {"ping fe80::1 now", "host ::1 here", "net 2001:db8:: up"})
    EXPECT_EQ(redact_pii(ip, o, out).n[static_cast<int>(PiiType::ip)], 1) << ip;
}

TEST(Pii, LookAlikesAreLeftAlone) {
  PiiOptions o;
  std::string out;
  for (const char* s : {
           "Upgrade to version 1.2.3.4 today",     // version string
           "pollen v2.10.1.0 released",            // version string
           "Meeting on 2023-01-15 at 10:30:45",    // date and time
           "Order #123456789012 shipped",          // order number
           "ISBN 978-3-16-148410-0 is a book",     // ISBN
           "Card 4111 1111 1111 1112 is invalid",  // Luhn fails
           "GB82 WEST 1234 5698 7654 33 wrong",    // IBAN checksum fails
           "std::vector<int> in C++ code",         // namespaces, not IPv6
           "In C++ you write A::B and Face::Add",  // scopes of hex letters alone
           "the call cb::add(x) returns",          // the same
           "call me at 555-1234",                  // too short for a phone number
           "user at example dot com",              // not an address
           "Pi is 3.14159265358979",               // decimals
       }) {
    EXPECT_EQ(redact_pii(s, o, out).total(), 0) << s << " -> " << out;
    EXPECT_EQ(out, s);
  }
}

// A run of digit groups glued to a word is no phone number, nor is any run starting inside it;
// one of 50,000 groups is passed over once (it was scanned again from each group), and what
// follows it is still redacted.
TEST(Pii, ARunGluedToAWordIsLeftAloneWhereverItStarts) {
  PiiOptions o;
  std::string out;
  EXPECT_EQ(redact_pii("ref 415 555 2671x", o, out).total(), 0) << out;
  std::string glued = "numbers ";
  for (int i = 0; i < 50000; ++i) glued += "1 ";
  glued += "1x, then call (415) 555-2671.";
  const auto counts = redact_pii(glued, o, out);
  EXPECT_EQ(counts.total(), 1);
  EXPECT_EQ(out, glued.substr(0, glued.size() - 15) + "<PHONE>.");
}

TEST(Pii, ChecksumHelpers) {
  EXPECT_TRUE(luhn_valid("4111111111111111"));
  EXPECT_FALSE(luhn_valid("4111111111111112"));
  EXPECT_TRUE(iban_valid("GB82WEST12345698765432"));
  EXPECT_FALSE(iban_valid("GB82WEST12345698765433"));
}

TEST(Decontaminate, ThirteenGramOverlap) {
  Decontaminator d(13);
  d.add_eval_text(
      "Question: what is the boiling point of water at sea level in degrees Celsius? Answer: "
      "one hundred.");
  d.add_eval_text("too short to matter");
  EXPECT_EQ(d.short_texts(), 1);
  EXPECT_TRUE(d.contaminated(
      "Some training page copied it: WHAT is the boiling point of water, at sea level in "
      "degrees celsius answer one hundred! and more."));
  EXPECT_FALSE(
      d.contaminated("The boiling point of water at sea level is one hundred degrees "
                     "Celsius, as every textbook says."));
}

TEST(Filters, GopherRepetitionNgramTablesAreConfigurable) {
  auto load = [](const std::string& toml) {
    ConfigTable t = ConfigTable::parse(toml, "test.toml");
    GopherRepetitionFilter f;
    auto g = t.table("gopher_repetition");
    load_filter(*g, f);
    g->finish();
    return f;
  };
  // "of the" covers about 3% of the text: under Gopher's 20% for 2-grams, over a 1% threshold.
  EXPECT_EQ(load("[gopher_repetition]\n").check(good_text()), nullptr);
  auto strict = load("[gopher_repetition]\ntop_n_grams = [2]\ntop_n_gram_fracs = [0.01]\n");
  EXPECT_EQ(strict.top_n_grams, (std::vector<std::pair<int, double>>{{2, 0.01}}));
  EXPECT_STREQ(strict.check(good_text()), "repetition_top_ngram");
  // Repeated 5-grams: a sentence said twice is 2% of this text, dropped at a 1% threshold.
  std::string twice = good_text() + " Farmers settled there with their families.";
  twice += " Farmers settled there with their families.";
  EXPECT_EQ(load("[gopher_repetition]\n").check(twice), nullptr);
  EXPECT_STREQ(
      load("[gopher_repetition]\ndup_n_grams = [5]\ndup_n_gram_fracs = [0.01]\n").check(twice),
      "repetition_dup_ngrams");
  // Thresholds alone apply to the default sizes (2, 3, 4), and sizes alone keep theirs.
  EXPECT_EQ(load("[gopher_repetition]\ntop_n_gram_fracs = [0.25, 0.2, 0.15]\n").top_n_grams,
            (std::vector<std::pair<int, double>>{{2, 0.25}, {3, 0.2}, {4, 0.15}}));
  EXPECT_EQ(load("[gopher_repetition]\ntop_n_grams = [3, 4, 5]\n").top_n_grams,
            (std::vector<std::pair<int, double>>{{3, 0.2}, {4, 0.18}, {5, 0.16}}));
  // Empty tables turn the rules off; mismatched tables are an error naming the key.
  auto off = load("[gopher_repetition]\ntop_n_grams = []\ntop_n_gram_fracs = []\n");
  EXPECT_TRUE(off.top_n_grams.empty());
  try {
    load("[gopher_repetition]\ndup_n_grams = [5, 6]\ndup_n_gram_fracs = [0.1]\n");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gopher_repetition.dup_n_gram_fracs"), std::string::npos)
        << e.what();
  }
}
