#pragma once
// Secure aggregation of one round, SecAgg (Bonawitz et al. 2017) with SecAgg+'s sparse graph
// (Bell et al. 2020), for an honest-but-curious server: the server learns the sum of the
// surviving clients' quantised updates and nothing about any one of them.
//
//   advertise  each selected client u sends two fresh X25519 public keys: c_u (share
//              encryption) and s_u (mask seeds). U1: who did.
//   share      u gets the roster U1 (ids, keys, parameters), derives the masking graph N(u) from
//              it, draws a self-mask seed b_u, Shamir-shares b_u and its mask secret key s_u^sk
//              (threshold t) among its holders H(u) = N(u) + {u}, and sends each neighbour's
//              pair of shares encrypted under HKDF(X25519(c_u^sk, c_v)) with AES-256-GCM.
//              U2: who did.
//   input      u trains, quantises (quantize.h) and sends
//                y_u = x_u + PRG(b_u) + sum_{v in N(u) & U2} (+/-) PRG(HKDF(X25519(s_u^sk, s_v)))
//              (+ when u < v, - when u > v, so each pair cancels in the sum). U3: who did.
//   unmask     every survivor v in U3 reveals, for u with v in H(u), its share of b_u when u is
//              in U3 and its share of s_u^sk when u dropped (U2 minus U3), never both for one u.
//              The server rebuilds b_u for survivors and s_u^sk for the dropped (checking it
//              against s_u), removes their masks from sum_{U3} y_u, and gets sum_{U3} x_u exactly.
//
// A round fails, with a message naming the client and the counts, when some secret has fewer
// than t holders left to reveal it. Masks, shares and keys are fresh every round.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fed/secagg/crypto.h"
#include "fed/secagg/options.h"
#include "fed/secagg/shamir.h"
#include "pollen_fed.pb.h"

namespace pollen::fed::secagg {

namespace pb = ::pollen::fed::v1;

constexpr size_t kMaxRoster = 100000;
constexpr size_t kSharePlaintextBytes = 2 * kShareBytes;
constexpr size_t kShareCiphertextBytes = kNonceBytes + kSharePlaintextBytes + kTagBytes;

// The seed contexts both sides derive masks from.
Key32 pairwise_seed(const Key32& my_mask_secret, const Key32& peer_mask_public, int64_t round,
                    const std::string& a, const std::string& b);
Key32 self_mask_seed(const Key32& b, int64_t round, const std::string& id);

// One client's side of one round.
class ClientSession {
 public:
  ClientSession(std::string id, int64_t round);
  int64_t round() const { return round_; }
  const Options& options() const { return options_; }  // the server's, from the roster

  pb::SecAggKeys advertise();
  // Checks the roster (sorted unique ids, this client's own keys, 32-byte keys, parameters) and
  // returns the encrypted shares for each neighbour.
  pb::SecAggShares share(const pb::SecAggRoster& roster);
  // Checks the inbox (senders from the roster, one share from each neighbour among them),
  // keeps the shares and adds the masks to x (ring words) in place.
  void mask(const pb::SecAggInbox& inbox, std::vector<uint64_t>& x);
  // Checks the lists (a partition of the senders, this client a survivor) and reveals.
  pb::SecAggReveal reveal(const pb::SecAggSurvivors& survivors);

 private:
  enum class Stage { fresh, advertised, shared, masked, revealed };
  size_t index_of(const std::string& id, const std::string& what) const;

  std::string id_;
  int64_t round_;
  Stage stage_ = Stage::fresh;
  KeyPair cipher_, mask_;
  Key32 self_seed_{};
  Options options_;
  size_t threshold_ = 0;
  std::vector<std::string> ids_;  // U1, sorted
  std::vector<Key32> cipher_keys_, mask_keys_;
  size_t me_ = 0;
  std::vector<size_t> neighbours_;
  std::set<std::string> senders_;  // U2
  struct Held {
    Share self_mask, mask_key;
  };
  std::map<std::string, Held> held_;  // shares this client holds, by owner
};

// The server's side of one round. Holds public keys, ciphertexts it cannot read, the running
// sum of masked inputs and, after unmasking, the sum: never an individual update.
class ServerSession {
 public:
  enum class Phase { advertise, share, input, unmask, done, failed };

