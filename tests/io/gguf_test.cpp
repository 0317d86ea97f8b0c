// GGUF export read back by the `gguf` package (llama.cpp's gguf-py): the llama architecture and
// tokenizer keys, tensor names and shapes, values (q and k un-permuted back to HF's order equal
// the model's weights; q8_0 within its rounding and byte-identical to gguf-py's quantisation),
// and the models GGUF cannot hold refused by name.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <tuple>

#include "base/error.h"
#include "base/files.h"
#include "base/rng.h"
#include "io/gguf.h"
#include "io/hf.h"
#include "io/model_source.h"
#include "support/errors.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"

using pollen::testing::error_of;

namespace fs = std::filesystem;
using namespace pollen;
using nlohmann::json;

namespace {

fs::path temp_dir() {
  fs::path d = fs::temp_directory_path() / ("pollen_gguf_" + std::to_string(getpid()));
  fs::create_directories(d);
  return d;
}

bool gguf_available() {
  static const bool ok =
      fs::exists(POLLEN_PEERS_PYTHON) &&
      std::system((std::string(POLLEN_PEERS_PYTHON) + " -c 'import gguf' 2>/dev/null").c_str()) ==
          0;
  return ok;
}

tokenizer::Tokenizer small_tokenizer() {
  tokenizer::PieceCounts counts(tokenizer::pattern_regex("gpt2"));
  std::vector<std::string> texts = {"hello there, how are you today? caf\u00e9 \u65e5\u672c",
                                    "the quick brown fox jumps over the lazy dog again"};
  std::vector<std::string_view> views(texts.begin(), texts.end());
  counts.add_documents(views);
  return tokenizer::train_bpe(counts, {290, {"<|endoftext|>", "<|im_end|>"}, counts.pattern()});
}

// small_tokenizer with another normalizer and pre-tokenizer, as tokenizer.json writes them.
tokenizer::Tokenizer with_pipeline(const json& normalizer, const json& pre_tokenizer) {
  json j = json::parse(tokenizer::hf_json_text(small_tokenizer()));
  j["normalizer"] = normalizer;
  j["pre_tokenizer"] = pre_tokenizer;
  return tokenizer::hf_from_json_text(j.dump(), "test tokenizer.json");
}

json split_on(tokenizer::KnownPattern pattern) {
  return {{"type", "Split"},
          {"pattern", {{"Regex", std::string(tokenizer::known_pattern_regex(pattern))}}},
          {"behavior", "Isolated"},
          {"invert", false}};
}

json byte_level(bool add_prefix_space, bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", add_prefix_space},
          {"trim_offsets", true},
          {"use_regex", use_regex}};
}

json sequence(const json& steps) {
  return {{"type", "Sequence"}, {"pretokenizers", steps}};
}

// Four ids past the tokenizer's, so that padding entries are written too.
model::Llama random_model(int64_t vocab, bool bias, bool tied) {
  model::LlamaConfig c;
  c.name = "gguf-test";
  c.vocab_size = vocab + 4;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 128;
  c.rope_theta = 500000.0;
  c.rms_norm_eps = 1e-5;
  c.attention_bias = bias;
  c.tie_word_embeddings = tied;
  c.rope_scaling = {ops::RopeScaling::Kind::llama3, 8.0, 1.0, 4.0, 32};
  model::Llama m(c, 3);
  Rng rng(4);
  for (auto& [name, v] : m.named_parameters()) {
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = static_cast<float>((name.ends_with("norm.weight") ? 1.0 : 0.0) + 0.2 * rng.normal());
  }
  return m;
}

json read_back(const fs::path& file, const fs::path& f32_file = {}) {
  const fs::path out = file.string() + ".json";
  const std::string cmd = std::string(POLLEN_PEERS_PYTHON) + " " + POLLEN_SOURCE_DIR +
                          "/tests/io/gguf_reference.py " + file.string() + " " + out.string() +
                          (f32_file.empty() ? "" : " " + f32_file.string());
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("failed: " + cmd);
  return json::parse(read_file(out));
}

