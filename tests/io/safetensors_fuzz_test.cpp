// The safetensors fuzz target on a deterministic corpus of mutated files, so that every run of
// the suite exercises it: a valid file with bytes flipped, digits changed, bytes inserted and
// removed, the header length rewritten and the file cut, plus hand-made hostile headers. Each
// input must be read or refused with pollen::Error; nothing else may happen.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/files.h"
#include "base/rng.h"
#include "io/fuzz/safetensors_target.h"
#include "io/safetensors.h"

using namespace pollen;

namespace {

std::string valid_file() {
  io::NamedTensors in;
  in.emplace_back("w", Tensor::from<float>({2, 3}, {1, 2, 3, 4, 5, 6}));
  in.emplace_back("b", Tensor::from<int64_t>({2}, {7, -8}));
  in.emplace_back("e", Tensor::zeros({0, 3}, DType::f32));
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("pollen_fuzz_seed_" + std::to_string(getpid()));
  io::write_safetensors(p, in, {{"format", "pt"}});
  std::string bytes = read_file(p);
  std::filesystem::remove(p);
  return bytes;
}

std::string with_header(const std::string& header, const std::string& payload) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + payload;
}

std::string mutate(std::string s, Rng& rng) {
  uint64_t header_len = 0;
  std::memcpy(&header_len, s.data(), 8);
  const size_t header_end = 8 + static_cast<size_t>(header_len);
  const auto at = [&](size_t limit) {
    return limit == 0 ? 0 : static_cast<size_t>(rng.below(limit));
  };
  const int edits = 1 + static_cast<int>(rng.below(3));
  for (int e = 0; e < edits && !s.empty(); ++e) {
    switch (rng.below(7)) {
      case 0:  // flip a byte of the header
        if (s.size() > 8)
          s[8 + at(std::min<uint64_t>(header_len, s.size() - 8))] ^=
              static_cast<char>(1 + rng.below(255));
        break;
      case 1: {  // change a digit (offsets, shapes) to another digit
        std::vector<size_t> digits;
        for (size_t i = 8; i < std::min(header_end, s.size()); ++i)
          if (s[i] >= '0' && s[i] <= '9') digits.push_back(i);
        if (!digits.empty()) s[digits[at(digits.size())]] = static_cast<char>('0' + rng.below(10));
        break;
      }
      case 2:  // insert a byte
        s.insert(s.begin() + static_cast<std::ptrdiff_t>(at(s.size())),
                 static_cast<char>(rng.below(256)));
        break;
      case 3:  // remove a byte
        s.erase(s.begin() + static_cast<std::ptrdiff_t>(at(s.size())));
        break;
      case 4: {  // rewrite the header length
        const uint64_t n = rng.below(2) ? rng.next_u64() : header_len + rng.below(9) - 4;
        if (s.size() >= 8) std::memcpy(s.data(), &n, 8);
        break;
      }
      case 5:  // cut the file
        s.resize(at(s.size()));
        break;
      case 6: {  // repeat a piece of the header inside it
        const size_t from = 8 + at(header_len), len = 1 + at(16);
        const size_t to = std::min(s.size(), 8 + at(header_len));
        if (from + len <= s.size()) s.insert(to, s.substr(from, len));
        break;
      }
    }
  }
  return s;
}

bool run_target(const std::string& input) {
  return fuzz::parse_untrusted_safetensors(reinterpret_cast<const uint8_t*>(input.data()),
                                           input.size());
}

}  // namespace

TEST(SafetensorsFuzz, MutatedFilesAreReadOrRefused) {
  const std::string seed = valid_file();
  ASSERT_TRUE(run_target(seed));
  Rng rng(2026);
  int read = 0, refused = 0;
  for (int i = 0; i < 4000; ++i) {
    const std::string input = mutate(seed, rng);
    try {
      (run_target(input) ? read : refused) += 1;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "mutation " << i << " escaped as " << e.what();
    }
  }
  EXPECT_GT(refused, 3000);  // most mutations break the file
  EXPECT_GT(read, 0);        // some leave it readable (a metadata byte, a digit to itself)
}

TEST(SafetensorsFuzz, HostileHeadersAreRefused) {
  const std::string f4(8, '\0');
  const std::vector<std::string> headers = {
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})",
      R"({"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})",
      R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
      R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,12]}})",
      R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})",
      R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})",
      R"({"a":[1,2,3]})",
      R"({"__metadata__":{"k":1}})",
      R"({"__metadata__":[]})",
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
      std::string(200000, '[') + std::string(200000, ']'),
      "\"just a string\"",
      "",
  };
  for (const auto& h : headers) EXPECT_FALSE(run_target(with_header(h, f4))) << h.substr(0, 80);
}
