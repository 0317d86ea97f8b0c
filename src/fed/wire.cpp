#include "fed/wire.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>

#include "base/hash.h"
#include "base/json_depth.h"
#include "model/llama.h"

namespace pollen::fed {

ParamSpecs param_specs(const model::Llama& model) {
  ParamSpecs out;
  for (const auto& [name, var] : model.named_parameters())
    out.push_back({name, var.value().shape()});
  return out;
}

TokenRowTensors token_row_tensors(const ParamSpecs& specs) {
  TokenRowTensors rows;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name == "model.embed_tokens.weight") rows.embedding = static_cast<int64_t>(i);
    if (specs[i].name == "lm_head.weight") rows.output = static_cast<int64_t>(i);
  }
  return rows;
}

Weights model_weights(const model::Llama& model) {
  Weights out;
  for (const auto& [name, var] : model.named_parameters()) {
    Tensor w = Tensor::empty(var.value().shape(), DType::f32);
    w.copy_(var.value());  // from host or GPU memory, converted to float32
    out.push_back(std::move(w));
  }
  return out;
}

void set_model_weights(const model::Llama& model, const Weights& w) {
  const auto params = model.named_parameters();
  POLLEN_CHECK(params.size() == w.size(), "set_model_weights: ", w.size(), " tensors for ",
               params.size(), " parameters");
  for (size_t i = 0; i < w.size(); ++i) {
    Tensor dst = params[i].second.value();
    POLLEN_CHECK(dst.shape() == w[i].shape(), "set_model_weights: '", params[i].first,
                 "' has shape ", shape_str(dst.shape()), ", got ", shape_str(w[i].shape()));
    dst.copy_(w[i]);
  }
}

void check_client_id(const std::string& id, const std::string& what) {
  POLLEN_CHECK(!id.empty() && id.size() <= kMaxIdBytes, what, ": client id must be 1 to ",
               kMaxIdBytes, " characters, got ", id.size());
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    POLLEN_CHECK(ok, what, ": client id may hold only letters, digits, '.', '_' and '-'");
  }
  // An id names folders (certificates, a simulated client's state): '.' and '..' would name
  // others.
  POLLEN_CHECK(id.find_first_not_of('.') != std::string::npos, what, ": client id '", id,
               "' is made of dots only");
}

std::string model_config_json(const model::LlamaConfig& c) {
  nlohmann::json j{{"vocab_size", c.vocab_size},
                   {"hidden_size", c.hidden_size},
                   {"intermediate_size", c.intermediate_size},
                   {"num_hidden_layers", c.num_hidden_layers},
                   {"num_attention_heads", c.num_attention_heads},
                   {"num_key_value_heads", c.num_key_value_heads},
                   {"head_dim", c.resolved_head_dim()},
                   {"max_position_embeddings", c.max_position_embeddings},
                   {"rope_theta", c.rope_theta},
                   {"rms_norm_eps", c.rms_norm_eps},
                   {"tie_word_embeddings", c.tie_word_embeddings},
                   {"attention_bias", c.attention_bias},
                   {"sliding_window", c.sliding_window}};
  // Every setting of a scaling, its kind's or not: two configs agree when they compute alike.
  const ops::RopeScaling& s = c.rope_scaling;
  j["rope_scaling"] =
      s.kind == ops::RopeScaling::Kind::none
          ? nlohmann::json{{"kind", "none"}}
          : nlohmann::json{{"kind", model::rope_scaling_kind_name(s.kind)},
                           {"factor", s.factor},
                           {"low_freq_factor", s.low_freq_factor},
                           {"high_freq_factor", s.high_freq_factor},
                           {"original_max_position_embeddings", s.original_max_position_embeddings},
                           {"attention_factor", s.attention_factor},
                           {"beta_fast", s.beta_fast},
                           {"beta_slow", s.beta_slow}};
  return j.dump();  // nlohmann::json keeps keys sorted
}