// The values llama.cpp's layout gives back in HF's row order (inverse of the q/k permutation).
std::vector<double> unpermute(const std::vector<double>& v, int64_t heads, int64_t cols) {
  const int64_t d = static_cast<int64_t>(v.size()) / cols / heads, half = d / 2;
  std::vector<double> out(v.size());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < half; ++j)
      for (int64_t t = 0; t < 2; ++t)
        for (int64_t c = 0; c < cols; ++c)
          out[static_cast<size_t>((h * d + t * half + j) * cols + c)] =
              v[static_cast<size_t>((h * d + j * 2 + t) * cols + c)];
  return out;
}

// Largest |a - b| over the tensor, and the largest |b|.
std::pair<double, double> compare(const std::vector<double>& a, const ag::Var& b) {
  EXPECT_EQ(a.size(), static_cast<size_t>(b.value().numel()));
  double worst = 0, top = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double w = b.value().data<float>()[i];
    worst = std::max(worst, std::abs(a[i] - w));
    top = std::max(top, std::abs(w));
  }
  return {worst, top};
}

}  // namespace

TEST(Gguf, KeysTensorsAndValuesAsGgufPyReadsThem) {
  if (!gguf_available()) GTEST_SKIP() << "gguf not importable by " << POLLEN_PEERS_PYTHON;
  const fs::path dir = temp_dir();
  const tokenizer::Tokenizer tok = small_tokenizer();
  const model::Llama m = random_model(tok.vocab_size(), true, false);
  const model::LlamaConfig& c = m.config();
  io::GgufExportOptions o;
  o.eos_token_id = 256;
  io::export_gguf(m, tok, dir / "model.gguf", o);
  const json r = read_back(dir / "model.gguf");
  const json& f = r["fields"];

  EXPECT_EQ(f["general.architecture"], "llama");
  EXPECT_EQ(f["general.alignment"], 32);
  EXPECT_EQ(f["general.file_type"], 0);
  EXPECT_EQ(f["llama.context_length"], 128);
  EXPECT_EQ(f["llama.embedding_length"], 64);
  EXPECT_EQ(f["llama.block_count"], 2);
  EXPECT_EQ(f["llama.feed_forward_length"], 96);
  EXPECT_EQ(f["llama.attention.head_count"], 4);
  EXPECT_EQ(f["llama.attention.head_count_kv"], 2);
  EXPECT_EQ(f["llama.rope.dimension_count"], 16);
  EXPECT_EQ(f["llama.rope.freq_base"], 500000.0);
  EXPECT_FLOAT_EQ(f["llama.attention.layer_norm_rms_epsilon"].get<float>(), 1e-5f);
  EXPECT_EQ(f["llama.vocab_size"], c.vocab_size);
  EXPECT_FALSE(f.contains("llama.rope.scaling.type"));  // llama3 scaling is rope_freqs

  EXPECT_EQ(f["tokenizer.ggml.model"], "gpt2");
  EXPECT_EQ(f["tokenizer.ggml.pre"], "gpt-2");
  EXPECT_FALSE(f.contains("tokenizer.chat_template"));
  EXPECT_EQ(f["tokenizer.ggml.eos_token_id"], 256);
  EXPECT_FALSE(f.contains("tokenizer.ggml.bos_token_id"));
  const auto& tokens = f["tokenizer.ggml.tokens"];
  const auto& types = f["tokenizer.ggml.token_type"];
  ASSERT_EQ(tokens.size(), static_cast<size_t>(c.vocab_size));
  ASSERT_EQ(types.size(), tokens.size());
  // Byte-level spelling: a space is 'Ġ' (U+0120).
  size_t with_space = 0;
  for (uint32_t id = 0; id < tok.model().vocab().id_end(); ++id) {
    if (!tok.model().vocab().contains(id)) continue;
    const std::string spelled = tokenizer::bytes_to_byte_level(tok.token_bytes(id));
    EXPECT_EQ(tokens[id], spelled);
    EXPECT_EQ(types[id], 1);
    with_space += spelled.find("\u0120") != std::string::npos;
  }
  EXPECT_GT(with_space, 0u);
  for (const auto& t : tok.added_tokens()) {
    EXPECT_EQ(tokens[t.id], t.content);
    EXPECT_EQ(types[t.id], 3);
  }
  EXPECT_EQ(tokens[c.vocab_size - 1], "[PAD" + std::to_string(c.vocab_size - 1) + "]");
  EXPECT_EQ(types[c.vocab_size - 1], 5);
  const auto& merges = f["tokenizer.ggml.merges"];
  ASSERT_EQ(merges.size(), tok.model().merges().size());
  const auto first = tok.model().merges()[0];
  EXPECT_EQ(merges[0], tokenizer::bytes_to_byte_level(tok.token_bytes(first.left)) + " " +
                           tokenizer::bytes_to_byte_level(tok.token_bytes(first.right)));

  // Every tensor, named as llama.cpp expects, shapes innermost first, offsets aligned.
  const json& t = r["tensors"];
  EXPECT_EQ(t.size(), 2u * 12 + 4);  // 12 per block; embeddings, norm, output, rope_freqs
  for (const auto& [name, info] : t.items()) {
    EXPECT_EQ(info["offset"].get<int64_t>() % 32, 0) << name;
    EXPECT_EQ(info["type"], "F32") << name;
  }
  EXPECT_EQ(t["token_embd.weight"]["shape"], json({64, c.vocab_size}));
  EXPECT_EQ(t["blk.0.attn_q.weight"]["shape"], json({64, 64}));
  EXPECT_EQ(t["blk.0.attn_k.weight"]["shape"], json({64, 32}));
  EXPECT_EQ(t["blk.1.ffn_down.weight"]["shape"], json({96, 64}));
  EXPECT_EQ(t["blk.1.attn_k.bias"]["shape"], json({32}));
  EXPECT_EQ(t["rope_freqs.weight"]["shape"], json({8}));
  const auto values = [&](const std::string& name) {
    return t[name]["values"].get<std::vector<double>>();
  };
  for (size_t l = 0; l < 2; ++l) {
    const auto& p = m.layers()[l];
    const std::string b = "blk." + std::to_string(l) + ".";
    EXPECT_EQ(compare(unpermute(values(b + "attn_q.weight"), 4, 64), p.q_proj).first, 0);
    EXPECT_EQ(compare(unpermute(values(b + "attn_k.weight"), 2, 64), p.k_proj).first, 0);
    EXPECT_EQ(compare(unpermute(values(b + "attn_q.bias"), 4, 1), p.q_bias).first, 0);
    EXPECT_EQ(compare(unpermute(values(b + "attn_k.bias"), 2, 1), p.k_bias).first, 0);
    EXPECT_EQ(compare(values(b + "attn_v.weight"), p.v_proj).first, 0);
    EXPECT_EQ(compare(values(b + "attn_output.weight"), p.o_proj).first, 0);
    EXPECT_EQ(compare(values(b + "ffn_gate.weight"), p.gate_proj).first, 0);
    EXPECT_EQ(compare(values(b + "ffn_up.weight"), p.up_proj).first, 0);
    EXPECT_EQ(compare(values(b + "ffn_down.weight"), p.down_proj).first, 0);
    EXPECT_EQ(compare(values(b + "attn_norm.weight"), p.input_norm).first, 0);
    EXPECT_EQ(compare(values(b + "ffn_norm.weight"), p.post_attention_norm).first, 0);
  }
  EXPECT_EQ(compare(values("token_embd.weight"), m.embed_tokens()).first, 0);
  EXPECT_EQ(compare(values("output.weight"), m.output_head()).first, 0);
  EXPECT_EQ(compare(values("output_norm.weight"), m.final_norm()).first, 0);
  // Llama 3.1 scaling: high frequencies kept (1), low ones stretched by the factor (8).
  const auto freqs = values("rope_freqs.weight");
  EXPECT_EQ(freqs.front(), 1.0);
  EXPECT_EQ(freqs.back(), 8.0);
  fs::remove_all(dir);
}

