#include "tokenizer/tiktoken_format.h"

#include <algorithm>
#include <charconv>
#include <unordered_map>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/byte_level.h"

namespace pollen::tokenizer {

namespace {
constexpr std::string_view kBase64 =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// A token as tokenizer.json spells it, with its id: 'ab' (id 256).
std::string token_named(const Vocab& vocab, uint32_t id) {
  return cat("'", bytes_to_byte_level(vocab.bytes(id)), "' (id ", id, ")");
}

std::string merge_named(const Vocab& vocab, const Merge& m) {
  return cat("'", bytes_to_byte_level(vocab.bytes(m.left)), "' '",
             bytes_to_byte_level(vocab.bytes(m.right)), "'");
}

std::string ids_named(const std::vector<uint32_t>& ids) {
  std::string out;
  for (uint32_t id : ids) out += cat(out.empty() ? "" : ", ", id);
  return "[" + out + "]";
}

bool is_special(const Tokenizer& tokenizer, uint32_t id) {
  for (const AddedToken& t : tokenizer.added_tokens())
    if (t.id == id) return true;
  return false;
}

// The merges as HF ranks them, each with the token it makes: a merge listed twice takes its
// last place.
std::vector<std::pair<size_t, uint32_t>> effective_merges(const BpeModel& model) {
  const Vocab& vocab = model.vocab();
  const std::vector<Merge>& merges = model.merges();
  std::unordered_map<uint64_t, size_t> last;
  for (size_t i = 0; i < merges.size(); ++i)
    last[uint64_t{merges[i].left} << 32 | merges[i].right] = i;
  std::vector<std::pair<size_t, uint32_t>> out;
  for (size_t i = 0; i < merges.size(); ++i)
    if (last[uint64_t{merges[i].left} << 32 | merges[i].right] == i)
      out.push_back(
          {i, *vocab.find(cat(vocab.bytes(merges[i].left), vocab.bytes(merges[i].right)))});
  return out;
}

// In a rank file a token's rank is its merge priority; in the merge list it is the merge's
// place. They agree only if the made tokens' ids rise along the list.
void check_ids_follow_merge_order(const BpeModel& model) {
  const Vocab& vocab = model.vocab();
  std::optional<uint32_t> highest;
  for (const auto& [i, made] : effective_merges(model)) {
    POLLEN_CHECK(!highest || made >= *highest, "model.merges[", i, "] (",
                 merge_named(vocab, model.merges()[i]), " -> ", token_named(vocab, made),
                 ") comes after a merge that makes ", token_named(vocab, *highest),
                 ": a tiktoken rank file merges in the order of the made tokens' ids, so they "
                 "must rise along the merge list");
    highest = made;
  }
}

// tiktoken takes a piece that is a token as that token; the merge list without ignore_merges
// makes it only if its merges reach it.
void check_tokens_encode_as_themselves(const Tokenizer& tokenizer) {
  const BpeModel& model = tokenizer.model();
  const Vocab& vocab = model.vocab();
  std::vector<uint32_t> ids;
  for (uint32_t id = 0; id < vocab.id_end(); ++id) {
    if (!vocab.contains(id) || vocab.bytes(id).size() < 2 || is_special(tokenizer, id)) continue;
    ids.clear();
    model.encode(vocab.bytes(id), ids);
    POLLEN_CHECK(ids == std::vector<uint32_t>{id}, "model.ignore_merges is false and token ",
                 token_named(vocab, id), " encodes by the merges as ", ids_named(ids),
                 ", while a tiktoken rank file encodes a piece that is a token as that token");
  }
}

// tiktoken makes a token from any two tokens that spell it, at the token's rank: the two its
// lower ranks reach on the token's bytes. Each token must be made by exactly that merge.
void check_merges_are_tiktokens(const Tokenizer& tokenizer) {
  const BpeModel& model = tokenizer.model();
  const Vocab& vocab = model.vocab();
  Vocab ranked_vocab;
  for (uint32_t id = 0; id < vocab.id_end(); ++id)
    if (vocab.contains(id) && !is_special(tokenizer, id))
      ranked_vocab.add(id, std::string(vocab.bytes(id)));
  const BpeModel ranked(std::move(ranked_vocab), {}, BpeOptions{});
  std::vector<Merge> tiktoken_merges;
  try {
    tiktoken_merges = ranked.merges();
  } catch (const Error& e) {
    fail("as a tiktoken rank file: ", e.what());
  }
  std::unordered_map<uint32_t, Merge> merge_of;
  for (const auto& [i, made] : effective_merges(model)) {
    const auto [other, fresh] = merge_of.emplace(made, model.merges()[i]);
    POLLEN_CHECK(fresh, "token ", token_named(vocab, made), " is made by two merges (",
                 merge_named(vocab, other->second), " and model.merges[", i, "] ",
                 merge_named(vocab, model.merges()[i]),
                 "), and a tiktoken rank file gives a token one rank");
  }
  size_t next = 0;
  for (uint32_t id = 0; id < ranked.vocab().id_end(); ++id) {
    if (!ranked.vocab().contains(id) || ranked.vocab().bytes(id).size() < 2) continue;
    const Merge& expected = tiktoken_merges[next++];
    auto it = merge_of.find(id);
    POLLEN_CHECK(it != merge_of.end(), "token ", token_named(vocab, id),
                 " is made by no merge, but tiktoken would make it from ",
                 merge_named(vocab, expected));
    POLLEN_CHECK(it->second == expected, "token ", token_named(vocab, id), " is made by merge ",
                 merge_named(vocab, it->second), ", but tiktoken would make it from ",
                 merge_named(vocab, expected), " (what its lower ranks reach on its bytes)");
  }
}

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(bytes[i])) << 16 | uint32_t(uint8_t(bytes[i + 1])) << 8 |
                 uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kBase64[(v >> s) & 63];
  }
  size_t rest = bytes.size() - i;
  if (rest > 0) {
    uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
    if (rest == 2) v |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    out += kBase64[(v >> 18) & 63];
    out += kBase64[(v >> 12) & 63];
    out += rest == 2 ? kBase64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out;
  for (size_t i = 0; i < text.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      char c = text[i + k];
      size_t d = kBase64.find(c);
      bool last_group = i + 4 == text.size();
      if (c == '=' && last_group && k >= 2 && (k == 3 || text[i + 3] == '=')) {
        ++pad;
        d = 0;
      } else if (d == std::string_view::npos || pad > 0) {
        return std::nullopt;
      }
      v = v << 6 | static_cast<uint32_t>(d);
    }
    out += static_cast<char>(v >> 16);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xFF);
    if (pad < 1) out += static_cast<char>(v & 0xFF);
  }
  return out;
}