std::string agreement_differences(const pb::JoinRequest& client, uint32_t protocol,
                                  const std::string& model_config,
                                  const std::string& tokenizer_fingerprint) {
  std::string out;
  auto add = [&](const std::string& line) { out += (out.empty() ? "" : "; ") + line; };
  if (client.protocol_version() != protocol) {
    add(cat("protocol version: server ", protocol, ", client ", client.protocol_version()));
  }
  nlohmann::json server_model = nlohmann::json::parse(model_config), client_model;
  try {
    check_json_depth(client.model_config(), "the client's model config");
    client_model = nlohmann::json::parse(client.model_config());
  } catch (const std::exception&) {
    add("model config: the client's is not valid JSON");
  }
  if (client_model.is_object()) {
    for (const auto& [key, value] : server_model.items()) {
      if (!client_model.contains(key)) {
        add(cat("model.", key, ": server ", value.dump(), ", client (missing)"));
      } else if (client_model[key] != value) {
        add(cat("model.", key, ": server ", value.dump(), ", client ", client_model[key].dump()));
      }
    }
    for (const auto& [key, value] : client_model.items()) {
      if (!server_model.contains(key)) add(cat("model.", key, ": unknown to the server"));
    }
  } else if (!client_model.is_null()) {
    add("model config: the client's is not a JSON object");
  }
  if (client.tokenizer_fingerprint() != tokenizer_fingerprint) {
    add(cat("tokenizer fingerprint: server '", tokenizer_fingerprint, "', client '",
            client.tokenizer_fingerprint().substr(0, 80), "'"));
  }
  return out;
}

ScaleFormat parse_wire_scale(const std::string& name, const std::string& what) {
  if (name.empty()) return ScaleFormat::f32;
  try {
    return parse_scale_format(name);
  } catch (const Error&) {
    fail(what, ": scale format '", name.substr(0, 16), "', expected float32 or bf16");
  }
}

EncodedSet encode_payloads(const ParamSpecs& specs, std::vector<std::string> payloads,
                           const CompressOptions& codec) {
  POLLEN_ASSERT(specs.size() == payloads.size());
  EncodedSet out;
  out.header.set_codec(codec_name(codec.codec));
  out.header.set_codec_block(codec.block);
  out.header.set_codec_topk(codec.codec == Codec::topk ? codec.topk : 0);
  out.header.set_codec_scale(scale_format_name(codec.scale));
  size_t total = 0;
  for (const auto& p : payloads) total += p.size();
  out.bytes.reserve(total);
  Sha256 sha;
  for (size_t i = 0; i < specs.size(); ++i) {
    auto* info = out.header.add_tensors();
    info->set_name(specs[i].name);
    for (int64_t d : specs[i].shape) info->add_shape(d);
    info->set_bytes(payloads[i].size());
    sha.update(payloads[i]);
    out.bytes += payloads[i];
    std::string().swap(payloads[i]);
  }
  out.header.set_total_bytes(out.bytes.size());
  out.header.set_sha256(sha.hex_digest());
  return out;
}

EncodedSet encode_weights(const ParamSpecs& specs, const Weights& w, const CompressOptions& codec) {
  POLLEN_CHECK(specs.size() == w.size(), "encode: ", w.size(), " tensors for ", specs.size(),
               " parameters");
  std::vector<std::string> payloads(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    const Tensor t = w[i].dtype() == DType::f32 ? w[i].contiguous() : w[i].to(DType::f32);
    encode(t.data<float>(), t.numel(), codec, payloads[i]);
  }
  return encode_payloads(specs, std::move(payloads), codec);
}

void validate_header(const pb::TensorSetHeader& h, const ParamSpecs& specs,
                     const CompressOptions& codec, const std::string& what) {
  POLLEN_CHECK(h.codec() == codec_name(codec.codec), what, ": codec '", h.codec().substr(0, 16),
               "', expected '", codec_name(codec.codec), "'");
  POLLEN_CHECK(h.codec_block() == codec.block, what, ": codec block ", h.codec_block(),
               ", expected ", codec.block);
  const int64_t topk = codec.codec == Codec::topk ? codec.topk : 0;
  POLLEN_CHECK(h.codec_topk() == topk, what, ": codec topk ", h.codec_topk(), ", expected ", topk);
  POLLEN_CHECK(parse_wire_scale(h.codec_scale(), what) == codec.scale, what, ": codec scale '",
               h.codec_scale().substr(0, 16), "', expected '", scale_format_name(codec.scale), "'");
  POLLEN_CHECK(static_cast<size_t>(h.tensors_size()) == specs.size(), what, ": ", h.tensors_size(),
               " tensors, the model has ", specs.size());
  uint64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& t = h.tensors(static_cast<int>(i));
    POLLEN_CHECK(t.name() == specs[i].name, what, ": tensor ", i, " is '", t.name().substr(0, 200),
                 "', expected '", specs[i].name, "'");
    const Shape shape(t.shape().begin(), t.shape().end());
    POLLEN_CHECK(shape == specs[i].shape, what, ": tensor '", specs[i].name, "' has shape ",
                 t.shape_size() <= 8 ? shape_str(shape) : std::string("(too many dims)"),
                 ", expected ", shape_str(specs[i].shape));
    const uint64_t want = encoded_bytes(codec, shape_numel(specs[i].shape));
    POLLEN_CHECK(t.bytes() == want, what, ": tensor '", specs[i].name, "' says ", t.bytes(),
                 " bytes; ", codec_name(codec.codec), " needs ", want);
    total += want;
  }
  POLLEN_CHECK(h.total_bytes() == total, what, ": total ", h.total_bytes(), " bytes, expected ",
               total);
  POLLEN_CHECK(h.sha256().size() == 64, what, ": the checksum is not a SHA-256 hex digest");
}

