#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <string_view>
#include <unordered_map>

#include "base/error.h"
#include "base/thread_pool.h"

namespace pollen::tokenizer {

Tokenizer::Tokenizer(BpeModel model, Normalizer normalizer, PreTokenizer pre_tokenizer,
                     std::vector<AddedToken> added, BosEosTemplate bos_eos, DecoderSpec decoder)
    : model_(std::move(model)),
      normalizer_(std::move(normalizer)),
      pre_tokenizer_(std::move(pre_tokenizer)),
      added_(std::move(added)),
      bos_eos_(std::move(bos_eos)),
      decoder_(std::move(decoder)) {
  std::unordered_map<uint32_t, const AddedToken*> by_id;
  std::unordered_map<std::string_view, const AddedToken*> by_content;
  for (const AddedToken& t : added_) {
    POLLEN_CHECK(!t.content.empty(), "added token ", t.id, " has empty content");
    POLLEN_CHECK(t.id < kMaxTokenId, "added token '", t.content, "' has id ", t.id,
                 ", over the largest token id pollen takes (2^24 - 1)");
    const auto [same_id, new_id] = by_id.emplace(t.id, &t);
    POLLEN_CHECK(new_id, "added tokens '", same_id->second->content, "' and '", t.content,
                 "' share id ", t.id);
    const auto [same_content, new_content] = by_content.emplace(t.content, &t);
    POLLEN_CHECK(new_content, "added token '", t.content, "' is given twice (ids ",
                 same_content->second->id, " and ", t.id, ")");
    added_first_byte_[static_cast<unsigned char>(t.content[0])] = true;
  }
  std::stable_sort(added_.begin(), added_.end(), [](const AddedToken& a, const AddedToken& b) {
    return a.content.size() > b.content.size();
  });
  for (uint32_t id : bos_eos_.prefix)
    POLLEN_CHECK(id < vocab_size(), "template id ", id, " unknown");
  for (uint32_t id : bos_eos_.suffix)
    POLLEN_CHECK(id < vocab_size(), "template id ", id, " unknown");
}

uint32_t Tokenizer::vocab_size() const {
  uint32_t n = model_.vocab().id_end();
  for (const AddedToken& t : added_) n = std::max(n, t.id + 1);
  return n;
}

std::string_view Tokenizer::token_bytes(uint32_t id) const {
  if (const AddedToken* added = added_with_id(id)) return added->content;
  POLLEN_CHECK(model_.vocab().contains(id), "token id ", id, " is not in the vocabulary");
  return model_.vocab().bytes(id);
}

const AddedToken* Tokenizer::added_at(std::string_view text, size_t at) const {
  for (const AddedToken& t : added_)
    if (text.substr(at).starts_with(t.content)) return &t;
  return nullptr;
}

void Tokenizer::encode_ordinary(std::string_view text, bool at_start,
                                std::vector<uint32_t>& out) const {
  if (text.empty()) return;
  auto on_piece = [&](std::string_view piece) { model_.encode(piece, out); };
  if (normalizer_.empty()) {
    pre_tokenizer_.run(text, at_start, on_piece);
  } else {
    std::string normalized = normalizer_.apply(text);
    pre_tokenizer_.run(normalized, at_start, on_piece);
  }
}

void Tokenizer::encode(std::string_view text, const EncodeOptions& options,
                       std::vector<uint32_t>& out) const {
  using Others = SpecialPolicy::Others;
  const SpecialPolicy& policy = options.special;
  if (options.add_bos_eos) out.insert(out.end(), bos_eos_.prefix.begin(), bos_eos_.prefix.end());
  size_t done = 0;
  for (size_t at = 0; !added_.empty() && at < text.size(); ++at) {
    if (!added_first_byte_[static_cast<unsigned char>(text[at])]) continue;
    const AddedToken* token = added_at(text, at);
    if (!token) continue;
    bool allowed = !token->special || policy.others == Others::kAllow ||
                   std::find(policy.allowed.begin(), policy.allowed.end(), token->content) !=
                       policy.allowed.end();
    if (!allowed && policy.others == Others::kText) continue;
    POLLEN_CHECK(allowed, "the text contains the special token '", token->content, "' at byte ", at,
                 ", which this encode does not allow (allow it, or encode it as text)");
    encode_ordinary(text.substr(done, at - done), done == 0, out);
    out.push_back(token->id);
    at += token->content.size() - 1;
    done = at + 1;
  }
  encode_ordinary(text.substr(done), done == 0, out);
  if (options.add_bos_eos) out.insert(out.end(), bos_eos_.suffix.begin(), bos_eos_.suffix.end());
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<uint32_t> out;
  encode(text, options, out);
  return out;
}

std::vector<std::vector<uint32_t>> Tokenizer::encode_batch(std::span<const std::string_view> texts,
                                                           const EncodeOptions& options) const {
  std::vector<std::vector<uint32_t>> out(texts.size());
  parallel_for(static_cast<int64_t>(texts.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) encode(texts[i], options, out[i]);
  });
  return out;
}

const AddedToken* Tokenizer::added_with_id(uint32_t id) const {
  for (const AddedToken& t : added_)
    if (t.id == id) return &t;
  return nullptr;
}

void Tokenizer::decode_token(std::string_view bytes, bool first, std::string& out) const {
  // <0xXY> with two hex digits is byte XY; anything else (<0xZZ>) is text, as HF decodes it.
  const auto hex = [](char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
  };
  if (decoder_.byte_fallback && bytes.size() == 6 && bytes.starts_with("<0x") &&
      bytes.ends_with('>') && hex(bytes[3]) >= 0 && hex(bytes[4]) >= 0) {
    out += static_cast<char>(hex(bytes[3]) * 16 + hex(bytes[4]));
    return;
  }
  if (decoder_.space_marker.empty()) {
    out.append(bytes);
    return;
  }
  const std::string_view space = first && decoder_.drop_markers_in_first_token ? "" : " ";
  for (size_t at; (at = bytes.find(decoder_.space_marker)) != std::string_view::npos;) {
    out.append(bytes.substr(0, at));
    out += space;
    bytes.remove_prefix(at + decoder_.space_marker.size());
  }
  out.append(bytes);
}

std::string Tokenizer::decode_continuation(std::span<const uint32_t> ids) const {
  std::string out;
  for (const uint32_t id : ids) decode_token(token_bytes(id), false, out);
  return out;
}

std::string Tokenizer::generated_text(std::span<const uint32_t> ids) const {
  std::string out;
  for (const uint32_t id : ids) {
    const AddedToken* added = added_with_id(id);
    if (!added || !added->special) decode_token(token_bytes(id), false, out);
  }
  return out;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) decode_token(token_bytes(ids[i]), i == 0, out);
  size_t strip = 0;
  while (strip < static_cast<size_t>(decoder_.strip_leading_spaces) && strip < out.size() &&
         out[strip] == ' ')
    ++strip;
  return out.substr(strip);
}

std::string Tokenizer::pattern() const {
  for (const PreTokenizerStep& step : pre_tokenizer_.steps())
    if (step.splitter && step.kind != PreTokenizerStep::Kind::kDigits)
      return step.splitter->regex();
  return "";
}

}  // namespace pollen::tokenizer
