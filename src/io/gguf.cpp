#include "io/gguf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string_view>

#include "base/error.h"
#include "base/files.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pattern.h"

namespace pollen::io {
namespace {

constexpr uint32_t kVersion = 3;
constexpr uint64_t kAlignment = 32;
constexpr int64_t kQ8Block = 32;

// gguf value types and ggml tensor types (ggml.h, gguf.md).
enum ValueType : uint32_t { kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9 };
enum TensorType : uint32_t { kTensorF32 = 0, kTensorF16 = 1, kTensorQ8_0 = 8, kTensorBF16 = 30 };
// llama_ftype: what most of the file is stored as.
uint32_t file_type(GgufType t) {
  switch (t) {
    case GgufType::f32:
      return 0;
    case GgufType::f16:
      return 1;
    case GgufType::q8_0:
      return 7;
    case GgufType::bf16:
      return 32;
  }
  POLLEN_ASSERT(false);
}
// llama_token_type.
enum TokenType : int32_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };

uint64_t padded(uint64_t n) {
  return (n + kAlignment - 1) / kAlignment * kAlignment;
}

// The key-value section, built in memory.
class Metadata {
 public:
  void u32(std::string_view key, uint32_t v) { head(key, kU32), raw(v); }
  void f32(std::string_view key, float v) { head(key, kF32), raw(v); }
  void boolean(std::string_view key, bool v) { head(key, kBool), raw(static_cast<uint8_t>(v)); }
  void str(std::string_view key, std::string_view v) { head(key, kString), string(v); }
  void strings(std::string_view key, const std::vector<std::string>& v) {
    head(key, kArray), raw(static_cast<uint32_t>(kString)), raw(static_cast<uint64_t>(v.size()));
    for (const auto& s : v) string(s);
  }
  void i32s(std::string_view key, const std::vector<int32_t>& v) {
    head(key, kArray), raw(static_cast<uint32_t>(kI32)), raw(static_cast<uint64_t>(v.size()));
    bytes_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
  }
  uint64_t count() const { return count_; }
  const std::string& bytes() const { return bytes_; }
  template <typename T>
  void raw(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void string(std::string_view s) { raw(static_cast<uint64_t>(s.size())), bytes_.append(s); }

 private:
  void head(std::string_view key, uint32_t type) { ++count_, string(key), raw(type); }
  std::string bytes_;
  uint64_t count_ = 0;
};

// One tensor to write: its name, shape (row-major, outermost first) and f32 values.
struct Entry {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
  uint32_t type = kTensorF32;
};

std::vector<float> values_of(const ag::Var& v) {
  const Tensor& t = v.value();
  POLLEN_CHECK(t.dtype() == DType::f32, "GGUF export: parameters must be f32, got ",
               dtype_name(t.dtype()));
  return {t.data<float>(), t.data<float>() + t.numel()};
}

// HF's q/k rows per head are [half 0 (D/2 rows), half 1 (D/2 rows)]; llama.cpp rotates adjacent
// pairs, so row (h, j, t) of its layout is row (h, t, j) of HF's (convert_hf_to_gguf.py's
// LlamaModel.permute). `cols` is 1 for biases.
std::vector<float> permute_rotary_rows(const std::vector<float>& w, int64_t heads, int64_t cols) {
  const int64_t rows = static_cast<int64_t>(w.size()) / cols, d = rows / heads, half = d / 2;
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < half; ++j)
      for (int64_t t = 0; t < 2; ++t)
        std::memcpy(&out[static_cast<size_t>((h * d + j * 2 + t) * cols)],
                    &w[static_cast<size_t>((h * d + t * half + j) * cols)], sizeof(float) * cols);
  return out;
}

std::vector<Entry> model_tensors(const model::Llama& model) {
  const model::LlamaConfig& c = model.config();
  std::vector<Entry> out;
  auto add = [&](std::string name, const ag::Var& v, std::vector<float> values = {}) {
    if (!v.defined()) return;
    const Shape& s = v.value().shape();
    out.push_back({std::move(name), std::vector<int64_t>(s.begin(), s.end()),
                   values.empty() ? values_of(v) : std::move(values)});
  };
  add("token_embd.weight", model.embed_tokens());
  const int64_t cols = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  for (size_t l = 0; l < model.layers().size(); ++l) {
    const model::LayerParams& p = model.layers()[l];
    const std::string blk = "blk." + std::to_string(l) + ".";
    add(blk + "attn_norm.weight", p.input_norm);
    add(blk + "attn_q.weight", p.q_proj, permute_rotary_rows(values_of(p.q_proj), nh, cols));
    add(blk + "attn_k.weight", p.k_proj, permute_rotary_rows(values_of(p.k_proj), nkv, cols));
    add(blk + "attn_v.weight", p.v_proj);
    if (p.q_bias.defined()) {
      add(blk + "attn_q.bias", p.q_bias, permute_rotary_rows(values_of(p.q_bias), nh, 1));
      add(blk + "attn_k.bias", p.k_bias, permute_rotary_rows(values_of(p.k_bias), nkv, 1));
      add(blk + "attn_v.bias", p.v_bias);
    }
    add(blk + "attn_output.weight", p.o_proj);
    add(blk + "ffn_norm.weight", p.post_attention_norm);
    add(blk + "ffn_gate.weight", p.gate_proj);
    add(blk + "ffn_up.weight", p.up_proj);
    add(blk + "ffn_down.weight", p.down_proj);
  }
  add("output_norm.weight", model.final_norm());
  if (!c.tie_word_embeddings) add("output.weight", model.output_head());
  return out;
}

// Llama 3.1 scaling as llama.cpp takes it: how much each pair's wavelength is stretched.
Entry rope_freqs(const model::LlamaConfig& c) {
  const int64_t d = c.resolved_head_dim();
  const ops::RopeParams plain(c.rope_theta), scaled = c.rope_params();
  Entry e{"rope_freqs.weight", {d / 2}, {}};
  for (int64_t i = 0; i < d / 2; ++i)
    e.values.push_back(
        static_cast<float>(ops::rope_inv_freq(plain, d, i) / ops::rope_inv_freq(scaled, d, i)));
  return e;
}

uint32_t storage_type(const Entry& e, GgufType t) {
  if (e.shape.size() < 2 || t == GgufType::f32) return kTensorF32;
  if (t == GgufType::f16) return kTensorF16;
  if (t == GgufType::bf16) return kTensorBF16;
  return e.shape.back() % kQ8Block == 0 ? kTensorQ8_0 : kTensorF16;
}

std::string encode(const Entry& e) {
  switch (e.type) {
    case kTensorF32:
      return {reinterpret_cast<const char*>(e.values.data()), e.values.size() * sizeof(float)};
    case kTensorF16:
    case kTensorBF16: {
      std::string out(e.values.size() * 2, '\0');
      for (size_t i = 0; i < e.values.size(); ++i) {
        const uint16_t bits = e.type == kTensorF16 ? f16::from_float(e.values[i]).bits
                                                   : bf16::from_float(e.values[i]).bits;
        std::memcpy(&out[i * 2], &bits, 2);
      }
      return out;
    }
    case kTensorQ8_0:
      return quantize_q8_0(e.values);
  }
  POLLEN_ASSERT(false);
}

uint64_t encoded_size(const Entry& e) {
  const uint64_t n = e.values.size();
  return e.type == kTensorF32 ? n * 4 : e.type == kTensorQ8_0 ? n / kQ8Block * 34 : n * 2;
}

std::string llama_cpp_pre_name(tokenizer::KnownPattern pattern) {
  switch (pattern) {
    case tokenizer::KnownPattern::kGpt2:
      return "gpt-2";
    case tokenizer::KnownPattern::kCl100k:
      return "llama-bpe";  // Llama 3's split, which is cl100k_base's
    case tokenizer::KnownPattern::kO200k:
      return "gpt-4o";
    case tokenizer::KnownPattern::kQwen2:
      return "qwen2";
  }
  POLLEN_ASSERT(false);
}

// A pre-tokenizer step as tokenizer.json writes it, for errors.
std::string step_text(const tokenizer::PreTokenizerStep& step, size_t index) {
  using Kind = tokenizer::PreTokenizerStep::Kind;
  const std::string at = cat("pre-tokenizer step ", index + 1, " (");
  switch (step.kind) {
    case Kind::kSplit:
      return cat(at, "Split on '", step.splitter->regex(), "')");
    case Kind::kByteLevel:
      return cat(at, "ByteLevel, add_prefix_space ", step.add_prefix_space ? "true" : "false",
                 ", use_regex ", step.splitter ? "true" : "false", ")");
    case Kind::kDigits:
      return cat(at, "Digits, individual_digits ", step.individual_digits ? "true" : "false", ")");
    case Kind::kMetaspace:
      return cat(at, "Metaspace)");
  }
  POLLEN_ASSERT(false);
}

// The one regex that splits the text, when that is all the pre-tokenizer does: a Split step
// that isolates its matches, or GPT-2's ByteLevel step with use_regex, and no other step.
std::string single_split_regex(const tokenizer::PreTokenizer& pre) {
  using Kind = tokenizer::PreTokenizerStep::Kind;
  std::string regex;
  for (size_t i = 0; i < pre.steps().size(); ++i) {
    const tokenizer::PreTokenizerStep& step = pre.steps()[i];
    const bool byte_level = step.kind == Kind::kByteLevel && !step.add_prefix_space;
    if (byte_level && !step.splitter) continue;  // maps bytes to the alphabet, splits nothing
    const bool plain_split =
        step.kind == Kind::kSplit && step.behavior == tokenizer::SplitBehavior::kIsolated;
    const bool gpt2_split = byte_level && step.splitter != nullptr;
    POLLEN_CHECK((plain_split || gpt2_split) && regex.empty(), "GGUF export: the tokenizer's ",
                 step_text(step, i),
                 " has no equivalent in llama.cpp, whose pre-tokenizers split the text with one "
                 "regex and nothing else: llama.cpp would tokenize text differently");
    if (step.splitter) regex = step.splitter->regex();
  }
  POLLEN_CHECK(!regex.empty(),
               "GGUF export: the tokenizer's pre-tokenizer does not split the "
               "text, which no llama.cpp pre-tokenizer reproduces");
  return regex;
}

// The normalizer's steps as tokenizer.json names them ("NFC, Replace"), for errors.
std::string normalizer_text(const tokenizer::Normalizer& n) {
  using Kind = tokenizer::NormalizerStep::Kind;
  std::string text;
  for (const tokenizer::NormalizerStep& step : n.steps()) {
    text += text.empty() ? "" : ", ";
    text += step.kind == Kind::kNfc       ? "NFC"
            : step.kind == Kind::kNfkc    ? "NFKC"
            : step.kind == Kind::kPrepend ? "Prepend"
                                          : "Replace";
  }
  return text;
}

// Qwen2's tokenizer.json normalizes to NFC before its split; llama.cpp's "qwen2" stands for
// that tokenizer (convert_hf_to_gguf.py names it so), though llama.cpp itself does not normalize.
bool normalizer_matches(const tokenizer::Normalizer& n, tokenizer::KnownPattern pattern) {
  if (n.empty()) return true;
  return pattern == tokenizer::KnownPattern::kQwen2 && n.steps().size() == 1 &&
         n.steps()[0].kind == tokenizer::NormalizerStep::Kind::kNfc;
}

// llama.cpp's name for the pre-tokenizer (tokenizer.ggml.pre). llama.cpp reproduces a
// pre-tokenization only when the whole pipeline is one it knows: a single split with a known
// regex and nothing else (no Digits step, no second split, no ByteLevel add_prefix_space, no
// normalizer). Anything else is refused naming the step, rather than labelled with a name under
// which llama.cpp would tokenize differently.
std::string pre_tokenizer_name(const tokenizer::Tokenizer& tok) {
  const std::string regex = single_split_regex(tok.pre_tokenizer());
  const auto known = tokenizer::recognise_pattern(regex);
  POLLEN_CHECK(known.has_value(), "GGUF export: the tokenizer's split pattern '", regex,
               "' is none that llama.cpp knows (GPT-2's, cl100k_base's as in Llama 3, ",
               "o200k_base's or Qwen2's): llama.cpp would tokenize text differently");
  const tokenizer::Normalizer& n = tok.normalizer();
  POLLEN_CHECK(normalizer_matches(n, *known), "GGUF export: the tokenizer's normalizer (",
               normalizer_text(n), ") has no equivalent in llama.cpp's '",
               llama_cpp_pre_name(*known),
               "' pre-tokenizer: llama.cpp would tokenize text differently");
  return llama_cpp_pre_name(*known);
}

void tokenizer_keys(Metadata& m, const tokenizer::Tokenizer& tok, int64_t vocab_size,
                    const GgufExportOptions& o, std::string& pre) {
  POLLEN_CHECK(tok.decoder().space_marker.empty(),
               "GGUF export: the tokenizer is SentencePiece-style BPE; pollen writes byte-level "
               "BPE tokenizers only (tokenizer.ggml.model gpt2)");
  POLLEN_CHECK(tok.vocab_size() <= vocab_size, "GGUF export: the tokenizer has ", tok.vocab_size(),
               " ids, more than the model's vocab_size of ", vocab_size);
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int64_t id = 0; id < vocab_size; ++id) {
    const uint32_t u = static_cast<uint32_t>(id);
    const auto added = std::find_if(tok.added_tokens().begin(), tok.added_tokens().end(),
                                    [&](const auto& t) { return t.id == u; });
    if (added != tok.added_tokens().end()) {
      tokens.push_back(added->content);
      types.push_back(added->special ? kControl : kUserDefined);
    } else if (tok.model().vocab().contains(u)) {
      tokens.push_back(tokenizer::bytes_to_byte_level(tok.token_bytes(u)));
      types.push_back(kNormal);
    } else {  // ids the tokenizer does not use, as convert_hf_to_gguf.py names them
      tokens.push_back("[PAD" + std::to_string(id) + "]");
      types.push_back(kUnused);
    }
  }
  std::vector<std::string> merges;
  for (const tokenizer::Merge& mg : tok.model().merges())
    merges.push_back(tokenizer::bytes_to_byte_level(tok.token_bytes(mg.left)) + " " +
                     tokenizer::bytes_to_byte_level(tok.token_bytes(mg.right)));
  m.str("tokenizer.ggml.model", "gpt2");
  pre = pre_tokenizer_name(tok);
  m.str("tokenizer.ggml.pre", pre);
  m.strings("tokenizer.ggml.tokens", tokens);
  m.i32s("tokenizer.ggml.token_type", types);
  m.strings("tokenizer.ggml.merges", merges);
  if (o.bos_token_id) m.u32("tokenizer.ggml.bos_token_id", *o.bos_token_id);
  if (o.eos_token_id) m.u32("tokenizer.ggml.eos_token_id", *o.eos_token_id);
  m.boolean("tokenizer.ggml.add_bos_token", !tok.bos_eos().prefix.empty());
  if (o.chat_template) m.str("tokenizer.chat_template", *o.chat_template);
}

