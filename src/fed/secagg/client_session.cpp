// The client's side of one secure-aggregation round (session.h).
#include <algorithm>

#include "base/error.h"
#include "fed/secagg/graph.h"
#include "fed/secagg/session.h"
#include "fed/wire.h"

namespace pollen::fed::secagg {

namespace {

constexpr const char* kVersion = "pollen-secagg-v1";

std::string share_aad(int64_t round, const std::string& from, const std::string& to) {
  return cat(kVersion, " share|", round, "|", from, "|", to);
}

Key32 share_key(const Key32& my_cipher_secret, const Key32& peer_cipher_public,
                const std::string& what) {
  return derive(agree(my_cipher_secret, peer_cipher_public, what), cat(kVersion, " share key"));
}

Options options_from(const pb::SecAggParams& p) {
  Options o;
  o.enabled = true;
  o.threshold = p.threshold();
  o.neighbours = p.neighbours();
  o.ring_bits = static_cast<int>(p.ring_bits());
  o.range = p.range();
  o.step = p.step();
  o.stochastic = p.stochastic();
  o.noise = {p.dp_clip(), p.dp_noise_stddev(), p.dp_token_cap(),
             p.has_dp_noise_seed() ? p.dp_noise_seed() : -1, p.dp_count_stddev()};
  o.validate([](const std::string& key) { return cat("secure aggregation roster: ", key); });
  return o;
}

}  // namespace

Key32 pairwise_seed(const Key32& my_mask_secret, const Key32& peer_mask_public, int64_t round,
                    const std::string& a, const std::string& b) {
  const auto& [lo, hi] = std::minmax(a, b);
  return derive(agree(my_mask_secret, peer_mask_public, cat("mask key of '", b, "'")),
                cat(kVersion, " pairwise mask|", round, "|", lo, "|", hi));
}

Key32 self_mask_seed(const Key32& b, int64_t round, const std::string& id) {
  return derive(b, cat(kVersion, " self mask|", round, "|", id));
}

ClientSession::ClientSession(std::string id, int64_t round) : id_(std::move(id)), round_(round) {}

size_t ClientSession::index_of(const std::string& id, const std::string& what) const {
  const auto it = std::lower_bound(ids_.begin(), ids_.end(), id);
  POLLEN_CHECK(it != ids_.end() && *it == id, what, ": '", id.substr(0, kMaxIdBytes),
               "' is not in the round's roster");
  return static_cast<size_t>(it - ids_.begin());
}

pb::SecAggKeys ClientSession::advertise() {
  POLLEN_CHECK(stage_ == Stage::fresh, "secure aggregation: keys already advertised for round ",
               round_);
  cipher_ = KeyPair::generate();
  mask_ = KeyPair::generate();
  stage_ = Stage::advertised;
  pb::SecAggKeys k;
  k.set_client_id(id_);
  k.set_cipher_public_key(key_string(cipher_.public_key));
  k.set_mask_public_key(key_string(mask_.public_key));
  return k;
}

pb::SecAggShares ClientSession::share(const pb::SecAggRoster& roster) {
  const std::string what = cat("secure aggregation roster of round ", round_);
  POLLEN_CHECK(stage_ == Stage::advertised, what, ": keys were not advertised first");
  const size_t n = static_cast<size_t>(roster.clients_size());
  POLLEN_CHECK(n >= 2 && n <= kMaxRoster, what, ": ", n, " clients; 2 to ", kMaxRoster,
               " expected");
  // Everything is checked before the session keeps any of it: a refused roster changes nothing.
  const Options options = options_from(roster.params());
  std::vector<std::string> ids;
  std::vector<Key32> cipher_keys, mask_keys;
  for (const auto& c : roster.clients()) {
    check_client_id(c.client_id(), what);
    POLLEN_CHECK(ids.empty() || ids.back() < c.client_id(), what,
                 ": ids must be sorted and unique");
    ids.push_back(c.client_id());
    cipher_keys.push_back(key_from(c.cipher_public_key(), cat(what, ", cipher key")));
    mask_keys.push_back(key_from(c.mask_public_key(), cat(what, ", mask key")));
  }
  const auto mine = std::lower_bound(ids.begin(), ids.end(), id_);
  POLLEN_CHECK(mine != ids.end() && *mine == id_, what, ": this client is not in the roster");
  const auto me = static_cast<size_t>(mine - ids.begin());
  POLLEN_CHECK(cipher_keys[me] == cipher_.public_key && mask_keys[me] == mask_.public_key, what,
               ": this client's keys were altered");
  auto neighbours = neighbours_of(n, options.neighbours, roster.params().graph_seed(), me);
  const size_t holders = neighbours.size() + 1;
  const size_t threshold = options.resolved_threshold(holders);
  POLLEN_CHECK(threshold >= 2 && threshold <= holders, what, ": threshold ", threshold, " for ",
               holders, " holders (", neighbours.size(), " neighbours and this client)");
  options_ = options;
  ids_ = std::move(ids);
  cipher_keys_ = std::move(cipher_keys);
  mask_keys_ = std::move(mask_keys);
  me_ = me;
  neighbours_ = std::move(neighbours);
  threshold_ = threshold;

  // Shares of b and of the mask secret key for every holder, at points index + 1.
  self_seed_ = random_key();
  std::vector<uint32_t> xs;
  std::vector<size_t> holder_index = neighbours_;
  holder_index.push_back(me_);
  for (size_t h : holder_index) xs.push_back(static_cast<uint32_t>(h + 1));
  const auto b_shares = share_secret(self_seed_, threshold_, xs);
  const auto s_shares = share_secret(mask_.secret, threshold_, xs);
  pb::SecAggShares out;
  for (size_t k = 0; k < holder_index.size(); ++k) {
    const size_t v = holder_index[k];
    if (v == me_) {
      held_[id_] = {b_shares[k], s_shares[k]};
      continue;
    }
    auto* s = out.add_shares();
    s->set_peer(ids_[v]);
    const Key32 key =
        share_key(cipher_.secret, cipher_keys_[v], cat("cipher key of '", ids_[v], "'"));
    s->set_ciphertext(seal(key, share_aad(round_, id_, ids_[v]),
                           share_bytes(b_shares[k]) + share_bytes(s_shares[k])));
  }
  stage_ = Stage::shared;
  return out;
}

void ClientSession::mask(const pb::SecAggInbox& inbox, std::vector<uint64_t>& x) {
  const std::string what = cat("secure aggregation inbox of round ", round_);
  POLLEN_CHECK(stage_ == Stage::shared, what, ": shares were not sent first");
  // Checked before the session keeps any of it: a refused inbox changes nothing.
  std::set<std::string> senders;
  for (const auto& s : inbox.senders()) {
    index_of(s, what);
    POLLEN_CHECK(senders.insert(s).second, what, ": '", s, "' listed twice");
  }
  POLLEN_CHECK(senders.count(id_), what, ": this client is not among the senders");
  std::set<std::string> expected;
  for (size_t v : neighbours_) {
    if (senders.count(ids_[v])) expected.insert(ids_[v]);
  }
  POLLEN_CHECK(expected.size() + 1 >= threshold_, what, ": only ", expected.size() + 1,
               " holders of this client's shares remain, fewer than the threshold ", threshold_);
  POLLEN_CHECK(static_cast<size_t>(inbox.shares_size()) == expected.size(), what, ": ",
               inbox.shares_size(), " shares, expected one from each of ", expected.size(),
               " neighbours");
  std::map<std::string, Held> received;
  for (const auto& s : inbox.shares()) {
    const std::string from = s.peer();
    POLLEN_CHECK(expected.count(from) && !received.count(from), what, ": unexpected share from '",
                 from.substr(0, kMaxIdBytes), "'");
    POLLEN_CHECK(s.ciphertext().size() == kShareCiphertextBytes, what, ": share from '", from,
                 "' has ", s.ciphertext().size(), " bytes, expected ", kShareCiphertextBytes);
    const size_t v = index_of(from, what);
    const Key32 key = share_key(cipher_.secret, cipher_keys_[v], cat("cipher key of '", from, "'"));
    const std::string plain = open(key, share_aad(round_, from, id_), s.ciphertext(),
                                   cat(what, ", share from '", from, "'"));
    const auto x_me = static_cast<uint32_t>(me_ + 1);
    received[from] = {share_from(x_me, plain.substr(0, kShareBytes), what),
                      share_from(x_me, plain.substr(kShareBytes), what)};
  }
  senders_ = std::move(senders);
  held_.merge(received);
  add_mask(self_mask_seed(self_seed_, round_, id_), +1, options_.ring_bits, x.data(), x.size());
  for (size_t v : neighbours_) {
    if (!senders_.count(ids_[v])) continue;  // it never shared: nobody masks with it
    const Key32 seed = pairwise_seed(mask_.secret, mask_keys_[v], round_, id_, ids_[v]);
    add_mask(seed, id_ < ids_[v] ? +1 : -1, options_.ring_bits, x.data(), x.size());
  }
  stage_ = Stage::masked;
}

pb::SecAggReveal ClientSession::reveal(const pb::SecAggSurvivors& list) {
  const std::string what = cat("secure aggregation survivors of round ", round_);
  POLLEN_CHECK(stage_ == Stage::masked, what, ": no masked input was sent");
  std::set<std::string> survivors, dropped;
  for (const auto& s : list.survivors()) {
    POLLEN_CHECK(senders_.count(s) && survivors.insert(s).second, what, ": survivor '",
                 s.substr(0, kMaxIdBytes), "' did not share keys or is listed twice");
  }
  for (const auto& s : list.dropped()) {
    POLLEN_CHECK(senders_.count(s) && !survivors.count(s) && dropped.insert(s).second, what,
                 ": dropped '", s.substr(0, kMaxIdBytes),
                 "' did not share keys, is listed twice or also survived");
  }
  // Every sender is one or the other, so no secret can be asked for in both forms.
  POLLEN_CHECK(survivors.size() + dropped.size() == senders_.size(), what,
               ": survivors and dropped must together be every client that shared keys");
  POLLEN_CHECK(survivors.count(id_), what, ": this client is not among the survivors");
  POLLEN_CHECK(survivors.size() >= threshold_, what, ": ", survivors.size(),
               " survivors, fewer than the threshold ", threshold_);
  pb::SecAggReveal out;
  for (const auto& [owner, held] : held_) {
    auto* r = survivors.count(owner) ? out.add_self_mask_shares() : out.add_mask_key_shares();
    r->set_owner(owner);
    r->set_share(share_bytes(survivors.count(owner) ? held.self_mask : held.mask_key));
  }
  held_.clear();
  stage_ = Stage::revealed;
  return out;
}

}  // namespace pollen::fed::secagg
