// Reading HF tokenizer.json into a Tokenizer.
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "base/log.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/hf_format.h"

namespace pollen::tokenizer {
namespace {

using nlohmann::json;

// Reads keys with errors that say which file and which key was wrong.
class Reader {
 public:
  explicit Reader(std::string_view source) : source_(source) {}

  [[noreturn]] void fail_at(const std::string& key, const std::string& what) const {
    fail(source_, ": ", key, ": ", what);
  }

  const json& at(const json& obj, const std::string& key, const std::string& where) const {
    if (!obj.is_object() || !obj.contains(key)) fail_at(where + "." + key, "missing");
    return obj.at(key);
  }

  template <typename T>
  T get(const json& obj, const std::string& key, const std::string& where, T fallback) const {
    if (!obj.is_object() || !obj.contains(key) || obj.at(key).is_null()) return fallback;
    try {
      return obj.at(key).get<T>();
    } catch (const json::exception&) {
      fail_at(where + "." + key, cat("has the wrong type (", obj.at(key).type_name(), ")"));
    }
  }

  const json& list(const json& obj, const std::string& key, const std::string& where) const {
    const json& v = at(obj, key, where);
    if (!v.is_array()) fail_at(where + "." + key, cat("expected a list, got ", v.type_name()));
    return v;
  }

  std::string text(const json& v, const std::string& where) const {
    if (!v.is_string()) fail_at(where, cat("expected a string, got ", v.type_name()));
    return v.get<std::string>();
  }

  // A token id: an integer below id_limit (see token_id_limit: a larger one would only make
  // the vocabulary a table of empty entries).
  uint32_t token_id(const json& v, const std::string& where) const {
    if (!v.is_number_unsigned() || v.get<uint64_t>() >= id_limit_)
      fail_at(where, cat("expected a token id, an integer below ", id_limit_, " (the file's ",
                         tokens_, " tokens plus ", kMaxIdsPastTokens, "), got ", v.dump()));
    return v.get<uint32_t>();
  }

  // How many tokens the file holds (the vocabulary's and the added ones), and so its ids' limit.
  void set_token_count(uint64_t count) {
    tokens_ = count;
    id_limit_ = token_id_limit(count);
  }

  std::string type_of(const json& obj, const std::string& where) const {
    std::string type = get<std::string>(obj, "type", where, "");
    if (type.empty()) fail_at(where + ".type", "missing");
    return type;
  }