void architecture_keys(Metadata& m, const model::LlamaConfig& c, GgufType type) {
  using Kind = ops::RopeScaling::Kind;
  POLLEN_CHECK(c.sliding_window == 0, "GGUF export: the model has a sliding window of ",
               c.sliding_window, " tokens, which llama.cpp's llama architecture does not have");
  const auto& s = c.rope_scaling;
  POLLEN_CHECK(s.kind != Kind::dynamic,
               "GGUF export: rope_scaling 'dynamic' has no llama.cpp equivalent");
  POLLEN_CHECK(s.kind != Kind::yarn || (s.beta_fast == 32 && s.beta_slow == 1 &&
                                        s.attention_factor == 0.1 * std::log(s.factor) + 1.0),
               "GGUF export: yarn rope_scaling with its own beta_fast, beta_slow or "
               "attention_factor is not written (llama.cpp derives them)");
  m.str("general.architecture", "llama");
  m.str("general.name", c.name);
  m.u32("general.alignment", static_cast<uint32_t>(kAlignment));
  m.u32("general.file_type", file_type(type));
  const auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };
  m.u32("llama.context_length", u32(c.max_position_embeddings));
  m.u32("llama.embedding_length", u32(c.hidden_size));
  m.u32("llama.block_count", u32(c.num_hidden_layers));
  m.u32("llama.feed_forward_length", u32(c.intermediate_size));
  m.u32("llama.attention.head_count", u32(c.num_attention_heads));
  m.u32("llama.attention.head_count_kv", u32(c.num_key_value_heads));
  m.u32("llama.rope.dimension_count", u32(c.resolved_head_dim()));
  if (c.resolved_head_dim() * c.num_attention_heads != c.hidden_size) {
    m.u32("llama.attention.key_length", u32(c.resolved_head_dim()));
    m.u32("llama.attention.value_length", u32(c.resolved_head_dim()));
  }
  m.f32("llama.rope.freq_base", static_cast<float>(c.rope_theta));
  m.f32("llama.attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  m.u32("llama.vocab_size", u32(c.vocab_size));
  if (s.kind == Kind::linear || s.kind == Kind::yarn) {
    m.str("llama.rope.scaling.type", s.kind == Kind::linear ? "linear" : "yarn");
    m.f32("llama.rope.scaling.factor", static_cast<float>(s.factor));
  }
  if (s.kind == Kind::yarn)
    m.u32("llama.rope.scaling.original_context_length", u32(s.original_max_position_embeddings));
}

}  // namespace

