#pragma once
// The round's model as the clients hold it, and how it reaches them (docs/federated.md,
// "Compression").
//
// Without compression the server sends its exact model x each round. With a server codec, both
// sides keep a view v, the model an up-to-date client trains from. Each round the server encodes
// only how far x has moved from v, e = encode(x - v), and both sides set v <- v + decode(e): the
// same float32 additions on both, so v is bitwise equal wherever it is held. What one round's
// encoding misses stays in x - v and goes out with the next round's: error feedback for the
// download, with no residual to keep beside v. A client that holds an older view (one that sat
// out rounds, or resumed from an older state) is sent the chain of deltas it missed, one per pull,
// while the chain is smaller than the model; one that holds another model (a new client, one
// restarted without its state, or one too far behind) is sent v itself, exact in float32; one
// that holds v already (a retried pull) an empty delta. Models are named by the SHA-256 of their
// weights; the client checks each model it rebuilt against the server's name for it, and pulls
// until it holds the round's.
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "fed/compress.h"
#include "fed/wire.h"

namespace pollen::fed {

// SHA-256 (hex) over each tensor's float32 bytes, in order.
std::string weights_sha256(const Weights& w);

// The server's side: what each round's pull sends.
class ModelPublisher {
 public:
  // `view`: the model the clients hold before the first round (the initial model).
  ModelPublisher(ParamSpecs specs, const CompressOptions& codec, Weights view);

  // Opens a round on the exact model x: the new view, and the sets a pull may get.
  void publish(const Weights& x);
  // The next set for a client holding the model named `held_sha256`: an empty delta when it holds
  // this round's view; the delta from the view it holds to the next, when that view is in the
  // kept chain; the view itself otherwise.
  std::shared_ptr<const EncodedSet> for_client(const std::string& held_sha256);
  // The round is over: its whole-model and empty sets are freed (pulls in flight keep theirs).
  void release() { full_.reset(), same_.reset(); }

  // What the clients train from this round (with a codec), and its name (with or without).
  const Weights& view() const { return view_; }
  const std::string& view_sha256() const { return view_sha256_; }
  // How many of the last publishes' deltas are kept: the longest chain whose bytes stay under the
  // whole model's, of at most kMaxChainLinks (a publish that moved nothing adds none).
  size_t chain_length() const { return chain_.size(); }
  // A resumed server's view (the checkpoint's), before the next publish; the chain starts anew.
  void restore(Weights view);
  bool compressed() const { return codec_.codec != Codec::none; }
  // The clients' factored second moments as packed for the wire (strategy.second_moments,
  // fed/second_moments.h): every set made from the next publish on carries them.
  void set_second_moments(std::string packed) { second_moments_ = std::move(packed); }

 private:
  std::shared_ptr<EncodedSet> make_set(EncodedSet set, const std::string& base,
                                       const std::string& model) const;

  ParamSpecs specs_;
  CompressOptions codec_;
  Weights view_;
  std::string view_sha256_;
  std::deque<std::shared_ptr<const EncodedSet>> chain_;  // the last rounds' deltas, oldest first
  uint64_t chain_bytes_ = 0;
  std::shared_ptr<const EncodedSet> full_, same_;
  std::string second_moments_;
};

// The client's side: the model it holds, and the round's model from a pulled set.
class HeldModel {
 public:
  explicit HeldModel(Weights model) { hold(std::move(model)); }
  const Weights& model() const { return model_; }
  const std::string& sha256() const { return sha256_; }

  // Checks the pulled set's header (the tensors, and the codec: `codec` for a delta against the
  // held model, none for a whole model), before its bytes arrive. Throws naming `what`.
  void validate(const pb::TensorSetHeader& header, const ParamSpecs& specs,
                const CompressOptions& codec, const std::string& what) const;
  // The round's model from a validated set's bytes, now held; throws naming `what` when it is not
  // the model the server named.
  const Weights& receive(const pb::TensorSetHeader& header, const std::string& bytes,
                         const ParamSpecs& specs, const std::string& what);

 private:
  void hold(Weights model);
  Weights model_;
  std::string sha256_;
};

}  // namespace pollen::fed
