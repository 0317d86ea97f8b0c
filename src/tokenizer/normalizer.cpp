#include "tokenizer/normalizer.h"

#include <unicode/normalizer2.h>

#include "base/error.h"
#include "tokenizer/unicode.h"

namespace pollen::tokenizer {
namespace {

std::string nfkc(std::string_view text) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFKCInstance(status);
  POLLEN_CHECK(U_SUCCESS(status) && n, "ICU: cannot load the NFKC normaliser");
  std::string out;
  while (!text.empty()) {
    size_t valid = valid_utf8_prefix(text);
    icu::StringByteSink<std::string> sink(&out);
    n->normalizeUTF8(0, icu::StringPiece(text.data(), static_cast<int32_t>(valid)), sink, nullptr,
                     status);
    POLLEN_CHECK(U_SUCCESS(status), "ICU: NFKC normalisation failed: ", u_errorName(status));
    if (valid < text.size()) out += text[valid++];
    text.remove_prefix(valid);
  }
  return out;
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  if (from.empty()) return std::string(text);
  std::string out;
  for (size_t at; (at = text.find(from)) != std::string_view::npos;) {
    out.append(text.substr(0, at));
    out.append(to);
    text.remove_prefix(at + from.size());
  }
  out.append(text);
  return out;
}

}  // namespace

std::string Normalizer::apply(std::string_view text) const {
  std::string out(text);
  for (const NormalizerStep& step : steps_) {
    switch (step.kind) {
      case NormalizerStep::Kind::kNfc:
        out = nfc(out);
        break;
      case NormalizerStep::Kind::kNfkc:
        out = nfkc(out);
        break;
      case NormalizerStep::Kind::kPrepend:
        if (!out.empty()) out.insert(0, step.content);
        break;
      case NormalizerStep::Kind::kReplace:
        out = replace_all(out, step.pattern, step.content);
        break;
    }
  }
  return out;
}

}  // namespace pollen::tokenizer