std::vector<AddedToken> known_special_tokens(KnownPattern pattern) {
  switch (pattern) {
    case KnownPattern::kGpt2:
      return {{50256, "<|endoftext|>"}};
    case KnownPattern::kCl100k:
      return {{100257, "<|endoftext|>"},
              {100258, "<|fim_prefix|>"},
              {100259, "<|fim_middle|>"},
              {100260, "<|fim_suffix|>"},
              {100276, "<|endofprompt|>"}};
    case KnownPattern::kO200k:
      return {{199999, "<|endoftext|>"}, {200018, "<|endofprompt|>"}};
    case KnownPattern::kQwen2:  // the ones Qwen's qwen.tiktoken and Qwen2's tokenizer share
      return {{151643, "<|endoftext|>"}, {151644, "<|im_start|>"}, {151645, "<|im_end|>"}};
  }
  return {};
}

int64_t known_rank_count(KnownPattern pattern) {
  switch (pattern) {
    case KnownPattern::kGpt2:
      return 50256;
    case KnownPattern::kCl100k:
      return 100256;
    case KnownPattern::kO200k:
      return 199998;
    case KnownPattern::kQwen2:
      return 151643;
  }
  return 0;
}

Tokenizer tiktoken_from_text(std::string_view text, std::string_view source, std::string pattern,
                             std::vector<AddedToken> special_tokens) {
  Vocab vocab;
  // At most one token a line, so the ranks' limit (token_id_limit) follows from the lines.
  // A last line without its newline counts too.
  const auto lines = static_cast<uint64_t>(std::count(text.begin(), text.end(), '\n')) +
                     (!text.empty() && text.back() != '\n' ? 1 : 0);
  const uint32_t rank_limit = token_id_limit(lines);
  size_t line_number = 0;
  while (!text.empty()) {
    size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    size_t space = line.find(' ');
    POLLEN_CHECK(space != std::string_view::npos && line.find(' ', space + 1) == line.npos, source,
                 ":", line_number, ": expected 'base64-token rank', got '", line, "'");
    auto bytes = base64_decode(line.substr(0, space));
    POLLEN_CHECK(bytes && !bytes->empty(), source, ":", line_number, ": '", line.substr(0, space),
                 "' is not a base64 token");
    std::string_view rank_text = line.substr(space + 1);
    uint32_t rank = 0;
    auto [end, ec] = std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    POLLEN_CHECK(ec == std::errc() && end == rank_text.data() + rank_text.size(), source, ":",
                 line_number, ": rank '", rank_text, "' is not a non-negative integer");
    POLLEN_CHECK(rank < rank_limit, source, ":", line_number, ": rank ", rank,
                 " is too large for a file of ", lines, lines == 1 ? " line" : " lines",
                 " (ranks index a table: below ", rank_limit, ")");
    try {
      vocab.add(rank, std::move(*bytes));
    } catch (const Error& e) {
      fail(source, ":", line_number, ": ", e.what());
    }
  }
  POLLEN_CHECK(vocab.size() > 0, source, ": no tokens");
  for (int b = 0; b < 256; ++b)
    POLLEN_CHECK(vocab.find(std::string(1, static_cast<char>(b))), source,
                 ": byte-level BPE needs a token for every byte, and byte ", b, " has none");
  for (const AddedToken& t : special_tokens)
    POLLEN_CHECK(!vocab.contains(t.id), source, ": special token '", t.content, "' has id ", t.id,
                 ", which is also the rank of an ordinary token");
  std::vector<PreTokenizerStep> steps;
  steps.push_back(PreTokenizerStep::split_on(std::move(pattern), SplitBehavior::kIsolated));
  BpeModel model(std::move(vocab), {}, BpeOptions{});
  // The merge list the ranks stand for (the fingerprint and tokenizer.json need it), derived now
  // so that ranks which do not form one are refused naming the file, not at some later use.
  try {
    model.merges();
  } catch (const Error& e) {
    fail(source, ": ", e.what());
  }
  return Tokenizer(std::move(model), Normalizer{}, PreTokenizer(std::move(steps)),
                   std::move(special_tokens), BosEosTemplate{}, DecoderSpec{});
}

