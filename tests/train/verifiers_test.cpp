// Built-in verifiers on inputs where a careless parser or extractor gives a different reward.
#include "train/verifiers.h"

#include <gtest/gtest.h>

#include <limits>

#include "base/error.h"

namespace pollen::train {
namespace {

using Mode = AnswerExtraction::Mode;

RewardFunction verifier(const std::string& toml) {
  ConfigTable t = ConfigTable::parse(toml, "verifier.toml");
  RewardFunction f = make_verifier(t);
  t.finish();
  return f;
}

std::string error_of(const std::string& toml) {
  try {
    verifier(toml);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Verifiers, ExtractsAfterTheLastMarkerToTheEndOfItsLine) {
  const AnswerExtraction marker;
  EXPECT_EQ(extract_answer("think: 3 #### 4 is wrong\n#### 42\nbye", marker), "42");
  EXPECT_EQ(extract_answer("####   -7  ", marker), "-7");
  EXPECT_EQ(extract_answer("no marker: 42", marker), std::nullopt);
  EXPECT_EQ(extract_answer("#### \n", marker), std::nullopt);
  const AnswerExtraction last_line{Mode::last_line, ""};
  EXPECT_EQ(extract_answer("a\nb c\n\n  \n", last_line), "b c");
  EXPECT_EQ(extract_answer("single", last_line), "single");
  const AnswerExtraction whole{Mode::whole, ""};
  EXPECT_EQ(extract_answer("  x\ny ", whole), "x\ny");
}

TEST(Verifiers, ParsesNumbersAsPeopleWriteThem) {
  EXPECT_EQ(parse_number("42"), 42.0);
  EXPECT_EQ(parse_number(" -17 "), -17.0);
  EXPECT_EQ(parse_number("+3.25"), 3.25);
  EXPECT_EQ(parse_number(".5"), 0.5);
  EXPECT_EQ(parse_number("1,234,567"), 1234567.0);
  EXPECT_EQ(parse_number("-1,000.75"), -1000.75);
  EXPECT_EQ(parse_number("\xE2\x88\x92"
                         "8"),
            -8.0);                                    // U+2212 minus
  EXPECT_EQ(parse_number("1,23"), std::nullopt);      // not a thousands group
  EXPECT_EQ(parse_number("1234,567"), std::nullopt);  // the first group has more than 3 digits
  EXPECT_EQ(parse_number("12a"), std::nullopt);
  EXPECT_EQ(parse_number("--3"), std::nullopt);
  EXPECT_EQ(parse_number("-"), std::nullopt);
  EXPECT_EQ(parse_number(""), std::nullopt);
  EXPECT_EQ(parse_number("3."), std::nullopt);
  EXPECT_EQ(parse_number("1e-7"), 1e-7);  // an exponent after the digits
  EXPECT_EQ(parse_number("-2.5E3"), -2500.0);
  EXPECT_EQ(parse_number("2e"), std::nullopt);
  EXPECT_EQ(parse_number(std::string(400, '9')), std::nullopt);  // past double's range
}

// A sampled completion may hold any run of digits: past double's range it is inf (or 0), a
// reward of 0, never an exception that ends the run.
TEST(Verifiers, DigitsPastDoublesRangeScoreNotThrow) {
  const AnswerExtraction marker;
  EXPECT_EQ(numeric_match_reward("#### " + std::string(320, '9'), 5, marker, 1e-6, 0), 0.0);
  EXPECT_EQ(numeric_match_reward("#### 0." + std::string(400, '0') + "1", 5, marker, 1e-6, 0), 0.0);
  EXPECT_EQ(last_number("then " + std::string(400, '9')), std::numeric_limits<double>::infinity());
}

TEST(Verifiers, FindsTheLastNumberInText) {
  EXPECT_EQ(last_number("x = 1,250.5 dollars"), 1250.5);
  EXPECT_EQ(last_number("from 3 to -12."), -12.0);
  EXPECT_EQ(last_number("3-5"), 5.0);  // a minus after a digit is subtraction, not a sign
  // An exponent belongs to its number: not the mantissa alone, not the exponent as a number.
  EXPECT_EQ(last_number("#### 1e-7"), 1e-7);
  EXPECT_EQ(last_number("#### 1e3"), 1000.0);
  EXPECT_EQ(last_number("so -2.5E+3 it is"), -2500.0);
  EXPECT_EQ(last_number("3e and 4"), 4.0);
  EXPECT_EQ(last_number("2e"), 2.0);  // no exponent's digits: the number ends before the e
  EXPECT_EQ(last_number("1e999"), std::numeric_limits<double>::infinity());
  EXPECT_EQ(last_number("the answer is 7, not 8"), 8.0);
  EXPECT_EQ(last_number("1, 2, 3"), 3.0);
  EXPECT_EQ(last_number("v2x"), std::nullopt);  // a digit inside a word is not a number
  EXPECT_EQ(last_number("no digits"), std::nullopt);
}

TEST(Verifiers, NumericMatchWithToleranceAndSeparators) {
  const AnswerExtraction marker;
  EXPECT_EQ(numeric_match_reward("so #### 1,234", 1234, marker, 1e-6, 0), 1.0);
  // The reference's own text, exponent and all, matches; the mantissa alone is no answer.
  EXPECT_EQ(numeric_match_reward("#### 1e-7", *parse_number("1e-7"), marker, 1e-9, 0), 1.0);
  EXPECT_EQ(numeric_match_reward("#### 0", *parse_number("1e-7"), marker, 1e-9, 0), 0.0);
  EXPECT_EQ(numeric_match_reward("#### 1e3", 1, marker, 1e-6, 0), 0.0);
  EXPECT_EQ(numeric_match_reward("#### 1234.0000001", 1234, marker, 1e-6, 0), 1.0);
  EXPECT_EQ(numeric_match_reward("#### 1234.01", 1234, marker, 1e-6, 0), 0.0);
  EXPECT_EQ(numeric_match_reward("#### 1234.01", 1234, marker, 1e-6, 1e-4), 1.0);  // rel 0.1234
  EXPECT_EQ(numeric_match_reward("#### -5", 5, marker, 1e-6, 0), 0.0);
  EXPECT_EQ(numeric_match_reward("#### The answer is -5.", -5, marker, 1e-6, 0), 1.0);
  EXPECT_EQ(numeric_match_reward("42", 42, marker, 1e-6, 0), 0.0);  // no marker, no answer
  EXPECT_EQ(numeric_match_reward("#### 4 2", 42, marker, 1e-6, 0), 0.0);
}

TEST(Verifiers, ExactMatchComparesTheExtractedAnswerWithWhitespaceNormalised) {
  const AnswerExtraction marker;
  EXPECT_EQ(exact_match_reward("#### New   York\n", "New York", marker), 1.0);
  EXPECT_EQ(exact_match_reward("#### new york", "New York", marker), 0.0);
  EXPECT_EQ(exact_match_reward("New York", "New York", marker), 0.0);
  EXPECT_EQ(exact_match_reward("#### 42.0", "42", marker), 0.0);  // exact is not numeric
}

TEST(Verifiers, FromConfig) {
  const auto numeric = verifier("kind = \"numeric\"\nabs_tol = 0.5\n");
  EXPECT_EQ(numeric("", "#### 10.4", "10"), 1.0);
  EXPECT_EQ(numeric("", "#### 10.6", "10"), 0.0);
  EXPECT_EQ(numeric("", "#### 10.6", "10,000"), 0.0);

  const auto last_line = verifier("kind = \"exact\"\nextract = \"last_line\"\n");
  EXPECT_EQ(last_line("", "working...\nParis\n", "Paris"), 1.0);

  const auto marker = verifier("kind = \"numeric\"\nmarker = \"Answer:\"\n");
  EXPECT_EQ(marker("", "#### 3\nAnswer: 4", "4"), 1.0);

  // {answer} is the answer escaped: "1+1" must match literally, not as "1 or more 1s".
  const auto regex = verifier("kind = \"regex\"\npattern = '^#### {answer}$'\n");
  EXPECT_EQ(regex("", "#### 1+1", "1+1"), 1.0);
  EXPECT_EQ(regex("", "#### 11", "1+1"), 0.0);
  const auto format = verifier("kind = \"regex\"\npattern = '#### -?[0-9]+'\n");
  EXPECT_EQ(format("", "so #### -12", "anything"), 1.0);
  EXPECT_EQ(format("", "so 12", "anything"), 0.0);
}

TEST(Verifiers, BadConfigsAndAnswersAreNamed) {
  EXPECT_NE(error_of("kind = \"fuzzy\"\n").find("key 'kind'"), std::string::npos);
  EXPECT_NE(error_of("kind = \"regex\"\npattern = '(unclosed'\n").find("not a valid regular"),
            std::string::npos);
  EXPECT_NE(error_of("kind = \"numeric\"\nabs_tol = -1\n").find("abs_tol"), std::string::npos);
  EXPECT_NE(error_of("kind = \"numeric\"\nextract = \"first\"\n").find("extract"),
            std::string::npos);
  EXPECT_NE(error_of("kind = \"numeric\"\ntolerance = 1\n").find("tolerance"), std::string::npos);
  // A key of another kind (kind switched with --set) says which kind it belongs to.
  EXPECT_NE(error_of("kind = \"regex\"\npattern = 'x'\nabs_tol = 0.1\n")
                .find("applies to kind = \"numeric\" only, and kind is \"regex\""),
            std::string::npos);
  const auto numeric = verifier("");
  try {
    numeric("", "#### 3", "three");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"three\" is not a finite number"), std::string::npos);
  }
}

}  // namespace
}  // namespace pollen::train
