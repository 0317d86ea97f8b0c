// Curation stages on crafted documents: UTF-8, filters, MinHash, PII, decontamination.
#include <gtest/gtest.h>

#include <string>

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
  f.min_chars = 5;
  f.max_chars = 20;
  EXPECT_STREQ(f.check("abc"), "too_short");
  EXPECT_STREQ(f.check(std::string(30, 'x')), "too_long");
  EXPECT_EQ(f.check("hello world"), nullptr);
  f.min_words = 3;
  EXPECT_STREQ(f.check("hello world"), "too_few_words");
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

TEST(Filters, GopherRepetition) {
  GopherRepetitionFilter f;
  EXPECT_EQ(f.check(good_text()), nullptr);
  std::string lines;
  for (int i = 0; i < 10; ++i) lines += "Buy now and save on every order today\n";
  lines += good_text();
  EXPECT_NE(f.check(lines), nullptr);
  std::string paras;
  for (int i = 0; i < 5; ++i) paras += "Same paragraph here with words.\n\n";
  paras += good_text();
  EXPECT_STREQ(f.check(paras), "repetition_dup_paragraphs");
  std::string ngram = good_text() + " ";
  for (int i = 0; i < 40; ++i) ngram += "click here ";
  EXPECT_STREQ(f.check(ngram), "repetition_top_ngram");
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
