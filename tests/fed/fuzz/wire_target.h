#pragma once
// What the federation wire fuzz target runs on each input: the checks a server or a client puts
// every received message through (fed/received.h, the functions the coordinator and the client
// call), and the decoders of compressed payloads, fed bytes a hostile peer controls. Each input
// must be taken or refused with pollen::Error; anything else (another exception, a crash, a
// sanitizer report, a decoded value that is not finite) is a finding. Shared by the libFuzzer
// target and the deterministic corpus test.
//
// Input: byte 0 chooses what is received, byte 1 the receiving side's codec (codec_of), byte 2
// its other settings (the flags below), the rest is the message:
//   0 payload   codec, scale, block, topk and value count (8 bytes), then the payload; decode()
//   1 push      what a server receives: records (u16 LE length, then a serialized TensorStream):
//               the update info, the header, then chunks
//   2 pull      what a client receives: a TaskReply record, then TensorStream records: the
//               header, then chunks
//   3 join      a JoinRequest record, checked as the server's join does
// The checksums of a set (the header's SHA-256 of the chunks, a pulled model's SHA-256) stop
// nearly every mutation before the decoders; flags set them to what the message holds instead.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "base/error.h"
#include "base/hash.h"
#include "fed/compress.h"
#include "fed/first_moments.h"
#include "fed/model_view.h"
#include "fed/post_lora.h"
#include "fed/received.h"
#include "fed/secagg/masked_set.h"
#include "fed/second_moments.h"
#include "fed/wire.h"
#include "model/lora.h"

namespace pollen::fuzz {

namespace fed_wire {

constexpr fed::Codec kCodecs[] = {fed::Codec::none, fed::Codec::bf16, fed::Codec::int8,
                                  fed::Codec::int4, fed::Codec::topk, fed::Codec::sign,
                                  fed::Codec::nf2,  fed::Codec::nf3,  fed::Codec::mix};

// A small model's tensors: the token rows (untied), a matrix and a vector.
inline fed::ParamSpecs specs() {
  return {{"model.embed_tokens.weight", {6, 4}},
          {"model.layers.0.mlp.up_proj.weight", {3, 4}},
          {"model.norm.weight", {4}},
          {"lm_head.weight", {6, 4}}};
}
constexpr int64_t kVocab = 6;

// The model whose config the server publishes and a join must agree with.
inline model::LlamaConfig model_config() {
  model::LlamaConfig mc;
  mc.vocab_size = kVocab;
  mc.hidden_size = 4;
  mc.intermediate_size = 3;
  mc.num_hidden_layers = 1;
  mc.num_attention_heads = 1;
  mc.num_key_value_heads = 1;
  return mc;
}

// The receiving side's codec from byte 1: the codec, bf16 scales or not, blocks of 4 or 5.
inline fed::CompressOptions codec_of(uint8_t config) {
  fed::CompressOptions o;
  o.codec = kCodecs[config % 9];
  o.scale = (config / 9) % 2 ? fed::ScaleFormat::bf16 : fed::ScaleFormat::f32;
  o.block = (config / 18) % 2 ? 5 : 4;
  o.topk = o.codec == fed::Codec::topk ? 2 : 0;
  return o;
}

// Byte 2.
constexpr uint8_t kRowWeighting = 0x01;   // push: the server weights rows by token counts
constexpr uint8_t kSecondMoments = 0x02;  // push: the server shares second moments
constexpr uint8_t kFirstMoments = 0x04;   // push: and first moments of the token rows
constexpr uint8_t kSecure = 0x08;         // push: secure aggregation (ring32, or ring64 with 0x10)
constexpr uint8_t kRing64 = 0x10;
constexpr uint8_t kCounted = 0x20;   // push, with kSecure: adaptive clipping's masked count follows
constexpr uint8_t kFixModel = 0x10;  // pull: the header names the model its data rebuilds
constexpr uint8_t kDelta = 0x20;     // pull: a delta's base is the model the client holds
constexpr uint8_t kMomentSet = 0x40;    // pull: the first moments' set, not the model
constexpr uint8_t kFitPayload = 0x80;   // payload: cut or pad it to the size the codec takes
constexpr uint8_t kFixChecksum = 0x80;  // push, pull: the header's SHA-256 is the chunks' own

// The records of a message: u16 LE length, then that many bytes; a cut record ends the list.
inline std::vector<std::string> records(const uint8_t* p, size_t n) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at + 2 <= n) {
    const size_t len = p[at] | (static_cast<size_t>(p[at + 1]) << 8);
    at += 2;
    if (at + len > n) break;
    out.emplace_back(reinterpret_cast<const char*>(p + at), len);
    at += len;
  }
  return out;
}

