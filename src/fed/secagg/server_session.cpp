// The server's side of one secure-aggregation round (session.h).
#include <algorithm>
#include <cstring>

#include "base/error.h"
#include "base/log.h"
#include "fed/secagg/graph.h"
#include "fed/secagg/quantize.h"
#include "fed/secagg/session.h"
#include "fed/wire.h"

namespace pollen::fed::secagg {

ServerSession::ServerSession(int64_t round, std::vector<std::string> selected, Options options,
                             uint64_t graph_seed, int64_t numel)
    : round_(round),
      selected_(std::move(selected)),
      options_(std::move(options)),
      graph_seed_(graph_seed),
      numel_(numel) {
  std::sort(selected_.begin(), selected_.end());
  masked_sum_.assign(static_cast<size_t>(numel_), 0);
}

const char* ServerSession::phase_name(Phase p) {
  switch (p) {
    case Phase::advertise:
      return "advertise";
    case Phase::share:
      return "share";
    case Phase::input:
      return "input";
    case Phase::unmask:
      return "unmask";
    case Phase::done:
      return "done";
    case Phase::failed:
      return "failed";
  }
  return "?";
}

size_t ServerSession::index_of(const std::string& id) const {
  const auto it = std::lower_bound(ids_.begin(), ids_.end(), id);
  POLLEN_ASSERT(it != ids_.end() && *it == id);
  return static_cast<size_t>(it - ids_.begin());
}

std::vector<size_t> ServerSession::holders(size_t u) const {
  std::vector<size_t> h = graph_[u];
  h.push_back(u);
  return h;
}

void ServerSession::fail_round(std::string why) {
  phase_ = Phase::failed;
  failure_ = cat("secure aggregation of round ", round_, " failed: ", why);
  log::warn("fed server: ", failure_);
}

bool ServerSession::masks_a_survivor(const std::string& u) const {
  for (size_t v : graph_[index_of(u)]) {
    if (inputs_.count(ids_[v])) return true;
  }
  return false;
}

bool ServerSession::expects(const std::string& id) const {
  if (dropped_out_.count(id)) return false;
  switch (phase_) {
    case Phase::advertise:
      return std::binary_search(selected_.begin(), selected_.end(), id) && !keys_.count(id);
    case Phase::share:
      return std::binary_search(ids_.begin(), ids_.end(), id) && !sharers_.count(id);
    case Phase::input:
      return sharers_.count(id) && !inputs_.count(id);
    case Phase::unmask:
      return inputs_.count(id) && !revealers_.count(id);
    default:
      return false;
  }
}

namespace {
void check_phase(ServerSession::Phase now, ServerSession::Phase want, const std::string& what) {
  POLLEN_CHECK(now == want, what, ": secure aggregation is in phase '",
               ServerSession::phase_name(now), "', not '", ServerSession::phase_name(want), "'");
}
}  // namespace

void ServerSession::advertise(const std::string& id, const pb::SecAggKeys& keys) {
  const std::string what = cat("secure aggregation keys from '", id, "'");
  check_phase(phase_, Phase::advertise, what);
  POLLEN_CHECK(expects(id), what, ": not selected for round ", round_, " or already advertised");
  POLLEN_CHECK(keys.client_id() == id, what, ": the keys name client '",
               keys.client_id().substr(0, kMaxIdBytes), "'");
  const Key32 c = key_from(keys.cipher_public_key(), cat(what, ", cipher_public_key"));
  const Key32 m = key_from(keys.mask_public_key(), cat(what, ", mask_public_key"));
  POLLEN_CHECK(c != m, what, ": the two public keys must differ");
  // A low-order key (all zeros, say) would make every neighbour's agreement with it fail in the
  // share phase, failing the round without naming anyone: a throwaway agreement finds it here,
  // and the client is left out unless it sends valid keys in time.
  const KeyPair probe = KeyPair::generate();
  agree(probe.secret, c, cat(what, ", cipher_public_key"));
  agree(probe.secret, m, cat(what, ", mask_public_key"));
  keys_[id] = keys;
}

pb::SecAggRoster ServerSession::roster(const std::string& id) const {
  const std::string what = cat("secure aggregation roster for '", id, "'");
  check_phase(phase_, Phase::share, what);
  POLLEN_CHECK(std::binary_search(ids_.begin(), ids_.end(), id), what,
               ": it sent no keys in time for round ", round_);
  pb::SecAggRoster r;
  for (const auto& i : ids_) *r.add_clients() = keys_.at(i);
  auto* p = r.mutable_params();
  p->set_threshold(static_cast<uint32_t>(threshold_));
  p->set_neighbours(static_cast<uint32_t>(options_.neighbours));
  p->set_graph_seed(graph_seed_);
  p->set_ring_bits(static_cast<uint32_t>(options_.ring_bits));
  p->set_range(options_.range);
  p->set_step(options_.step);
  p->set_stochastic(options_.stochastic);
  return r;
}

void ServerSession::shares(const std::string& id, const pb::SecAggShares& shares) {
  const std::string what = cat("secure aggregation shares from '", id, "'");
  check_phase(phase_, Phase::share, what);
  POLLEN_CHECK(expects(id), what, ": not in the roster of round ", round_, " or already shared");
  const size_t u = index_of(id);
  std::set<std::string> want;
  for (size_t v : graph_[u]) want.insert(ids_[v]);
  POLLEN_CHECK(static_cast<size_t>(shares.shares_size()) == want.size(), what, ": ",
               shares.shares_size(), " shares, expected one for each of its ", want.size(),
               " neighbours");
  std::map<std::string, std::string> got;
  for (const auto& s : shares.shares()) {
    POLLEN_CHECK(want.count(s.peer()) && !got.count(s.peer()), what, ": a share for '",
                 s.peer().substr(0, kMaxIdBytes), "', not a neighbour or twice");
    POLLEN_CHECK(s.ciphertext().size() == kShareCiphertextBytes, what, ": the share for '",
                 s.peer(), "' has ", s.ciphertext().size(), " bytes, expected ",
                 kShareCiphertextBytes);
    got[s.peer()] = s.ciphertext();
  }
  for (auto& [to, c] : got) ciphertexts_[to][id] = std::move(c);
  sharers_.insert(id);
}

pb::SecAggInbox ServerSession::inbox(const std::string& id) const {
  const std::string what = cat("secure aggregation inbox for '", id, "'");
  check_phase(phase_, Phase::input, what);
  POLLEN_CHECK(sharers_.count(id), what, ": it sent no shares in time for round ", round_);
  pb::SecAggInbox box;
  for (const auto& s : sharers_) box.add_senders(s);
  const auto it = ciphertexts_.find(id);
  if (it != ciphertexts_.end()) {
    for (const auto& [from, c] : it->second) {
      if (!sharers_.count(from)) continue;
      auto* s = box.add_shares();
      s->set_peer(from);
      s->set_ciphertext(c);
    }
  }
  return box;
}

void ServerSession::check_input(const std::string& id) const {
  const std::string what = cat("masked update from '", id, "'");
  check_phase(phase_, Phase::input, what);
  POLLEN_CHECK(expects(id), what, ": it sent no shares in time for round ", round_,
               " or already sent its input");
}

void ServerSession::add_input(const std::string& id, const std::string& words) {
  check_input(id);
  const size_t word = static_cast<size_t>(options_.ring_bits) / 8;
  POLLEN_CHECK(words.size() == masked_sum_.size() * word, "masked update from '", id,
               "': ", words.size(), " bytes, expected ", masked_sum_.size() * word);
  const uint64_t mask = ring_mask(options_.ring_bits);
  for (size_t j = 0; j < masked_sum_.size(); ++j) {
    uint64_t w = 0;
    std::memcpy(&w, words.data() + j * word, word);
    masked_sum_[j] = (masked_sum_[j] + w) & mask;
  }
  inputs_.insert(id);
}

pb::SecAggSurvivors ServerSession::survivors(const std::string& id) const {
  const std::string what = cat("secure aggregation survivors for '", id, "'");
  check_phase(phase_, Phase::unmask, what);
  POLLEN_CHECK(inputs_.count(id), what, ": it sent no masked input in round ", round_);
  pb::SecAggSurvivors s;
  for (const auto& i : sharers_) {
    if (inputs_.count(i)) {
      s.add_survivors(i);
    } else {
      s.add_dropped(i);
    }
  }
  return s;
}

void ServerSession::reveal(const std::string& id, const pb::SecAggReveal& reveal) {
  const std::string what = cat("secure aggregation reveal from '", id, "'");
  check_phase(phase_, Phase::unmask, what);
  POLLEN_CHECK(expects(id), what, ": it sent no masked input in round ", round_,
               " or already revealed");
  const size_t v = index_of(id);
  // Exactly the shares it holds: of the self masks of surviving owners, of the mask keys of
  // dropped ones (owners u with v in H(u), u in U2).
  std::set<std::string> want_self, want_key;
  for (const auto& u_id : sharers_) {
    const auto h = holders(index_of(u_id));
    if (std::find(h.begin(), h.end(), v) == h.end()) continue;
    (inputs_.count(u_id) ? want_self : want_key).insert(u_id);
  }
  auto parse = [&](const auto& list, const std::set<std::string>& want, const char* kind) {
    POLLEN_CHECK(static_cast<size_t>(list.size()) == want.size(), what, ": ", list.size(), " ",
                 kind, " shares, expected ", want.size());
    std::map<std::string, Share> out;
    for (const auto& r : list) {
      POLLEN_CHECK(want.count(r.owner()) && !out.count(r.owner()), what, ": unexpected ", kind,
                   " share of '", r.owner().substr(0, kMaxIdBytes), "'");
      out[r.owner()] = share_from(static_cast<uint32_t>(v + 1), r.share(), what);
    }
    return out;
  };
  auto self = parse(reveal.self_mask_shares(), want_self, "self-mask");
  auto keys = parse(reveal.mask_key_shares(), want_key, "mask-key");
  for (auto& [owner, s] : self) self_mask_shares_[owner].push_back(s);
  for (auto& [owner, s] : keys) mask_key_shares_[owner].push_back(s);
  revealers_.insert(id);
}

bool ServerSession::phase_complete() const {
  // Everyone the phase waits for answered or dropped out.
  const auto answered = [&](const auto& ids) {
    return std::none_of(ids.begin(), ids.end(), [&](const std::string& id) { return expects(id); });
  };
  switch (phase_) {
    case Phase::advertise:
      return answered(selected_);
    case Phase::share:
      return answered(ids_);
    case Phase::input:
      return answered(sharers_);
    case Phase::unmask:
      return answered(inputs_);
    default:
      return false;
  }
}

void ServerSession::drop_out(const std::string& id) {
  POLLEN_CHECK(expects(id), "secure aggregation drop-out from '", id, "': phase '",
               phase_name(phase_), "' of round ", round_, " does not wait for it");
  dropped_out_.insert(id);
}

void ServerSession::close_phase() {
  switch (phase_) {
    case Phase::advertise: {
      for (const auto& [id, k] : keys_) ids_.push_back(id);
      if (ids_.size() < 2) {
        return fail_round(cat(ids_.size(), " of ", selected_.size(),
                              " selected clients sent keys; at least 2 are needed"));
      }
      graph_ = neighbour_graph(ids_.size(), options_.neighbours, graph_seed_);
      const size_t holders = graph_[0].size() + 1;
      threshold_ = options_.resolved_threshold(holders);
      if (threshold_ > holders) {
        return fail_round(cat("threshold ", threshold_, " exceeds the ", holders,
                              " holders of each client's shares (", holders - 1,
                              " neighbours and itself) with ", ids_.size(), " clients"));
      }
      phase_ = Phase::share;
      return;
    }
    case Phase::share: {
      for (const auto& u : sharers_) {
        size_t left = 0;
        for (size_t h : holders(index_of(u))) left += sharers_.count(ids_[h]);
        if (left < threshold_) {
          return fail_round(cat("only ", left, " holders of the shares of '", u,
                                "' are left after the share phase, fewer than the threshold ",
                                threshold_));
        }
      }
      if (sharers_.size() < threshold_) {
        return fail_round(
            cat(sharers_.size(), " clients sent shares, fewer than the threshold ", threshold_));
      }
      phase_ = Phase::input;
      return;
    }
    case Phase::input: {
      if (inputs_.empty()) return fail_round("no client sent a masked input");
      if (inputs_.size() < min_inputs_) {
        return fail_round(cat(inputs_.size(), " masked inputs, fewer than min_clients ",
                              min_inputs_, "; nothing is unmasked"));
      }
      // Only the survivors reveal, so every secret the sum needs must have threshold holders
      // among them; otherwise the unmask phase could only wait for its deadline and fail.
      // Failed now, nothing is revealed.
      if (inputs_.size() < threshold_) {
        return fail_round(cat(inputs_.size(), " of the ", sharers_.size(),
                              " clients that shared sent a masked input, fewer than the threshold ",
                              threshold_, "; nothing is revealed"));
      }
      for (const auto& u : sharers_) {
        const bool survived = inputs_.count(u);
        if (!survived && !masks_a_survivor(u)) continue;  // its pairwise masks are in no input
        const auto h = holders(index_of(u));
        const auto left = std::count_if(h.begin(), h.end(), [&](size_t v) {
          return inputs_.count(ids_[v]) > 0;  // only survivors reveal
        });
        if (static_cast<size_t>(left) < threshold_) {
          const char* whose = survived ? "survivor '" : "dropped '";
          return fail_round(cat("only ", left, " of the ", h.size(), " holders of the shares of ",
                                whose, u, "' sent a masked input, fewer than the threshold ",
                                threshold_, "; nothing is revealed"));
        }
      }
      phase_ = Phase::unmask;
      return;
    }
    case Phase::unmask: {
      // Every secret the sum needs must have threshold shares.
      for (const auto& u : sharers_) {
        const bool survived = inputs_.count(u);
        if (!survived && !masks_a_survivor(u)) continue;  // its pairwise masks are in no input
        const auto& got = survived ? self_mask_shares_ : mask_key_shares_;
        const auto it = got.find(u);
        const size_t n = it == got.end() ? 0 : it->second.size();
        if (n < threshold_) {
          return fail_round(
              cat(survived ? "the self mask of survivor '" : "the mask key of dropped '", u,
                  "' has ", n, " revealed shares, fewer than the threshold ", threshold_, " (",
                  revealers_.size(), " of ", inputs_.size(), " survivors answered)"));
        }
      }
      phase_ = Phase::done;
      return;
    }
    default:
      return;
  }
}

std::vector<uint64_t> ServerSession::unmasked_sum() const {
  POLLEN_CHECK(phase_ != Phase::failed, failure_);
  POLLEN_CHECK(phase_ == Phase::done, "secure aggregation of round ", round_,
               ": unmasking asked in phase '", phase_name(phase_), "'");
  std::vector<uint64_t> sum = masked_sum_;
  for (const auto& u : sharers_) {
    const size_t ui = index_of(u);
    if (inputs_.count(u)) {
      const Key32 b =
          reconstruct_secret(self_mask_shares_.at(u), threshold_, cat("self mask of '", u, "'"));
      add_mask(self_mask_seed(b, round_, u), -1, options_.ring_bits, sum.data(), sum.size());
      continue;
    }
    if (!masks_a_survivor(u)) continue;
    const Key32 secret =
        reconstruct_secret(mask_key_shares_.at(u), threshold_, cat("mask key of '", u, "'"));
    const Key32 mask_public = key_from(keys_.at(u).mask_public_key(), "mask key");
    POLLEN_CHECK(public_key_of(secret) == mask_public, "secure aggregation of round ", round_,
                 ": the revealed shares of the mask key of '", u, "' do not match its public key");
    for (size_t vi : graph_[ui]) {
      const std::string& v = ids_[vi];
      if (!inputs_.count(v)) continue;  // only survivors' masks are in the sum
      const Key32 peer = key_from(keys_.at(v).mask_public_key(), "mask key");
      // v added +PRG when v < u: take it away.
      add_mask(pairwise_seed(secret, peer, round_, u, v), v < u ? -1 : +1, options_.ring_bits,
               sum.data(), sum.size());
    }
  }
  return sum;
}

}  // namespace pollen::fed::secagg