TEST(Gguf, HalfAndQ8_0StorageWithinTheirRounding) {
  if (!gguf_available()) GTEST_SKIP() << "gguf not importable by " << POLLEN_PEERS_PYTHON;
  const fs::path dir = temp_dir();
  const tokenizer::Tokenizer tok = small_tokenizer();
  const model::Llama m = random_model(tok.vocab_size(), false, true);
  io::export_gguf(m, tok, dir / "f32.gguf", {});
  for (const char* type : {"f16", "bf16", "q8_0"}) {
    io::GgufExportOptions o;
    o.type = io::gguf_type_named(type);
    const fs::path file = dir / (std::string(type) + ".gguf");
    io::export_gguf(m, tok, file, o);
    const json r = read_back(file, dir / "f32.gguf");
    const json& t = r["tensors"];
    EXPECT_FALSE(t.contains("output.weight")) << "tied embeddings are written once";
    EXPECT_EQ(r["fields"]["general.file_type"], std::string(type) == "f16"    ? 1
                                                : std::string(type) == "bf16" ? 32
                                                                              : 7);
    const std::string matrix_type = std::string(type) == "q8_0"  ? "Q8_0"
                                    : std::string(type) == "f16" ? "F16"
                                                                 : "BF16";
    // Rounding to nearest: within half a unit in the last place, 2^-11 of the value for f16
    // (10 stored mantissa bits), 2^-8 for bf16 (7); q8_0's half step is max|w| / 254 per block,
    // plus its f16 scale's rounding.
    const double rel = std::string(type) == "f16" ? 1.0 / 2048 : 1.0 / 256;
    for (size_t l = 0; l < 2; ++l) {
      const auto& p = m.layers()[l];
      const std::string b = "blk." + std::to_string(l) + ".";
      EXPECT_EQ(t[b + "attn_q.weight"]["type"], matrix_type);
      EXPECT_EQ(t[b + "attn_norm.weight"]["type"], "F32");
      for (const auto& [name, var, heads] :
           {std::tuple{"attn_q.weight", p.q_proj, 4}, std::tuple{"attn_k.weight", p.k_proj, 2},
            std::tuple{"ffn_down.weight", p.down_proj, 0}}) {
        std::vector<double> v = t[b + name]["values"].get<std::vector<double>>();
        if (heads > 0) v = unpermute(v, heads, 64);
        const auto [worst, top] = compare(v, var);
        if (std::string(type) == "q8_0")
          EXPECT_LE(worst, top * (0.5 / 127 + 1.0 / 1024)) << name;
        else
          EXPECT_LE(worst, top * rel) << name;
        EXPECT_GT(worst, 0) << name << " is stored exactly in " << type;
      }
    }
    if (std::string(type) == "q8_0") {
      EXPECT_EQ(r["q8_0_tensors"], 2 * 7 + 1);  // 7 matrices per block and the embeddings
      EXPECT_EQ(r["q8_0_bytes_differ"], 0);
    }
  }
  fs::remove_all(dir);
}