Tokenizer load_tiktoken(const std::filesystem::path& path, std::string pattern,
                        std::vector<AddedToken> special_tokens) {
  return tiktoken_from_text(read_file(path), path.string(), std::move(pattern),
                            std::move(special_tokens));
}

std::string tiktoken_text(const Tokenizer& tokenizer) {
  const BpeModel& model = tokenizer.model();
  POLLEN_CHECK(model.options().alphabet == Alphabet::kBytes,
               "only a byte-level tokenizer can be written as a tiktoken rank file");
  POLLEN_CHECK(tokenizer.normalizer().empty(),
               "a tokenizer with a normalizer cannot be written as a tiktoken rank file");
  // A rank file is read with one pattern whose matches are the pieces. Byte-level steps that
  // neither split nor add a space change nothing and are passed over.
  using Kind = PreTokenizerStep::Kind;
  int cutting = 0;
  bool one_pattern = true;
  for (const PreTokenizerStep& step : tokenizer.pre_tokenizer().steps()) {
    if (step.kind == Kind::kByteLevel && !step.add_prefix_space && !step.splitter) continue;
    ++cutting;
    one_pattern =
        one_pattern && ((step.kind == Kind::kSplit && step.behavior == SplitBehavior::kIsolated) ||
                        (step.kind == Kind::kByteLevel && !step.add_prefix_space));
  }
  POLLEN_CHECK(cutting <= 1 && one_pattern,
               "this tokenizer's pre-tokenizer is not one pattern whose matches are the pieces "
               "(a Split that isolates them, or ByteLevel without a prefix space), so as a "
               "tiktoken rank file it would encode differently");
  for (const AddedToken& t : tokenizer.added_tokens())
    POLLEN_CHECK(t.special, "added token '", t.content, "' (id ", t.id,
                 ") is not special, and a tiktoken rank file has no place for it");
  if (model.options().rule == MergeRule::kMergeList) {
    const Vocab& vocab = model.vocab();
    for (const Merge& m : model.merges()) {
      uint32_t made = *vocab.find(cat(vocab.bytes(m.left), vocab.bytes(m.right)));
      POLLEN_CHECK(made > m.left && made > m.right,
                   "this tokenizer's ids do not follow its merge order (token ", made,
                   "), so as a tiktoken rank file it would encode differently");
    }
    check_ids_follow_merge_order(model);
    if (!model.options().ignore_merges) check_tokens_encode_as_themselves(tokenizer);
    check_merges_are_tiktokens(tokenizer);
  }
  std::string out;
  const Vocab& vocab = model.vocab();
  for (uint32_t id = 0; id < vocab.id_end(); ++id) {
    bool special = false;
    for (const AddedToken& t : tokenizer.added_tokens()) special |= t.id == id;
    if (!vocab.contains(id) || special) continue;
    out += cat(base64_encode(vocab.bytes(id)), " ", id, "\n");
  }
  return out;
}

void save_tiktoken(const Tokenizer& tokenizer, const std::filesystem::path& path) {
  write_file_atomic(path, tiktoken_text(tokenizer));
}

}  // namespace pollen::tokenizer