void for_each_chunk(const std::string& bytes, uint64_t max_chunk,
                    const std::function<void(const pb::Chunk&)>& send) {
  pb::Chunk c;
  for (uint64_t off = 0; off < bytes.size(); off += max_chunk) {
    const uint64_t n = std::min<uint64_t>(max_chunk, bytes.size() - off);
    c.set_offset(off);
    c.set_data(bytes.data() + off, n);
    send(c);
  }
}

ChunkAssembler::ChunkAssembler(const pb::TensorSetHeader& header, std::string what)
    : total_(header.total_bytes()), sha256_(header.sha256()), what_(std::move(what)) {
  // What the header claims is reserved only up to a bound: past it the buffer grows with the
  // chunks that arrive, so a stream that announces gigabytes and sends nothing holds little.
  bytes_.reserve(std::min<uint64_t>(total_, kReservedUpFront));
}

void ChunkAssembler::add(const pb::Chunk& c) {
  POLLEN_CHECK(c.offset() == bytes_.size(), what_, ": chunk at offset ", c.offset(), ", expected ",
               bytes_.size());
  POLLEN_CHECK(!c.data().empty() && c.data().size() <= kMaxChunkBytes, what_, ": chunk of ",
               c.data().size(), " bytes; chunks hold 1 to ", kMaxChunkBytes);
  POLLEN_CHECK(bytes_.size() + c.data().size() <= total_, what_, ": chunks run past the ", total_,
               " bytes the header announced");
  // Once the stream has shown it sends, the rest is reserved at once: growing by doubling would
  // hold up to three times a large update while it grows.
  if (bytes_.size() + c.data().size() > bytes_.capacity()) bytes_.reserve(total_);
  bytes_ += c.data();
}

std::string ChunkAssembler::finish() {
  POLLEN_CHECK(bytes_.size() == total_, what_, ": stream ended after ", bytes_.size(), " of ",
               total_, " bytes");
  const std::string got = sha256_hex(bytes_);
  POLLEN_CHECK(got == sha256_, what_, ": SHA-256 mismatch (header ", sha256_.substr(0, 64),
               ", data ", got, ")");
  return std::move(bytes_);
}

Weights decode_set(const pb::TensorSetHeader& h, const std::string& bytes, const ParamSpecs& specs,
                   const std::string& what) {
  CompressOptions codec;
  codec.codec = parse_codec(h.codec());
  codec.block = h.codec_block();
  codec.topk = h.codec_topk();
  codec.scale = parse_wire_scale(h.codec_scale(), what);
  Weights out;
  uint64_t off = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& t = h.tensors(static_cast<int>(i));
    POLLEN_ASSERT(off + t.bytes() <= bytes.size());
    Tensor x = Tensor::empty(specs[i].shape, DType::f32);
    decode(reinterpret_cast<const uint8_t*>(bytes.data() + off), t.bytes(), x.numel(), codec,
           x.data<float>(), cat(what, ", tensor '", specs[i].name, "'"));
    off += t.bytes();
    out.push_back(std::move(x));
  }
  return out;
}