template <typename Message>
Message parse(const std::string& bytes, const char* what) {
  Message m;
  // A message gRPC cannot parse never reaches pollen's code: it is refused by the transport.
  POLLEN_CHECK(m.ParseFromString(bytes), what, ": not a serialized message");
  return m;
}

inline void require_finite(const fed::Weights& w) {
  for (const Tensor& t : w)
    for (int64_t j = 0; j < t.numel(); ++j)
      if (!std::isfinite(t.data<float>()[j]))
        throw std::logic_error("a decoded value is not finite");
}

// Header, then chunks: assembled as the receiver does, the checksum fixed on request.
inline std::string assemble(fed::pb::TensorSetHeader& header, const std::vector<std::string>& recs,
                            size_t first, bool fix_sha, const std::string& what) {
  std::vector<fed::pb::Chunk> chunks;
  std::string all;
  for (size_t i = first; i < recs.size(); ++i) {
    auto m = parse<fed::pb::TensorStream>(recs[i], "chunk");
    POLLEN_CHECK(m.has_chunk(), what, ": after the header only chunks may follow");
    chunks.push_back(m.chunk());
    all += m.chunk().data();
  }
  if (fix_sha) header.set_sha256(sha256_hex(all));
  fed::ChunkAssembler assembler(header, what);
  for (const auto& c : chunks) assembler.add(c);
  return assembler.finish();
}

inline void payload(uint8_t flags, const uint8_t* p, size_t n) {
  POLLEN_CHECK(n >= 8, "payload: no options");
  fed::CompressOptions o;
  o.codec = kCodecs[p[0] % 9];
  o.scale = (p[1] & 1) ? fed::ScaleFormat::bf16 : fed::ScaleFormat::f32;
  o.block = 1 + (p[2] | (int64_t{p[3]} << 8));
  if (p[1] & 2) o.block <<= 4;  // up to 2^20
  o.topk = p[4] | (int64_t{p[5]} << 8);
  const int64_t values = (p[6] | (int64_t{p[7]} << 8)) % 4097;
  o.validate();
  std::string bytes(reinterpret_cast<const char*>(p + 8), n - 8);
  if (flags & kFitPayload) bytes.resize(fed::encoded_bytes(o, values));  // the size the codec needs
  std::vector<float> out(static_cast<size_t>(values));
  fed::decode(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), values, o, out.data(),
              "payload");
  for (float x : out)
    if (!std::isfinite(x)) throw std::logic_error("a decoded value is not finite");
}

// The server's rules for a push from bytes 1 and 2.
inline fed::UpdateRules server_rules(uint8_t config, uint8_t flags) {
  fed::UpdateRules r;
  r.model = specs();
  r.first_moments =
      fed::first_moment_specs(r.model, (flags & kFirstMoments) ? "token_rows" : "none");
  r.codec = codec_of(config);
  r.token_counts = flags & kRowWeighting;
  r.second_moments = flags & kSecondMoments;
  r.ring_bits = (flags & kSecure) ? ((flags & kRing64) ? 64 : 32) : 0;
  r.masked = fed::secagg::masked_specs(r.model, (flags & kSecure) && (flags & kCounted));
  r.vocab_size = kVocab;
  return r;
}

