// Writing a Tokenizer as HF tokenizer.json.
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/vocab.h"

namespace pollen::tokenizer {
namespace {

using nlohmann::json;

json normalizer_json(const Normalizer& normalizer) {
  json list = json::array();
  for (const NormalizerStep& step : normalizer.steps()) {
    switch (step.kind) {
      case NormalizerStep::Kind::kNfc:
        list.push_back({{"type", "NFC"}});
        break;
      case NormalizerStep::Kind::kNfkc:
        list.push_back({{"type", "NFKC"}});
        break;
      case NormalizerStep::Kind::kPrepend:
        list.push_back({{"type", "Prepend"}, {"prepend", step.content}});
        break;
      case NormalizerStep::Kind::kReplace:
        list.push_back({{"type", "Replace"},
                        {"pattern", {{"String", step.pattern}}},
                        {"content", step.content}});
        break;
    }
  }
  if (list.empty()) return nullptr;
  if (list.size() == 1) return list[0];
  return {{"type", "Sequence"}, {"normalizers", list}};
}

const char* behavior_name(SplitBehavior b) {
  switch (b) {
    case SplitBehavior::kIsolated:
      return "Isolated";
    case SplitBehavior::kRemoved:
      return "Removed";
    case SplitBehavior::kMergedWithPrevious:
      return "MergedWithPrevious";
    case SplitBehavior::kMergedWithNext:
      return "MergedWithNext";
    case SplitBehavior::kContiguous:
      return "Contiguous";
  }
  return "Isolated";
}

const char* scheme_name(PrependScheme s) {
  switch (s) {
    case PrependScheme::kAlways:
      return "always";
    case PrependScheme::kFirst:
      return "first";
    case PrependScheme::kNever:
      return "never";
  }
  return "always";
}

json byte_level_json(bool add_prefix_space, bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", add_prefix_space},
          {"trim_offsets", true},
          {"use_regex", use_regex}};
}

// A Split's pattern: a literal one (tokenizer.json's {"String": ...}, held as literal_regex)
// goes back as the String it was.
json split_pattern_json(const PreTokenizerStep& step) {
  const std::string& regex = step.splitter->regex();
  if (step.literal) return {{"String", *literal_of_regex(regex)}};
  return {{"Regex", regex}};
}

json pre_tokenizer_json(const PreTokenizer& pre, bool byte_level) {
  json list = json::array();
  bool has_byte_level = false;
  for (const PreTokenizerStep& step : pre.steps()) {
    using Kind = PreTokenizerStep::Kind;
    switch (step.kind) {
      case Kind::kSplit:
        list.push_back({{"type", "Split"},
                        {"pattern", split_pattern_json(step)},
                        {"behavior", behavior_name(step.behavior)},
                        {"invert", false}});
        break;
      case Kind::kByteLevel:
        has_byte_level = true;
        list.push_back(byte_level_json(step.add_prefix_space, step.splitter != nullptr));
        break;
      case Kind::kDigits:
        list.push_back({{"type", "Digits"}, {"individual_digits", step.individual_digits}});
        break;
      case Kind::kMetaspace:
        list.push_back({{"type", "Metaspace"},
                        {"replacement", step.replacement},
                        {"prepend_scheme", scheme_name(step.prepend_scheme)},
                        {"split", step.split}});
        break;
    }
  }
  // The ByteLevel step is what maps bytes to HF's byte-level alphabet.
  if (byte_level && !has_byte_level) list.push_back(byte_level_json(false, false));
  if (list.empty()) return nullptr;
  if (list.size() == 1) return list[0];
  return {{"type", "Sequence"}, {"pretokenizers", list}};
}

json decoder_json(const DecoderSpec& d, bool byte_level) {
  if (byte_level) return byte_level_json(true, true);
  json list = json::array();
  if (d.drop_markers_in_first_token)
    list.push_back({{"type", "Metaspace"},
                    {"replacement", d.space_marker},
                    {"prepend_scheme", "always"},
                    {"split", true}});
  else if (!d.space_marker.empty())
    list.push_back(
        {{"type", "Replace"}, {"pattern", {{"String", d.space_marker}}}, {"content", " "}});
  if (d.byte_fallback) list.push_back({{"type", "ByteFallback"}});
  list.push_back({{"type", "Fuse"}});
  if (d.strip_leading_spaces > 0)
    list.push_back(
        {{"type", "Strip"}, {"content", " "}, {"start", d.strip_leading_spaces}, {"stop", 0}});
  return {{"type", "Sequence"}, {"decoders", list}};
}

json template_json(const Tokenizer& tok, const std::function<std::string(uint32_t)>& name_of) {
  const BosEosTemplate& t = tok.bos_eos();
  if (t.prefix.empty() && t.suffix.empty()) return nullptr;
  json single = json::array(), pair = json::array(), specials = json::object();
  auto add_special = [&](uint32_t id, json& seq) {
    std::string name = name_of(id);
    seq.push_back({{"SpecialToken", {{"id", name}, {"type_id", 0}}}});
    specials[name] = {{"id", name}, {"ids", {id}}, {"tokens", {name}}};
  };
  for (uint32_t id : t.prefix) add_special(id, single);
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  for (uint32_t id : t.suffix) add_special(id, single);
  for (const json& item : single) pair.push_back(item);
  for (uint32_t id : t.prefix) add_special(id, pair);
  pair.push_back({{"Sequence", {{"id", "B"}, {"type_id", 1}}}});
  for (uint32_t id : t.suffix) add_special(id, pair);
  return {{"type", "TemplateProcessing"},
          {"single", single},
          {"pair", pair},
          {"special_tokens", specials}};
}

}  // namespace