void validate_update_info(const pb::UpdateInfo& u, const std::string& what) {
  check_client_id(u.client_id(), what);
  POLLEN_CHECK(u.round() >= 1, what, ": round ", u.round(), "; rounds count from 1");
  POLLEN_CHECK(u.tokens() >= 1 && u.tokens() <= (int64_t{1} << 50), what, ": tokens ", u.tokens(),
               " out of range");
  POLLEN_CHECK(std::isfinite(u.train_loss()) && std::isfinite(u.eval_loss()) &&
                   std::isfinite(u.train_seconds()),
               what, ": losses and times must be finite");
  // A cross-entropy is never negative, but a post-training objective's loss may be: GRPO's
  // policy loss, and its held-out loss, the negated mean reward.
  for (const auto& [name, loss] :
       {std::pair{"train_loss", u.train_loss()}, std::pair{"eval_loss", u.eval_loss()}}) {
    POLLEN_CHECK(std::abs(loss) <= kMaxLoss, what, ": ", name, " ", loss, " is outside [-",
                 kMaxLoss, ", ", kMaxLoss, "]");
  }
  POLLEN_CHECK(u.eval_tokens() >= 0 && u.eval_tokens() <= (int64_t{1} << 50), what,
               ": eval_tokens ", u.eval_tokens(), " out of range (0 to 2^50)");
  POLLEN_CHECK(u.data_manifest_hash().size() <= 128, what, ": data manifest hash too long");
  POLLEN_CHECK(u.objective_metrics_size() <= 16, what, ": ", u.objective_metrics_size(),
               " objective metrics, more than 16");
  for (const auto& [name, value] : u.objective_metrics()) {
    POLLEN_CHECK(!name.empty() && name.size() <= 64 &&
                     std::all_of(name.begin(), name.end(),
                                 [](char c) {
                                   return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
                                          c == '/' || c == '.' || c == '-';
                                 }),
                 what, ": objective metric names are 1 to 64 of A-Z a-z 0-9 _ / . -");
    POLLEN_CHECK(std::isfinite(value) && std::abs(value) <= kMaxLoss, what, ": objective metric '",
                 name, "' is ", value, ", not a finite value within +-", kMaxLoss);
  }
}

void check_update_values(const ParamSpecs& specs, const Weights& delta, const std::string& what) {
  for (size_t t = 0; t < delta.size(); ++t) {
    const float* x = delta[t].data<float>();
    for (int64_t j = 0; j < delta[t].numel(); ++j) {
      POLLEN_CHECK(std::abs(x[j]) <= kMaxUpdateValue, what, ": '", specs[t].name, "'[", j, "] is ",
                   x[j], ", beyond +-", kMaxUpdateValue,
                   " (a pseudo-gradient moves a weight by far less in a round)");
    }
  }
}

namespace {

void check_counts(const pb::TokenCounts& c, int64_t tokens, int64_t vocab_size,
                  const std::string& what) {
  POLLEN_CHECK(c.ids_size() == c.counts_size(), what, ": ", c.ids_size(), " token ids but ",
               c.counts_size(), " counts");
  int64_t total = 0;
  for (int k = 0; k < c.ids_size(); ++k) {
    const int64_t id = c.ids(k);
    POLLEN_CHECK(id < vocab_size, what, ": token id ", id, " is not below the vocabulary size ",
                 vocab_size);
    POLLEN_CHECK(k == 0 || id > static_cast<int64_t>(c.ids(k - 1)), what, ": token id ", id,
                 " follows ", c.ids(k - 1), "; ids must be strictly ascending");
    POLLEN_CHECK(c.counts(k) >= 1 && c.counts(k) <= tokens, what, ": token ", id, " counted ",
                 c.counts(k), " times; a count is 1 to the update's ", tokens, " tokens");
    total += c.counts(k);  // no overflow: each count <= tokens <= 2^50, at most 2^32 of them
    POLLEN_CHECK(total <= tokens, what, ": the counts pass the update's ", tokens, " tokens");
  }
  POLLEN_CHECK(total == tokens, what, ": the counts sum to ", total, ", the update trained on ",
               tokens, " tokens");
}

}  // namespace

void validate_token_counts(const pb::UpdateInfo& u, bool expected, int64_t vocab_size,
                           const std::string& what) {
  const bool sent = u.has_input_counts() || u.has_target_counts();
  if (!expected) {
    POLLEN_CHECK(!sent, what, ": token counts were not asked for (strategy.row_weighting is none)");
    return;
  }
  POLLEN_CHECK(u.has_input_counts() && u.has_target_counts(), what,
               ": strategy.row_weighting needs the round's input and target token counts; the "
               "update carries none (a client of an older pollen?)");
  check_counts(u.input_counts(), u.tokens(), vocab_size, what + ", input_counts");
  check_counts(u.target_counts(), u.tokens(), vocab_size, what + ", target_counts");
}

TokenCounts token_counts_from(const pb::TokenCounts& c) {
  TokenCounts out;
  out.ids.assign(c.ids().begin(), c.ids().end());
  out.counts.assign(c.counts().begin(), c.counts().end());
  return out;
}

void token_counts_to(const TokenCounts& c, pb::TokenCounts* out) {
  out->Clear();
  for (size_t k = 0; k < c.ids.size(); ++k) {
    out->add_ids(static_cast<uint32_t>(c.ids[k]));
    out->add_counts(c.counts[k]);
  }
}

}  // namespace pollen::fed