inline void push(uint8_t config, uint8_t flags, const std::vector<std::string>& recs) {
  POLLEN_CHECK(recs.size() >= 2, "push: no update info and header");
  const fed::UpdateRules rules = server_rules(config, flags);
  const auto info_message = parse<fed::pb::TensorStream>(recs[0], "push");
  POLLEN_CHECK(info_message.has_update(), "push: the stream must open with the update info");
  const std::string what = "update";
  fed::check_update_info(info_message.update(), rules, what);
  auto header_message = parse<fed::pb::TensorStream>(recs[1], "push");
  POLLEN_CHECK(header_message.has_header(), "push: the header must follow the update info");
  fed::pb::TensorSetHeader header = header_message.header();
  fed::check_update_header(header, rules, what);
  const std::string bytes = assemble(header, recs, 2, flags & kFixChecksum, what);
  if (rules.ring_bits > 0) return;  // a masked update is summed, never decoded
  fed::UpdateTensors u = fed::decode_update(header, bytes, rules, what);
  require_finite(u.delta);
  require_finite(u.first_moments);
  fed::token_counts_from(info_message.update().input_counts());
}

inline void pull(uint8_t flags, const std::vector<std::string>& recs) {
  POLLEN_CHECK(recs.size() >= 2, "pull: no task and header");
  const fed::ParamSpecs model = specs();
  const auto task = parse<fed::pb::TaskReply>(recs[0], "task");
  const fed::TaskCodecs codecs = fed::check_task(task);
  const fed::ParamSpecs moments =
      fed::first_moment_specs(model, task.first_moments().empty() ? "none" : task.first_moments());

  const std::string what = "global model";
  auto header_message = parse<fed::pb::TensorStream>(recs[1], "pull");
  POLLEN_CHECK(header_message.has_header(), what, ": the stream must open with a header");
  fed::pb::TensorSetHeader header = header_message.header();
  if (flags & kMomentSet) {
    fed::validate_header(header, moments, codecs.model, what);
    const std::string bytes = assemble(header, recs, 2, flags & kFixChecksum, what);
    require_finite(fed::decode_set(header, bytes, moments, what));
    return;
  }
  fed::Weights zeros;
  for (const auto& s : model) zeros.push_back(Tensor::zeros(s.shape, DType::f32));
  fed::HeldModel held(std::move(zeros));
  if ((flags & kDelta) && !header.base_sha256().empty()) header.set_base_sha256(held.sha256());
  held.validate(header, model, codecs.model, what);
  const std::string bytes = assemble(header, recs, 2, flags & kFixChecksum, what);
  if (flags & kFixModel)
    header.set_model_sha256(fed::weights_sha256(fed::decode_set(header, bytes, model, what)));
  require_finite(held.receive(header, bytes, model, what));
  if (!header.second_moments().empty())
    fed::unpack_second_moments(model, header.second_moments(), what);
}

// The server's terms: the model above, a tokenizer, and with flag 1 a post-training base and the
// default adapters.
inline fed::ServerTerms server_terms(uint8_t flags) {
  fed::ServerTerms t;
  t.model_json = fed::model_config_json(model_config());
  t.tokenizer_fingerprint = std::string(64, 'a');
  if (flags & 1) {
    t.lora_json = fed::lora_config_json(model::LoraConfig{});
    t.base_sha256 = std::string(64, 'b');
  }
  return t;
}

inline void join(uint8_t flags, const std::vector<std::string>& recs) {
  POLLEN_CHECK(!recs.empty(), "join: no request");
  fed::check_join_request(parse<fed::pb::JoinRequest>(recs[0], "join"), server_terms(flags));
}