TEST(Gguf, RefusesWhatLlamaCppCannotHold) {
  const tokenizer::Tokenizer tok = small_tokenizer();
  const fs::path dir = temp_dir();
  model::LlamaConfig c = random_model(tok.vocab_size(), false, false).config();
  c.sliding_window = 16;
  EXPECT_NE(error_of([&] {
              io::export_gguf(model::Llama(c, 1), tok, dir / "x.gguf", {});
            }).find("sliding window"),
            std::string::npos);
  c.sliding_window = 0;
  c.rope_scaling = {ops::RopeScaling::Kind::dynamic, 2.0, 1, 4, c.max_position_embeddings};
  EXPECT_NE(error_of([&] {
              io::export_gguf(model::Llama(c, 1), tok, dir / "x.gguf", {});
            }).find("'dynamic'"),
            std::string::npos);
  c.rope_scaling = {};
  c.vocab_size = 100;
  EXPECT_NE(error_of([&] {
              io::export_gguf(model::Llama(c, 1), tok, dir / "x.gguf", {});
            }).find("more than the model's vocab_size"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir / "x.gguf"));
  EXPECT_NE(error_of([] { io::gguf_type_named("q4_0"); }).find("expected f32, f16, bf16 or q8_0"),
            std::string::npos);
  fs::remove_all(dir);
}