 private:
  std::string source_;
  uint64_t tokens_ = 0;
  uint32_t id_limit_ = kMaxTokenId;
};

bool mentions_byte_level(const json& node) {
  if (node.is_object()) {
    if (node.contains("type") && node["type"] == "ByteLevel") return true;
    for (const auto& [k, v] : node.items())
      if (mentions_byte_level(v)) return true;
  } else if (node.is_array()) {
    for (const auto& v : node)
      if (mentions_byte_level(v)) return true;
  }
  return false;
}

void read_normalizer(const Reader& r, const json& node, const std::string& where,
                     std::vector<NormalizerStep>& steps) {
  if (node.is_null()) return;
  std::string type = r.type_of(node, where);
  using Kind = NormalizerStep::Kind;
  if (type == "Sequence") {
    const json& list = r.list(node, "normalizers", where);
    for (size_t i = 0; i < list.size(); ++i)
      read_normalizer(r, list[i], cat(where, ".normalizers[", i, "]"), steps);
  } else if (type == "NFC") {
    steps.push_back({Kind::kNfc, "", ""});
  } else if (type == "NFKC") {
    steps.push_back({Kind::kNfkc, "", ""});
  } else if (type == "Prepend") {
    steps.push_back({Kind::kPrepend, "", r.get<std::string>(node, "prepend", where, "")});
  } else if (type == "Replace") {
    const json& pattern = r.at(node, "pattern", where);
    if (!pattern.contains("String"))
      r.fail_at(where + ".pattern", "only a String pattern is supported in Replace");
    steps.push_back({Kind::kReplace, r.text(pattern["String"], where + ".pattern.String"),
                     r.get<std::string>(node, "content", where, "")});
  } else {
    r.fail_at(where + ".type", cat("normalizer '", type, "' is not supported"));
  }
}

SplitBehavior read_behavior(const Reader& r, const json& node, const std::string& where) {
  static const std::map<std::string, SplitBehavior> names = {
      {"Isolated", SplitBehavior::kIsolated},
      {"Removed", SplitBehavior::kRemoved},
      {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
      {"MergedWithNext", SplitBehavior::kMergedWithNext},
      {"Contiguous", SplitBehavior::kContiguous}};
  std::string name = r.get<std::string>(node, "behavior", where, "Isolated");
  auto it = names.find(name);
  if (it == names.end()) r.fail_at(where + ".behavior", cat("unknown behavior '", name, "'"));
  return it->second;
}

void read_pre_tokenizer(const Reader& r, const json& node, const std::string& where,
                        std::vector<PreTokenizerStep>& steps) {
  if (node.is_null()) return;
  std::string type = r.type_of(node, where);
  if (type == "Sequence") {
    const json& list = r.list(node, "pretokenizers", where);
    for (size_t i = 0; i < list.size(); ++i)
      read_pre_tokenizer(r, list[i], cat(where, ".pretokenizers[", i, "]"), steps);
  } else if (type == "Split") {
    if (r.get<bool>(node, "invert", where, false))
      r.fail_at(where + ".invert", "inverted Split is not supported");
    const json& pattern = r.at(node, "pattern", where);
    if (!pattern.contains("Regex") && !pattern.contains("String"))
      r.fail_at(where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    const SplitBehavior behavior = read_behavior(r, node, where);  // names its own key
    try {
      steps.push_back(pattern.contains("Regex")
                          ? PreTokenizerStep::split_on(
                                r.text(pattern["Regex"], where + ".pattern.Regex"), behavior)
                          : PreTokenizerStep::split_on_text(
                                r.text(pattern["String"], where + ".pattern.String"), behavior));
    } catch (const Error& e) {
      r.fail_at(where + ".pattern", e.what());
    }
  } else if (type == "ByteLevel") {
    bool prefix = r.get<bool>(node, "add_prefix_space", where, true);
    bool regex = r.get<bool>(node, "use_regex", where, true);
    if (prefix || regex) steps.push_back(PreTokenizerStep::byte_level(prefix, regex));
  } else if (type == "Digits") {
    steps.push_back(PreTokenizerStep::digits(r.get<bool>(node, "individual_digits", where, false)));
  } else if (type == "Metaspace") {
    std::string scheme_name = r.get<std::string>(node, "prepend_scheme", where, "");
    PrependScheme scheme = PrependScheme::kAlways;
    if (scheme_name.empty()) {
      if (!r.get<bool>(node, "add_prefix_space", where, true)) scheme = PrependScheme::kNever;
    } else if (scheme_name == "first") {
      scheme = PrependScheme::kFirst;
    } else if (scheme_name == "never") {
      scheme = PrependScheme::kNever;
    } else if (scheme_name != "always") {
      r.fail_at(where + ".prepend_scheme", cat("unknown prepend scheme '", scheme_name, "'"));
    }
    steps.push_back(
        PreTokenizerStep::metaspace(r.get<std::string>(node, "replacement", where, "\u2581"),
                                    scheme, r.get<bool>(node, "split", where, true)));
  } else {
    r.fail_at(where + ".type", cat("pre-tokenizer '", type, "' is not supported"));
  }
}

// `fused`: whether a decoder before this one joined the tokens into one text (Fuse, ByteLevel),
// after which Strip strips the text's start rather than each token's.
void read_decoder(const Reader& r, const json& node, const std::string& where, DecoderSpec& decoder,
                  bool& fused) {
  if (node.is_null()) return;
  std::string type = r.type_of(node, where);
  if (type == "Sequence") {
    const json& list = r.list(node, "decoders", where);
    for (size_t i = 0; i < list.size(); ++i)
      read_decoder(r, list[i], cat(where, ".decoders[", i, "]"), decoder, fused);
  } else if (type == "Replace") {
    const json& pattern = r.at(node, "pattern", where);
    if (!pattern.contains("String") || r.get<std::string>(node, "content", where, "") != " ")
      r.fail_at(where, "only Replace(String marker -> \" \") is supported in a decoder");
    decoder.space_marker = r.text(pattern["String"], where + ".pattern.String");
  } else if (type == "Metaspace") {
    decoder.space_marker = r.get<std::string>(node, "replacement", where, "\u2581");
    // As HF does: with a scheme that prepends, every marker of the first token is dropped.
    decoder.drop_markers_in_first_token =
        r.get<std::string>(node, "prepend_scheme", where, "always") != "never" &&
        r.get<bool>(node, "add_prefix_space", where, true);
  } else if (type == "ByteFallback") {
    decoder.byte_fallback = true;
  } else if (type == "Strip") {
    if (r.get<std::string>(node, "content", where, " ") != " " ||
        r.get<int>(node, "stop", where, 0) != 0)
      r.fail_at(where, "only Strip of leading spaces is supported");
    decoder.strip_leading_spaces = r.get<int>(node, "start", where, 0);
    if (decoder.strip_leading_spaces > 0 && !fused)
      r.fail_at(where,
                "only Strip after Fuse (of the whole text's start) is supported; before it "
                "HF strips every token");
  } else if (type == "ByteLevel" || type == "Fuse") {
    fused = true;
  } else {
    r.fail_at(where + ".type", cat("decoder '", type, "' is not supported"));
  }
}

// Whether a match of the normalized token `normalized` can begin at or before one of `other`
// and overlap it: it holds `other`, or an end of it is a start of `other`. Where HF matches
// `other` first (not normalized), pollen's one leftmost-longest pass would take `normalized`.
bool can_cover(std::string_view normalized, std::string_view other) {
  if (normalized.empty() || other.empty()) return false;
  if (normalized.find(other) != std::string_view::npos) return true;
  for (size_t n = 1; n < std::min(normalized.size(), other.size()); ++n)
    if (normalized.substr(normalized.size() - n) == other.substr(0, n)) return true;
  return false;
}

void read_template(const Reader& r, const json& node, const std::string& where,
                   BosEosTemplate& bos_eos) {
  if (node.is_null()) return;
  std::string type = r.type_of(node, where);
  if (type == "Sequence") {
    const json& list = r.list(node, "processors", where);
    for (size_t i = 0; i < list.size(); ++i)
      read_template(r, list[i], cat(where, ".processors[", i, "]"), bos_eos);
  } else if (type == "TemplateProcessing") {
    const json& specials = r.at(node, "special_tokens", where);
    bool before = true;
    const json& single = r.list(node, "single", where);
    for (size_t i = 0; i < single.size(); ++i) {
      const json& item = single[i];
      if (item.contains("Sequence")) {
        before = false;
        continue;
      }
      std::string item_where = cat(where, ".single[", i, "]");
      std::string name = r.text(r.at(r.at(item, "SpecialToken", item_where), "id", item_where),
                                item_where + ".SpecialToken.id");
      const std::string ids_where = where + ".special_tokens." + name;
      const json& ids = r.list(r.at(specials, name, where + ".special_tokens"), "ids", ids_where);
      for (const json& id : ids)
        (before ? bos_eos.prefix : bos_eos.suffix).push_back(r.token_id(id, ids_where + ".ids"));
    }
  } else if (type != "ByteLevel") {
    r.fail_at(where + ".type", cat("post-processor '", type, "' is not supported"));
  }
}

// HF tokenizers numbers the added tokens itself, not by their "id": the id of the content in
// model.vocab, else the next id past the vocabulary's entries and the added tokens before it (it
// warns where the written id differs). A file whose ids differ would give other ids than HF's
// (and one id two texts): refused, naming the id HF gives.
void check_added_token_ids(const Reader& r, size_t vocab_entries,
                           const std::map<std::string, uint32_t>& vocab_ids,
                           const std::vector<AddedToken>& added) {
  std::set<std::string> seen;  // a content given twice is refused when the tokenizer is built
  std::optional<uint32_t> highest;
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& t = added[i];
    if (!seen.insert(t.content).second) continue;
    const auto in_vocab = vocab_ids.find(t.content);
    const uint32_t next = static_cast<uint32_t>(vocab_entries);
    const uint32_t id = in_vocab != vocab_ids.end() ? in_vocab->second
                        : highest                   ? std::max(next, *highest + 1)
                                                    : next;
    if (id != t.id)
      r.fail_at(cat("added_tokens[", i, "].id"),
                cat("expected ", id, " for '", t.content, "', ",
                    in_vocab != vocab_ids.end() ? "its id in model.vocab"
                                                : "the next id past the vocabulary",
                    " (HF tokenizers numbers added tokens so), got ", t.id));
    highest = std::max(highest.value_or(0), id);
  }
}

}  // namespace

Tokenizer hf_from_json_text(std::string_view text, std::string_view source) {
  Reader r(source);
  json root;
  check_json_depth(text, source);
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail(source, ": not valid JSON: ", e.what());
  }
  if (!root.is_object()) fail(source, ": expected a JSON object at the top");
  // Another JSON file (a GPT-2 encoder.json, a config.json) has no "model" object: said so before
  // any of its keys is taken for a tokenizer's.
  if (!root.contains("model") || !root["model"].is_object())
    fail(source, ": not an HF tokenizer.json: it has no \"model\" object (a vocabulary alone, ",
         "such as GPT-2's encoder.json, or a model's config.json?)");
  // What HF applies to a call's output, not to what a text encodes to: pollen encodes whole texts
  // (the data loader cuts windows, batches are padded where they are built).
  for (const char* key : {"truncation", "padding"})
    if (root.contains(key) && !root[key].is_null())
      log::warn(source, ": '", key, "' is set (", root[key].dump(),
                "); pollen does not apply it: texts are encoded whole");
  const json& model = r.at(root, "model", "");
  std::string model_type = r.get<std::string>(model, "type", "model", "BPE");
  if (model_type != "BPE") r.fail_at("model.type", cat("'", model_type, "' is not BPE"));
  if (r.get<double>(model, "dropout", "model", 0.0) != 0.0)
    r.fail_at("model.dropout", "BPE dropout is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!r.get<std::string>(model, key, "model", "").empty())
      r.fail_at(cat("model.", key), "is not supported");
  const json* vocab_entries = model.contains("vocab") ? &model["vocab"] : nullptr;
  const json* added_entries = root.contains("added_tokens") ? &root["added_tokens"] : nullptr;
  r.set_token_count((vocab_entries && vocab_entries->is_object() ? vocab_entries->size() : 0) +
                    (added_entries && added_entries->is_array() ? added_entries->size() : 0));

  bool byte_level = mentions_byte_level(root.value("pre_tokenizer", json())) ||
                    mentions_byte_level(root.value("decoder", json()));
  auto token_bytes = [&](const std::string& token, const std::string& where) {
    if (!byte_level) return token;
    auto bytes = byte_level_to_bytes(token);
    if (!bytes) r.fail_at(where, cat("token '", token, "' is not in GPT-2's byte-level alphabet"));
    return *bytes;
  };

  std::vector<AddedToken> added;
  std::optional<size_t> first_normalized;  // the first added token with "normalized": true
  std::vector<bool> normalized;            // of each added token
  const json& added_json =
      root.contains("added_tokens") ? r.list(root, "added_tokens", "") : json::array();
  for (size_t i = 0; i < added_json.size(); ++i) {
    const json& t = added_json[i];
    std::string where = cat("added_tokens[", i, "]");
    for (const char* flag : {"single_word", "lstrip", "rstrip"})
      if (r.get<bool>(t, flag, where, false))
        r.fail_at(cat(where, ".", flag), "added-token flag is not supported");
    normalized.push_back(r.get<bool>(t, "normalized", where, false));
    if (normalized.back() && !first_normalized) first_normalized = i;
    added.push_back({r.token_id(r.at(t, "id", where), where + ".id"),
                     r.text(r.at(t, "content", where), where + ".content"),
                     r.get<bool>(t, "special", where, false)});
  }

  // HF matches the added tokens that are not normalized first, then the normalized ones in the
  // text between them; pollen matches all of them in one pass (leftmost, longest), which gives
  // the same pieces unless a normalized token can begin at or before one that is not and
  // overlap it.
  for (size_t i = 0; i < added.size(); ++i)
    for (size_t j = 0; j < added.size(); ++j)
      if (!normalized[i] && normalized[j] && can_cover(added[j].content, added[i].content))
        r.fail_at(cat("added_tokens[", j, "].normalized"),
                  cat("'", added[j].content, "' (normalized) can overlap '", added[i].content,
                      "' (added_tokens[", i,
                      "], not normalized) from its start or before, where HF matches the latter "
                      "first: pollen matches both kinds in one pass"));

  const json& vocab_json = r.at(model, "vocab", "model");
  if (!vocab_json.is_object() || vocab_json.empty())
    r.fail_at("model.vocab", "expected a non-empty object of token: id");
  std::set<std::string> added_contents;
  for (const AddedToken& t : added) added_contents.insert(t.content);
  Vocab vocab;
  std::map<std::string, uint32_t> id_of;
  for (const auto& [token, id] : vocab_json.items()) {
    const uint32_t token_id = r.token_id(id, "model.vocab." + token);
    // An added token in the vocabulary is spelled as its content, not in the byte alphabet.
    const bool is_added = added_contents.contains(token);
    try {
      vocab.add(token_id, is_added ? token : token_bytes(token, "model.vocab"));
    } catch (const Error& e) {
      r.fail_at("model.vocab", e.what());
    }
    id_of[token] = token_id;
  }

  check_added_token_ids(r, vocab_json.size(), id_of, added);

  std::vector<Merge> merges;
  const json& merges_json = r.list(model, "merges", "model");
  for (size_t i = 0; i < merges_json.size(); ++i) {
    const json& m = merges_json[i];
    std::string where = cat("model.merges[", i, "]");
    std::string left, right;
    if (m.is_string()) {
      std::string s = m.get<std::string>();
      size_t space = s.find(' ');
      if (space == s.npos || s.find(' ', space + 1) != s.npos)
        r.fail_at(where, cat("'", s, "' is not two tokens separated by one space"));
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0];
      right = m[1];
    } else {
      r.fail_at(where, "expected \"a b\" or [\"a\", \"b\"]");
    }
    auto l = id_of.find(left), rt = id_of.find(right);
    if (l == id_of.end() || rt == id_of.end())
      r.fail_at(where, cat("'", left, "' or '", right, "' is not in the vocabulary"));
    merges.push_back({l->second, rt->second});
  }