  ServerSession(int64_t round, std::vector<std::string> selected, Options options,
                uint64_t graph_seed, int64_t numel);

  Phase phase() const { return phase_; }
  static const char* phase_name(Phase p);
  const std::string& failure() const { return failure_; }
  int64_t round() const { return round_; }
  const Options& options() const { return options_; }

  // The input phase fails with fewer than `n` inputs (min_clients), before anyone reveals a
  // share: no sum is unmasked that the round would not apply. At least 1.
  void require_inputs(size_t n) { min_inputs_ = std::max<size_t>(n, 1); }
  // Whether any client revealed shares: from then on the server may be able to unmask a sum.
  bool revealed() const { return !revealers_.empty(); }
  size_t inputs() const { return inputs_.size(); }

  // Whether `id` still has to answer in the current phase.
  bool expects(const std::string& id) const;
  // Every message below is checked (phase, membership, once, sizes) and throws naming `what`.
  void advertise(const std::string& id, const pb::SecAggKeys& keys);
  pb::SecAggRoster roster(const std::string& id) const;
  void shares(const std::string& id, const pb::SecAggShares& shares);
  pb::SecAggInbox inbox(const std::string& id) const;
  // A masked input: ring words, little-endian, ring_bits / 8 bytes each.
  void check_input(const std::string& id) const;
  void add_input(const std::string& id, const std::string& words);
  pb::SecAggSurvivors survivors(const std::string& id) const;
  void reveal(const std::string& id, const pb::SecAggReveal& reveal);
  // `id` cannot take the current phase's step (a restarted client has lost the round's
  // secrets): nobody waits for it in this phase, and it takes no later one, as if it had missed
  // the phase's deadline. Throws when the phase does not expect it.
  void drop_out(const std::string& id);

  // True when everyone expected in this phase has answered.
  bool phase_complete() const;
  // Closes the phase with those who answered (a deadline, or everyone did); may fail the round.
  void close_phase();

  // After the unmask phase: sum_{U3} x_u in the ring. Throws with the failure otherwise.
  std::vector<uint64_t> unmasked_sum() const;
  // What the server holds of the inputs: their running masked sum.
  const std::vector<uint64_t>& masked_sum() const { return masked_sum_; }
  size_t threshold() const { return threshold_; }

  // Fails the round with `why` (logged, and the failure() after the round's name): for a check
  // the session cannot make itself, such as the coordinator's that the sum fits the ring.
  void fail_round(std::string why);

 private:
  size_t index_of(const std::string& id) const;
  std::vector<size_t> holders(size_t u) const;        // H(u) as roster indices
  bool masks_a_survivor(const std::string& u) const;  // a neighbour of u sent an input

  int64_t round_;
  std::vector<std::string> selected_;
  Options options_;
  uint64_t graph_seed_;
  int64_t numel_;
  Phase phase_ = Phase::advertise;
  std::string failure_;
  size_t threshold_ = 0;

  std::map<std::string, pb::SecAggKeys> keys_;  // advertisers
  std::vector<std::string> ids_;                // U1, sorted
  std::vector<std::vector<size_t>> graph_;
  // ciphertexts_[to][from]
  std::map<std::string, std::map<std::string, std::string>> ciphertexts_;
  std::set<std::string> sharers_;  // U2
  std::set<std::string> inputs_;   // U3
  std::vector<uint64_t> masked_sum_;
  std::set<std::string> revealers_;
  std::set<std::string> dropped_out_;  // drop_out, in whichever phase
  size_t min_inputs_ = 1;
  std::map<std::string, std::vector<Share>> self_mask_shares_, mask_key_shares_;  // by owner
};

}  // namespace pollen::fed::secagg