// tokenizer.ggml.pre names llama.cpp's pre-tokenizer only when the whole pipeline is the one
// it stands for; a Digits step, ByteLevel's add_prefix_space, a second split, a normalizer or
// an unknown pattern would make llama.cpp tokenize differently, and are refused by name.
TEST(Gguf, PreTokenizerNamedOnlyWhenLlamaCppReproducesTheWholePipeline) {
  using tokenizer::KnownPattern;
  const fs::path dir = temp_dir();
  const auto pre_of = [&](const tokenizer::Tokenizer& tok) {
    return io::export_gguf(random_model(tok.vocab_size(), false, false), tok, dir / "p.gguf", {})
        .pre_tokenizer;
  };
  const auto refusal = [&](const tokenizer::Tokenizer& tok) {
    return error_of([&] { pre_of(tok); });
  };
  EXPECT_EQ(pre_of(with_pipeline(nullptr, byte_level(false, true))), "gpt-2");
  EXPECT_EQ(pre_of(with_pipeline(
                nullptr, sequence({split_on(KnownPattern::kCl100k), byte_level(false, false)}))),
            "llama-bpe");
  EXPECT_EQ(pre_of(with_pipeline({{"type", "NFC"}}, sequence({split_on(KnownPattern::kQwen2),
                                                              byte_level(false, false)}))),
            "qwen2");

  const std::string digits =
      refusal(with_pipeline(nullptr, sequence({{{"type", "Digits"}, {"individual_digits", true}},
                                               split_on(KnownPattern::kCl100k),
                                               byte_level(false, false)})));
  EXPECT_NE(digits.find("pre-tokenizer step 1 (Digits, individual_digits true)"), std::string::npos)
      << digits;
  const std::string prefix = refusal(
      with_pipeline(nullptr, sequence({split_on(KnownPattern::kCl100k), byte_level(true, false)})));
  EXPECT_NE(prefix.find("step 2 (ByteLevel, add_prefix_space true"), std::string::npos) << prefix;
  EXPECT_NE(refusal(with_pipeline(nullptr, byte_level(true, true)))
                .find("step 1 (ByteLevel, add_prefix_space true, use_regex true)"),
            std::string::npos);
  const std::string twice = refusal(
      with_pipeline(nullptr, sequence({split_on(KnownPattern::kCl100k), byte_level(false, true)})));
  EXPECT_NE(twice.find("step 2 (ByteLevel, add_prefix_space false, use_regex true)"),
            std::string::npos)
      << twice;
  const std::string normalized =
      refusal(with_pipeline({{"type", "NFKC"}}, byte_level(false, true)));
  EXPECT_NE(normalized.find("normalizer (NFKC)"), std::string::npos) << normalized;
  const std::string unknown =
      refusal(with_pipeline(nullptr, sequence({{{"type", "Split"},
                                                {"pattern", {{"Regex", "\\s+|\\S+"}}},
                                                {"behavior", "Isolated"},
                                                {"invert", false}},
                                               byte_level(false, false)})));
  EXPECT_NE(unknown.find("split pattern '\\s+|\\S+' is none that llama.cpp knows"),
            std::string::npos)
      << unknown;
  fs::remove_all(dir);
}