GgufType gguf_type_named(std::string_view name) {
  if (name == "f32") return GgufType::f32;
  if (name == "f16") return GgufType::f16;
  if (name == "bf16") return GgufType::bf16;
  if (name == "q8_0") return GgufType::q8_0;
  fail("unknown GGUF type '", name, "': expected f32, f16, bf16 or q8_0");
}

std::string quantize_q8_0(std::span<const float> values) {
  POLLEN_CHECK(values.size() % kQ8Block == 0, "q8_0: ", values.size(),
               " values are not a whole number of blocks of 32");
  std::string out;
  out.reserve(values.size() / kQ8Block * 34);
  for (size_t b = 0; b < values.size(); b += kQ8Block) {
    float amax = 0;
    for (int64_t j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::abs(values[b + j]));
    const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    const uint16_t scale = f16::from_float(d).bits;
    out.append(reinterpret_cast<const char*>(&scale), 2);
    for (int64_t j = 0; j < kQ8Block; ++j)
      out.push_back(static_cast<char>(static_cast<int8_t>(std::round(values[b + j] * id))));
  }
  return out;
}

void check_gguf_output(const std::filesystem::path& file) {
  if (!std::filesystem::exists(file)) return;
  POLLEN_CHECK(std::filesystem::is_regular_file(file), "GGUF output '", file.string(),
               "' exists and is not a file");
  if (std::filesystem::file_size(file) == 0) return;  // made to be written (mktemp, touch)
  std::ifstream in(file, std::ios::binary);
  char magic[4] = {};
  in.read(magic, sizeof magic);
  POLLEN_CHECK(in && std::string_view(magic, 4) == "GGUF", "GGUF output '", file.string(),
               "' exists and is not a GGUF file; an export replaces only an earlier GGUF file "
               "(remove it or choose another path)");
}