// Valid inputs of every kind, for the corpus and the tests: each is taken.
inline std::string framed(const std::vector<std::string>& messages) {
  std::string out;
  for (const auto& m : messages) {
    out += static_cast<char>(m.size() & 0xff);
    out += static_cast<char>(m.size() >> 8);
    out += m;
  }
  return out;
}

inline fed::Weights sample_weights(const fed::ParamSpecs& specs, float scale) {
  fed::Weights w;
  int k = 0;
  for (const auto& s : specs) {
    Tensor t = Tensor::zeros(s.shape, DType::f32);
    for (int64_t j = 0; j < t.numel(); ++j, ++k)
      t.data<float>()[j] = scale * static_cast<float>((k * 37) % 11 - 5) / 5.0f;
    w.push_back(std::move(t));
  }
  return w;
}

inline std::vector<std::string> chunk_records(const fed::EncodedSet& set) {
  std::vector<std::string> out;
  fed::pb::TensorStream header;
  *header.mutable_header() = set.header;
  out.push_back(header.SerializeAsString());
  fed::for_each_chunk(set.bytes, 96, [&](const fed::pb::Chunk& c) {
    fed::pb::TensorStream m;
    *m.mutable_chunk() = c;
    out.push_back(m.SerializeAsString());
  });
  return out;
}