  BpeOptions options;
  options.rule = MergeRule::kMergeList;
  options.alphabet = byte_level ? Alphabet::kBytes : Alphabet::kChars;
  options.ignore_merges = r.get<bool>(model, "ignore_merges", "model", false);
  options.byte_fallback = r.get<bool>(model, "byte_fallback", "model", false);
  options.fuse_unk = r.get<bool>(model, "fuse_unk", "model", false);
  std::string unk = r.get<std::string>(model, "unk_token", "model", "");
  if (!unk.empty()) {
    auto it = id_of.find(unk);
    if (it == id_of.end()) r.fail_at("model.unk_token", cat("'", unk, "' is not in the vocab"));
    options.unk = it->second;
  }

  std::vector<NormalizerStep> normalizer;
  read_normalizer(r, root.value("normalizer", json()), "normalizer", normalizer);
  // HF matches a normalized added token on the normalized text, against its normalized content
  // (NFKC turns "\uFB01le" into "file"; Llama-2's Prepend and Replace put "\u2581" in it);
  // pollen matches added tokens on the text as written, which would give other ids. Without a
  // normalizer the two are the same.
  if (first_normalized && !normalizer.empty())
    r.fail_at(cat("added_tokens[", *first_normalized, "].normalized"),
              "expected false when the tokenizer has a normalizer (a normalized added token is "
              "matched on the normalized text, which pollen does not support)");
  std::vector<PreTokenizerStep> pre;
  read_pre_tokenizer(r, root.value("pre_tokenizer", json()), "pre_tokenizer", pre);
  DecoderSpec decoder;
  bool fused = false;
  if (root.value("decoder", json()).is_null())
    log::warn(source,
              ": 'decoder' is null; HF then joins the tokens' spellings with spaces, "
              "pollen joins the tokens' bytes");
  read_decoder(r, root.value("decoder", json()), "decoder", decoder, fused);
  BosEosTemplate bos_eos;
  read_template(r, root.value("post_processor", json()), "post_processor", bos_eos);

  try {
    BpeModel bpe(std::move(vocab), std::move(merges), options);
    return Tokenizer(std::move(bpe), Normalizer(std::move(normalizer)),
                     PreTokenizer(std::move(pre)), std::move(added), std::move(bos_eos), decoder);
  } catch (const Error& e) {
    fail(source, ": ", e.what());
  }
}

Tokenizer load_hf_json(const std::filesystem::path& path) {
  return hf_from_json_text(read_file(path), path.string());
}

}  // namespace pollen::tokenizer