GgufExportResult export_gguf(const model::Llama& model, const tokenizer::Tokenizer& tok,
                             const std::filesystem::path& file, const GgufExportOptions& o) {
  check_gguf_output(file);
  const model::LlamaConfig& c = model.config();
  GgufExportResult result;
  Metadata meta;
  architecture_keys(meta, c, o.type);
  tokenizer_keys(meta, tok, c.vocab_size, o, result.pre_tokenizer);

  std::vector<Entry> tensors = model_tensors(model);
  if (c.rope_scaling.kind == ops::RopeScaling::Kind::llama3) tensors.push_back(rope_freqs(c));
  Metadata infos;  // the tensor-info section, written with the same encoders
  uint64_t offset = 0;
  for (Entry& e : tensors) {
    e.type = storage_type(e, o.type);
    infos.string(e.name);
    infos.raw(static_cast<uint32_t>(e.shape.size()));
    for (auto it = e.shape.rbegin(); it != e.shape.rend(); ++it)
      infos.raw(static_cast<uint64_t>(*it));
    infos.raw(e.type);
    infos.raw(offset);
    offset = padded(offset + encoded_size(e));
  }
  Metadata header;
  header.raw(static_cast<uint32_t>(0x46554747));  // "GGUF"
  header.raw(kVersion);
  header.raw(static_cast<uint64_t>(tensors.size()));
  header.raw(meta.count());
  std::string head = header.bytes() + meta.bytes() + infos.bytes();
  head.resize(padded(head.size()), '\0');

  // One tensor encoded at a time, into a temporary file renamed over `file` once synced; a killed
  // export's temporary file, as large, is removed first.
  remove_dead_writers_files(file);
  write_file_atomic_by(file, [&](const FileSink& write) {
    write(head);
    for (const Entry& e : tensors) {
      std::string data = encode(e);
      data.resize(padded(data.size()), '\0');
      write(data);
    }
  });
  result.tensors = tensors.size();
  result.bytes = head.size() + offset;
  return result;
}

}  // namespace pollen::io