std::string hf_json_text(const Tokenizer& tok) {
  const BpeModel& model = tok.model();
  const Vocab& vocab = model.vocab();
  bool byte_level = model.options().alphabet == Alphabet::kBytes;
  auto added_content = [&](uint32_t id) -> const std::string* {
    for (const AddedToken& t : tok.added_tokens())
      if (t.id == id) return &t.content;
    return nullptr;
  };
  auto spelled = [&](uint32_t id) {
    std::string_view bytes = vocab.bytes(id);
    const std::string* added = added_content(id);
    if (!byte_level || (added && *added == bytes)) return std::string(bytes);
    return bytes_to_byte_level(bytes);
  };
  auto name_of = [&](uint32_t id) {
    const std::string* added = added_content(id);
    return added ? *added : spelled(id);
  };

  json vocab_json = json::object();
  for (uint32_t id = 0; id < vocab.id_end(); ++id)
    if (vocab.contains(id)) vocab_json[spelled(id)] = id;
  // HF renumbers added tokens that are not in the model's vocabulary; listing them there too
  // (as HF's trainer does) keeps their ids.
  for (const AddedToken& t : tok.added_tokens()) {
    if (vocab.contains(t.id)) continue;
    // One key, two ids: HF would read the file as another tokenizer.
    POLLEN_CHECK(!vocab_json.contains(t.content), "tokenizer.json: added token '", t.content,
                 "' (id ", t.id, ") is spelled like vocabulary token ",
                 vocab_json[t.content].get<uint32_t>(), "; the file cannot hold both");
    vocab_json[t.content] = t.id;
  }
  // Merges as "a b" strings, which every version of HF tokenizers reads (before 0.20 the only
  // form), unless a side holds a space: then as [a, b] pairs, which tokenizers 0.20 and later read.
  bool has_space = false;
  for (const Merge& m : model.merges())
    has_space = has_space || spelled(m.left).find(' ') != std::string::npos ||
                spelled(m.right).find(' ') != std::string::npos;
  json merges = json::array();
  for (const Merge& m : model.merges()) {
    if (has_space)
      merges.push_back({spelled(m.left), spelled(m.right)});
    else
      merges.push_back(spelled(m.left) + " " + spelled(m.right));
  }

  const BpeOptions& o = model.options();
  json bpe = {{"type", "BPE"},
              {"dropout", nullptr},
              {"unk_token", o.unk ? json(spelled(*o.unk)) : json(nullptr)},
              {"continuing_subword_prefix", nullptr},
              {"end_of_word_suffix", nullptr},
              {"fuse_unk", o.fuse_unk},
              {"byte_fallback", o.byte_fallback},
              // tiktoken's rule: a piece that is a token is that token.
              {"ignore_merges", o.ignore_merges || o.rule == MergeRule::kRankedBytes},
              {"vocab", vocab_json},
              {"merges", merges}};

  json added = json::array();
  std::vector<AddedToken> sorted = tok.added_tokens();
  std::sort(sorted.begin(), sorted.end(),
            [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  for (const AddedToken& t : sorted)
    added.push_back({{"id", t.id},
                     {"content", t.content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", t.special}});

  json root = {{"version", "1.0"},
               {"truncation", nullptr},
               {"padding", nullptr},
               {"added_tokens", added},
               {"normalizer", normalizer_json(tok.normalizer())},
               {"pre_tokenizer", pre_tokenizer_json(tok.pre_tokenizer(), byte_level)},
               {"post_processor", template_json(tok, name_of)},
               {"decoder", decoder_json(tok.decoder(), byte_level)},
               {"model", bpe}};
  return root.dump(2) + "\n";
}

void save_hf_json(const Tokenizer& tokenizer, const std::filesystem::path& path) {
  // A tokenizer.json is read with its ids below its tokens plus 65536 (vocab.h): a special token
  // given a rank file far past its ranks would make a file no reader takes.
  const uint64_t tokens = tokenizer.model().vocab().size() + tokenizer.added_tokens().size();
  for (const AddedToken& t : tokenizer.added_tokens())
    POLLEN_CHECK(t.id < token_id_limit(tokens), "cannot write '", path.string(), "': added token '",
                 t.content, "' has id ", t.id, ", and a tokenizer.json's ids are below ",
                 token_id_limit(tokens), " (its ", tokens, " tokens plus ", kMaxIdsPastTokens,
                 "); keep the rank file, or give the token an id past its ranks");
  write_file_atomic(path, hf_json_text(tokenizer));
}

}  // namespace pollen::tokenizer