inline std::vector<std::string> valid_inputs() {
  std::vector<std::string> out;
  const fed::ParamSpecs model = specs();
  // payloads: 10 values in each codec, blocks of 4
  for (uint8_t c = 0; c < 9; ++c) {
    fed::CompressOptions o;
    o.codec = kCodecs[c];
    o.block = 4;
    o.topk = o.codec == fed::Codec::topk ? 2 : 0;
    const float x[10] = {0.5f, -1.25f, 3.0f, 0.0f, -0.75f, 2.5f, 1.0f, -3.5f, 0.25f, 4.0f};
    std::string bytes = {
        '\0', '\0', '\0', static_cast<char>(c), '\0', 3, 0, static_cast<char>(o.topk), 0, 10, 0};
    fed::encode(x, 10, o, bytes);
    out.push_back(bytes);
  }
  // pushes: each codec; with row weighting, second and first moments; masked
  const std::pair<uint8_t, uint8_t> pushes[] = {{0, 0},
                                                {1, 0},
                                                {2, 0},
                                                {3, 0},
                                                {4, 0},
                                                {5, 0},
                                                {6, 0},
                                                {7, 0},
                                                {8, 0},
                                                {9 + 2, 0},
                                                {18 + 9 + 6, 0},
                                                {7, kRowWeighting | kSecondMoments},
                                                {1, kSecondMoments | kFirstMoments},
                                                {0, kSecure},
                                                {0, kSecure | kCounted}};
  for (const auto& [config, flags] : pushes) {
    const bool row_weighting = flags & kRowWeighting, second_moments = flags & kSecondMoments;
    const bool first_moments = flags & kFirstMoments;
    fed::pb::TensorStream info_message;
    fed::pb::UpdateInfo& info = *info_message.mutable_update();
    info.set_client_id("silo-1");
    info.set_round(3);
    info.set_tokens(100);
    info.set_train_loss(2.5);
    info.set_train_seconds(1.5);
    (*info.mutable_objective_metrics())["reward"] = 0.375;  // a post-training objective's
    if (row_weighting) {
      fed::token_counts_to({{0, 2}, {60, 40}}, info.mutable_input_counts());
      fed::token_counts_to({{1, 5}, {99, 1}}, info.mutable_target_counts());
    }
    if (second_moments) {
      std::vector<float> factored(static_cast<size_t>(fed::factored_size(model)), 0.25f);
      info.set_second_moments(fed::pack_second_moments(model, factored));
    }
    fed::ParamSpecs update = model;
    if (first_moments) {
      const auto moments = fed::first_moment_specs(model, "token_rows");
      update.insert(update.end(), moments.begin(), moments.end());
    }
    fed::EncodedSet set;
    if (flags & kSecure) {
      const fed::ParamSpecs masked = fed::secagg::masked_specs(model, flags & kCounted);
      std::vector<uint64_t> words(static_cast<size_t>((flags & kCounted) ? 65 : 64), 12345);
      set = fed::secagg::masked_set(masked, words, 32);
    } else {
      set = fed::encode_weights(update, sample_weights(update, 0.01f), codec_of(config));
    }
    std::vector<std::string> recs = {info_message.SerializeAsString()};
    for (auto& r : chunk_records(set)) recs.push_back(std::move(r));
    out.push_back(std::string{'\1', static_cast<char>(config), static_cast<char>(flags)} +
                  framed(recs));
  }
  // pulls: the whole model, and a delta against the held (zero) model
  for (const auto& [config, flags] :
       {std::pair<uint8_t, uint8_t>{0, 0}, {6, kDelta}, {8, kDelta}}) {
    fed::pb::TaskReply task;
    task.set_kind(fed::pb::TASK_TRAIN);
    task.set_round(2);
    task.set_local_steps(4);
    task.set_codec("none");
    task.set_codec_block(4);
    const fed::CompressOptions model_codec = codec_of(config);
    task.set_model_codec(fed::codec_name(model_codec.codec));
    task.set_model_codec_block(model_codec.block);
    task.set_model_codec_topk(model_codec.topk);
    const fed::Weights w = sample_weights(model, 1.0f);
    fed::EncodedSet set;
    if (flags & kDelta) {
      set = fed::encode_weights(model, w, model_codec);
      fed::Weights zeros;
      for (const auto& sp : model) zeros.push_back(Tensor::zeros(sp.shape, DType::f32));
      set.header.set_base_sha256(fed::weights_sha256(zeros));
      set.header.set_model_sha256(
          fed::weights_sha256(fed::decode_set(set.header, set.bytes, model, "seed")));
    } else {
      set = fed::encode_weights(model, w, fed::CompressOptions{});
      set.header.set_model_sha256(fed::weights_sha256(w));
    }
    std::vector<std::string> recs = {task.SerializeAsString()};
    for (auto& r : chunk_records(set)) recs.push_back(std::move(r));
    out.push_back(std::string{'\2', static_cast<char>(config), static_cast<char>(flags)} +
                  framed(recs));
  }
  // a join
  {
    const model::LlamaConfig mc = model_config();
    fed::pb::JoinRequest r;
    r.set_protocol_version(fed::kProtocolVersion);
    r.set_client_id("silo-2");
    r.set_model_config(fed::model_config_json(mc));
    r.set_tokenizer_fingerprint(std::string(64, 'a'));
    r.set_base_fingerprint(std::string(64, 'b'));
    r.set_lora_config(fed::lora_config_json(model::LoraConfig{}));
    out.push_back(std::string{'\3', '\0', '\1'} + framed({r.SerializeAsString()}));
  }
  return out;
}

}  // namespace fed_wire

// True when the input was taken, false when it was refused.
inline bool receive_untrusted_fed(const uint8_t* data, size_t size) {
  // protobuf logs each string field that is not UTF-8; gRPC refuses those messages likewise
  static const bool quiet = (google::protobuf::SetLogHandler(nullptr), true);
  (void)quiet;
  if (size < 3) return false;
  const uint8_t config = data[1], flags = data[2];
  const uint8_t* message = data + 3;
  const size_t n = size - 3;
  try {
    switch (data[0] % 4) {
      case 0:
        fed_wire::payload(flags, message, n);
        break;
      case 1:
        fed_wire::push(config, flags, fed_wire::records(message, n));
        break;
      case 2:
        fed_wire::pull(flags, fed_wire::records(message, n));
        break;
      default:
        fed_wire::join(flags, fed_wire::records(message, n));
        break;
    }
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace pollen::fuzz
