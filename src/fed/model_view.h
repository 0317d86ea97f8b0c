#pragma once
// The round's model as the clients hold it, and how it reaches them (docs/federated.md,
// "Compression").
//
// Without compression the server sends its exact model x each round. With a server codec, both
// sides keep a view v, the model an up-to-date client trains from. Each round the server encodes
// only how far x has moved from v, e = encode(x - v), and both sides set v <- v + decode(e): the
// same float32 additions on both, so v is bitwise equal wherever it is held. What one round's
// encoding misses stays in x - v and goes out with the next round's: error feedback for the
// download, with no residual to keep beside v. A client that holds another model (a new or
// restarted client without its state, or one that missed a round) is sent v itself, exact in
// float32; one that holds v already (a retried pull) an empty delta. Models are
// named by the SHA-256 of their weights; the client checks the model it rebuilt against the
// server's name for it.
#include <memory>
#include <string>

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
  // The round's set for a client holding the model named `held_sha256`: the delta when it holds
  // the last view, an empty delta when it holds this round's, the view itself otherwise.
  std::shared_ptr<const EncodedSet> for_client(const std::string& held_sha256);
  // The round is over: its sets are freed (pulls in flight keep theirs).
  void release() { delta_.reset(), full_.reset(), same_.reset(); }

  // What the clients train from this round.
  const Weights& view() const { return view_; }
  // A resumed server's view (the checkpoint's), before the next publish.
  void restore(Weights view);
  bool compressed() const { return codec_.codec != Codec::none; }

 private:
  ParamSpecs specs_;
  CompressOptions codec_;
  Weights view_;
  std::string view_sha256_;
  std::shared_ptr<const EncodedSet> delta_, full_, same_;
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
