// Tokenizer::fingerprint: SHA-256 over a canonical, length-prefixed serialisation of everything
// that decides which ids a text gets and which bytes ids decode to. File-format details (JSON
// key order, how bytes are spelled, whether merges are listed or implied by ranks) are not in
// it, so a tokenizer has one fingerprint in either format.
#include <algorithm>

#include "base/hash.h"
#include "tokenizer/pattern.h"
#include "tokenizer/tokenizer.h"

namespace pollen::tokenizer {
namespace {

class Canonical {
 public:
  void field(std::string_view bytes) {
    number(bytes.size());
    sha_.update(bytes);
  }
  void number(uint64_t n) {
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(n >> (8 * i));
    sha_.update(le, sizeof le);
  }
  std::string hex() { return sha_.hex_digest(); }

 private:
  Sha256 sha_;
};

// A Split's regex as version 1 spelled it: a literal (tokenizer.json's {"String": ...}) as
// \Q...\E, so that a tokenizer keeps its fingerprint now that literals are escaped otherwise.
std::string fingerprinted_regex(const PreTokenizerStep& step) {
  if (step.literal) return "\\Q" + *literal_of_regex(step.splitter->regex()) + "\\E";
  return step.splitter->regex();
}

}  // namespace

std::string Tokenizer::fingerprint() const {
  Canonical c;
  c.field("pollen-tokenizer-v1");
  const BpeOptions& o = model_.options();
  bool whole_piece_lookup = o.rule == MergeRule::kRankedBytes || o.ignore_merges;
  c.number(o.alphabet == Alphabet::kBytes ? 0 : 1);
  c.number(whole_piece_lookup);
  c.number(o.byte_fallback);
  c.number(o.unk ? uint64_t{*o.unk} + 1 : 0);
  c.number(o.fuse_unk);

  // An added token also listed in the model's vocabulary (as HF writes them) counts once.
  const Vocab& vocab = model_.vocab();
  c.field("vocab");
  for (uint32_t id = 0; id < vocab.id_end(); ++id) {
    if (!vocab.contains(id)) continue;
    const AddedToken* added = added_with_id(id);
    if (added && added->content == vocab.bytes(id)) continue;
    c.number(id);
    c.field(vocab.bytes(id));
  }
  c.field("merges");
  c.number(model_.merges().size());
  for (const Merge& m : model_.merges()) {
    c.number(m.left);
    c.number(m.right);
  }

  c.field("normalizer");
  for (const NormalizerStep& step : normalizer_.steps()) {
    c.number(static_cast<uint64_t>(step.kind));
    c.field(step.pattern);
    c.field(step.content);
  }
  c.field("pre_tokenizer");
  for (const PreTokenizerStep& step : pre_tokenizer_.steps()) {
    c.number(static_cast<uint64_t>(step.kind));
    c.field(step.splitter ? fingerprinted_regex(step) : "");
    c.number(static_cast<uint64_t>(step.behavior));
    c.number(step.add_prefix_space);
    c.number(step.individual_digits);
    c.field(step.replacement);
    c.number(static_cast<uint64_t>(step.prepend_scheme));
    c.number(step.split);
  }

  c.field("added");
  std::vector<AddedToken> added = added_;
  std::sort(added.begin(), added.end(),
            [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  for (const AddedToken& t : added) {
    c.number(t.id);
    c.field(t.content);
    c.number(t.special);
  }
  c.field("template");
  for (const auto* ids : {&bos_eos_.prefix, &bos_eos_.suffix}) {
    c.number(ids->size());
    for (uint32_t id : *ids) c.number(id);
  }
  c.field("decoder");
  c.field(decoder_.space_marker);
  c.number(decoder_.byte_fallback);
  c.number(static_cast<uint64_t>(decoder_.strip_leading_spaces));
  if (decoder_.drop_markers_in_first_token) c.field("drop markers in first token");
  return c.hex();
}

}  // namespace pollen::tokenizer