// The chat template that goes with a model (tokenizer_config.json's, or the one a post-training
// checkpoint names) is written as tokenizer.chat_template, so llama.cpp renders chats as the
// model was trained.
TEST(Gguf, ChatTemplateGoesWithTheModel) {
  const fs::path dir = temp_dir() / "chat";
  const tokenizer::Tokenizer tok = small_tokenizer();
  const model::Llama m = random_model(tok.vocab_size(), false, false);
  const std::string jinja =
      "{{ bos_token }}{% for message in messages %}[INST] {{ message['content'] }} [/INST]"
      "{% endfor %}";
  fs::create_directories(dir);
  tokenizer::save_hf_json(tok, dir / "tokenizer.json");
  io::HfExportOptions hf;
  hf.extra_files = {dir / "tokenizer.json"};
  hf.tokenizer_config = {{"chat_template", jinja}};
  io::export_hf(m, dir / "hf", hf);
  const io::ModelSource src = io::resolve_model((dir / "hf").string());
  EXPECT_EQ(io::model_chat_template(src).value_or(""), jinja);
  io::ModelSource named = src;
  named.chat_template = "chatml";
  EXPECT_EQ(io::model_chat_template(named).value_or(""),
            tokenizer::chat_template_jinja(tokenizer::ChatTemplate::chatml));
  EXPECT_FALSE(io::model_chat_template(io::resolve_model("llama-tiny")).has_value());
  // Where transformers' save_pretrained now writes it: chat_template.jinja, carried by export.
  fs::copy(dir / "hf", dir / "jinja", fs::copy_options::recursive);
  write_file_atomic(dir / "jinja" / "tokenizer_config.json", "{}");
  write_file_atomic(dir / "jinja" / "chat_template.jinja", jinja);
  const io::ModelSource from_file = io::resolve_model((dir / "jinja").string());
  EXPECT_EQ(io::model_chat_template(from_file).value_or(""), jinja);
  EXPECT_TRUE(std::any_of(from_file.hf_side_files.begin(), from_file.hf_side_files.end(),
                          [](const fs::path& f) { return f.filename() == "chat_template.jinja"; }));

  if (!gguf_available()) GTEST_SKIP() << "gguf not importable by " << POLLEN_PEERS_PYTHON;
  io::GgufExportOptions o;
  o.chat_template = io::model_chat_template(src);
  io::export_gguf(m, tok, dir / "chat.gguf", o);
  EXPECT_EQ(read_back(dir / "chat.gguf")["fields"]["tokenizer.chat_template"], jinja);
  fs::remove_all(dir);
}

// An export replaces an earlier GGUF file only: a model's weights or any other file at the
// output path is refused and left as it was.
TEST(Gguf, AnExportDoesNotOverwriteAFileThatIsNotGguf) {
  const fs::path dir = temp_dir() / "overwrite";
  fs::create_directories(dir);
  const tokenizer::Tokenizer tok = small_tokenizer();
  const model::Llama m = random_model(tok.vocab_size(), false, false);
  write_file_atomic(dir / "notes.txt", "notes\n");
  const std::string e =
      pollen::testing::error_of([&] { io::export_gguf(m, tok, dir / "notes.txt", {}); });
  EXPECT_NE(e.find("exists and is not a GGUF file"), std::string::npos) << e;
  EXPECT_EQ(read_file(dir / "notes.txt"), "notes\n");
  write_file_atomic(dir / "m.gguf", "");  // made to be written (mktemp, touch)
  io::export_gguf(m, tok, dir / "m.gguf", {});
  EXPECT_NO_THROW(io::export_gguf(m, tok, dir / "m.gguf", {}));  // an earlier export
  fs::remove_all(dir);
}

TEST(Gguf, Q8_0BlocksAsGgml) {
  std::vector<float> v(64);
  for (size_t i = 0; i < 32; ++i) v[i] = static_cast<float>(i) - 12.7f;  // max |x| = 18.3
  const std::string q = io::quantize_q8_0(v);                            // second block: zeros
  ASSERT_EQ(q.size(), 68u);
  const float d = v[31] / 127.0f, id = 1.0f / d;
  uint16_t d16 = 0;
  std::memcpy(&d16, q.data(), 2);
  EXPECT_EQ(d16, f16::from_float(d).bits);
  EXPECT_EQ(static_cast<int8_t>(q[2 + 31]), 127);
  EXPECT_EQ(static_cast<int8_t>(q[2 + 0]), static_cast<int8_t>(std::round(v[0] * id)));
  EXPECT_EQ(static_cast<int8_t>(q[2 + 0]), -88);  // -12.7 / (18.3 / 127) = -88.1
  for (size_t i = 34; i < 68; ++i) EXPECT_EQ(q[i], 0);
  EXPECT_THROW(io::quantize_q8_0(std::vector<float>(31)), Error);
}
