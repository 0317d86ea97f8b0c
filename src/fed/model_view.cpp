#include "fed/model_view.h"

#include "base/hash.h"

namespace pollen::fed {

std::string weights_sha256(const Weights& w) {
  Sha256 sha;
  for (const auto& t : w) {
    POLLEN_ASSERT(t.dtype() == DType::f32 && t.is_contiguous());
    sha.update(t.data<float>(), t.nbytes());
  }
  return sha.hex_digest();
}

ModelPublisher::ModelPublisher(ParamSpecs specs, const CompressOptions& codec, Weights view)
    : specs_(std::move(specs)), codec_(codec) {
  if (compressed()) restore(std::move(view));
}

void ModelPublisher::restore(Weights view) {
  POLLEN_ASSERT(compressed() && view.size() == specs_.size());
  view_ = std::move(view);
  view_sha256_ = weights_sha256(view_);
  chain_.clear();
  chain_bytes_ = 0;
  release();
}

void ModelPublisher::publish(const Weights& x) {
  POLLEN_ASSERT(x.size() == specs_.size());
  release();
  if (!compressed()) {
    view_sha256_ = weights_sha256(x);
    full_ = make_set(encode_weights(specs_, x, CompressOptions{}), "", view_sha256_);
    return;
  }
  EncodedSet encoded = encode_weights(specs_, weights_minus(x, view_), codec_);
  const Weights sent = decode_set(encoded.header, encoded.bytes, specs_, "the round's model delta");
  for (size_t i = 0; i < sent.size(); ++i) {
    float* v = view_[i].data<float>();
    const float* s = sent[i].data<float>();
    for (int64_t j = 0; j < sent[i].numel(); ++j) v[j] += s[j];
  }
  const std::string base = view_sha256_;
  view_sha256_ = weights_sha256(view_);
  // Only the newest link carries the second moments: a client walking the chain trains with
  // those of the last set it pulls, which must be this round's.
  if (!chain_.empty() && !chain_.back()->header.second_moments().empty()) {
    auto older = std::make_shared<EncodedSet>(*chain_.back());
    older->header.clear_second_moments();
    chain_.back() = std::move(older);
  }
  // A round that left the view where it was adds no link: its holders get the empty delta, and
  // the newest link takes this round's second moments.
  if (base == view_sha256_) {
    if (!chain_.empty() && !second_moments_.empty()) {
      auto newest = std::make_shared<EncodedSet>(*chain_.back());
      newest->header.set_second_moments(second_moments_);
      chain_.back() = std::move(newest);
    }
    return;
  }
  auto delta = make_set(std::move(encoded), base, view_sha256_);
  // Keep the newest deltas while their chain is smaller than the whole model (and at most
  // kMaxChainLinks): past that, a client that far behind is better sent the view itself.
  uint64_t whole = 0;
  for (const auto& s : specs_) whole += static_cast<uint64_t>(shape_numel(s.shape)) * 4;
  chain_bytes_ += delta->header.total_bytes();
  chain_.push_back(std::move(delta));
  while (!chain_.empty() && (chain_bytes_ >= whole || chain_.size() > kMaxChainLinks)) {
    chain_bytes_ -= chain_.front()->header.total_bytes();
    chain_.pop_front();
  }
}

std::shared_ptr<const EncodedSet> ModelPublisher::for_client(const std::string& held_sha256) {
  if (compressed() && held_sha256 == view_sha256_) {
    // It holds this round's model already (a pull retried within the round, or one before a
    // server restart): an empty delta.
    if (!same_) {
      Weights zeros;
      for (const auto& s : specs_) zeros.push_back(Tensor::zeros(s.shape, DType::f32));
      same_ = make_set(encode_weights(specs_, zeros, codec_), view_sha256_, view_sha256_);
    }
    return same_;
  }
  // The next link of the chain from the view it holds.
  for (auto it = chain_.rbegin(); it != chain_.rend(); ++it)
    if (held_sha256 == (*it)->header.base_sha256()) return *it;
  if (!full_) {
    POLLEN_ASSERT(compressed());
    full_ = make_set(encode_weights(specs_, view_, CompressOptions{}), "", view_sha256_);
  }
  return full_;
}

std::shared_ptr<EncodedSet> ModelPublisher::make_set(EncodedSet set, const std::string& base,
                                                     const std::string& model) const {
  set.header.set_base_sha256(base);
  set.header.set_model_sha256(model);
  set.header.set_second_moments(second_moments_);
  return std::make_shared<EncodedSet>(std::move(set));
}

void HeldModel::hold(Weights model) {
  model_ = std::move(model);
  sha256_ = weights_sha256(model_);
}

void HeldModel::validate(const pb::TensorSetHeader& h, const ParamSpecs& specs,
                         const CompressOptions& codec, const std::string& what) const {
  POLLEN_CHECK(h.model_sha256().size() == 64, what,
               ": the header does not name the model (model_sha256 is not a SHA-256 hex digest)");
  if (h.base_sha256().empty()) {
    validate_header(h, specs, CompressOptions{}, what);
    return;
  }
  POLLEN_CHECK(h.base_sha256() == sha256_, what, ": a delta to model ",
               h.base_sha256().substr(0, 64), ", but this client holds ", sha256_);
  validate_header(h, specs, codec, what);
}

const Weights& HeldModel::receive(const pb::TensorSetHeader& h, const std::string& bytes,
                                  const ParamSpecs& specs, const std::string& what) {
  Weights model = decode_set(h, bytes, specs, what);
  if (!h.base_sha256().empty()) {
    POLLEN_ASSERT(h.base_sha256() == sha256_);
    for (size_t i = 0; i < model.size(); ++i) {  // v + decode(e), as the server adds them
      float* m = model[i].data<float>();
      const float* v = model_[i].data<float>();
      for (int64_t j = 0; j < model[i].numel(); ++j) m[j] = v[j] + m[j];
    }
  }
  const std::string sha = weights_sha256(model);
  POLLEN_CHECK(sha == h.model_sha256(), what, ": the model rebuilt here (SHA-256 ", sha,
               ") is not the server's (", h.model_sha256().substr(0, 64), ")");
  model_ = std::move(model);
  sha256_ = sha;
  return model_;
}

}  // namespace pollen::fed
