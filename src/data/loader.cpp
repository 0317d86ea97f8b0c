#include "data/loader.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <set>

#include "base/error.h"
#include "base/log.h"
#include "base/rng.h"
#include "data/shards.h"

namespace pollen::data {

nlohmann::json LoaderState::to_json() const {
  return {{"seed", seed}, {"epoch", epoch}, {"cursor", cursor}};
}

LoaderState LoaderState::from_json(const nlohmann::json& j) {
  LoaderState s;
  try {
    s.seed = j.at("seed").get<uint64_t>();
    s.epoch = j.at("epoch").get<uint64_t>();
    s.cursor = j.at("cursor").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    fail("loader state: expected {\"seed\", \"epoch\", \"cursor\"} as integers: ", e.what());
  }
  return s;
}

struct Loader::Dataset {
  std::filesystem::path manifest;
  std::vector<std::unique_ptr<ShardReader>> shards;
  std::vector<uint64_t> bases;   // first token of each shard in the stream, plus the total
  std::vector<uint64_t> starts;  // document starts in the stream, plus the total
  uint64_t num_tokens = 0;
  int64_t num_windows = 0;

  void read(uint64_t begin, int64_t n, std::vector<int32_t>& out) const {
    out.resize(static_cast<size_t>(n));
    size_t s =
        static_cast<size_t>(std::upper_bound(bases.begin(), bases.end(), begin) - bases.begin()) -
        1;
    for (int64_t i = 0; i < n; ++i) {
      uint64_t g = begin + static_cast<uint64_t>(i);
      while (g >= bases[s + 1]) ++s;
      out[static_cast<size_t>(i)] =
          static_cast<int32_t>(shards[s]->token(static_cast<int64_t>(g - bases[s])));
    }
  }
};

namespace {

// The fingerprint of the tokenizer that wrote a manifest's tokens ("" when it records none).
std::string tokenizer_fingerprint(const Manifest& m) {
  const auto& t = m.json.value("tokenizer", nlohmann::json::object());
  return t.is_object() ? t.value("fingerprint", std::string()) : std::string();
}

// 'a', 'b' or "none".
std::string quoted_list(const std::set<std::string>& names) {
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "'" : ", '") + n + "'";
  return list.empty() ? "none" : list;
}

}  // namespace

void check_tokenized_by(const Manifest& m, const std::string& fingerprint,
                        const std::string& tokenizer) {
  const std::string wrote = tokenizer_fingerprint(m);
  POLLEN_CHECK(wrote.empty() || wrote == fingerprint, "manifest '", m.path.string(),
               "' was tokenized by tokenizer ", wrote.substr(0, 16), ", not by the model's '",
               tokenizer, "' (", fingerprint.substr(0, 16),
               "): its ids would be read as other tokens; prepare the data with the model's "
               "tokenizer");
}

void check_same_tokens(const Manifest& a, const Manifest& b) {
  for (const Manifest* m : {&a, &b})
    POLLEN_CHECK(m->vocab_size > 0, "manifest '", m->path.string(),
                 "' holds no tokens (prepared without [tokenize])");
  const auto fingerprint = tokenizer_fingerprint;
  const auto eos = [](const Manifest& m) { return m.json.value("eos_id", nlohmann::json()); };
  // One without an end token appended (add_eos off) mixes with one with.
  const bool same_eos = eos(a).is_null() || eos(b).is_null() || eos(a) == eos(b);
  POLLEN_CHECK(a.vocab_size == b.vocab_size && fingerprint(a) == fingerprint(b) && same_eos,
               "manifest '", b.path.string(), "' (vocab_size ", b.vocab_size, ", tokenizer ",
               fingerprint(b).substr(0, 16), ", eos_id ", eos(b).dump(), ") was tokenized unlike '",
               a.path.string(), "' (vocab_size ", a.vocab_size, ", tokenizer ",
               fingerprint(a).substr(0, 16), ", eos_id ", eos(a).dump(),
               "); data trained or evaluated together must share one tokenizer");
}

Loader::Loader(const LoaderOptions& options) : options_(options) {
  const auto& o = options_;
  POLLEN_CHECK(!o.manifests.empty(), "loader: no manifest given");
  POLLEN_CHECK(o.weights.empty() || o.weights.size() == o.manifests.size(),
               "loader: ", o.weights.size(), " weights for ", o.manifests.size(), " manifests");
  POLLEN_CHECK(o.batch > 0 && o.seq > 0, "loader: batch and seq must be positive");
  POLLEN_CHECK(o.world > 0 && o.rank >= 0 && o.rank < o.world, "loader: rank ", o.rank,
               " is not in [0, ", o.world, ")");
  POLLEN_CHECK(o.batch % o.world == 0, "loader: batch ", o.batch, " is not a multiple of world ",
               o.world);
  const uint64_t wlen = static_cast<uint64_t>(o.seq + 1);
  std::optional<Manifest> first;
  std::set<std::string> split_names;  // of every manifest, named when none holds o.split
  for (const auto& path : o.manifests) {
    Manifest m = Manifest::load(path);
    for (const ShardInfo& s : m.shards) split_names.insert(s.split);
    POLLEN_CHECK(m.vocab_size > 0, "loader: manifest '", path.string(),
                 "' holds no tokens (prepared without [tokenize])");
    if (first) check_same_tokens(*first, m);
    auto d = std::make_unique<Dataset>();
    d->manifest = path;
    d->bases.push_back(0);
    d->starts.push_back(0);
    for (const auto& info : m.split(o.split)) {
      auto r = std::make_unique<ShardReader>(m.dir(), info, m.token_dtype);
      const uint32_t most = r->max_token();
      POLLEN_CHECK(static_cast<int64_t>(most) < m.vocab_size, "shard '",
                   (m.dir() / info.tokens).string(), "' holds token id ", most,
                   ", not below its manifest's vocab_size ", m.vocab_size);
      uint64_t base = d->num_tokens;
      for (size_t i = 1; i < r->doc_starts().size(); ++i)
        d->starts.push_back(base + r->doc_starts()[i]);
      d->num_tokens += static_cast<uint64_t>(r->num_tokens());
      d->bases.push_back(d->num_tokens);
      d->shards.push_back(std::move(r));
    }
    d->num_windows = static_cast<int64_t>(d->num_tokens / wlen);
    const bool weighted_out = !o.weights.empty() && o.weights.at(datasets_.size()) == 0;
    if (o.every_manifest && d->num_windows == 0 && !weighted_out) {
      std::set<std::string> names;
      for (const ShardInfo& s : m.shards) names.insert(s.split);
      fail("loader: manifest '", path.string(), "' has no window of ", wlen, " tokens in its '",
           o.split, "' split (its splits: ", quoted_list(names), ")");
    }
    datasets_.push_back(std::move(d));
    if (!first) first = std::move(m);
  }
  // Windows per epoch and each dataset's share.
  const int64_t total = windows_total();
  POLLEN_CHECK(o.step_batch >= 0 && o.step_batch % o.batch == 0, "loader: step_batch ",
               o.step_batch, " is not a multiple of batch ", o.batch);
  POLLEN_CHECK(total >= step_rows(), "loader: the '", o.split, "' split has ", total,
               " windows of ", wlen, " tokens, fewer than one step of ", step_rows(),
               total == 0 ? cat(" (the manifests' splits: ", quoted_list(split_names), ")") : "");
  per_epoch_.assign(datasets_.size(), 0);
  if (o.weights.empty()) {
    for (size_t i = 0; i < datasets_.size(); ++i) per_epoch_[i] = datasets_[i]->num_windows;
  } else {
    double sum = 0;
    for (double w : o.weights) {
      POLLEN_CHECK(w >= 0, "loader: mixing weights must not be negative");
      sum += w;
    }
    POLLEN_CHECK(sum > 0, "loader: mixing weights sum to zero");
    // Largest remainder, ties to the lower index: the shares add up to `total` exactly.
    std::vector<std::pair<double, size_t>> rema;
    int64_t given = 0;
    for (size_t i = 0; i < datasets_.size(); ++i) {
      double exact = o.weights[i] / sum * static_cast<double>(total);
      per_epoch_[i] = static_cast<int64_t>(exact);
      given += per_epoch_[i];
      rema.push_back({exact - static_cast<double>(per_epoch_[i]), i});
    }
    std::stable_sort(rema.begin(), rema.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    for (size_t k = 0; given < total; ++k, ++given) per_epoch_[rema[k % rema.size()].second]++;
    for (size_t i = 0; i < datasets_.size(); ++i)
      POLLEN_CHECK(per_epoch_[i] == 0 || datasets_[i]->num_windows > 0, "loader: manifest '",
                   o.manifests[i].string(), "' has weight ", o.weights[i], " but no '", o.split,
                   "' window of ", wlen, " tokens");
  }
  state_.seed = o.seed;
}

Loader::~Loader() = default;

int64_t Loader::count_windows(const LoaderOptions& o) {
  const auto wlen = static_cast<uint64_t>(o.seq + 1);
  int64_t total = 0;
  for (const auto& path : o.manifests) {
    uint64_t tokens = 0;
    for (const auto& info : Manifest::load(path).split(o.split))
      tokens += static_cast<uint64_t>(info.num_tokens);
    total += static_cast<int64_t>(tokens / wlen);  // as the constructor's num_windows
  }
  return total;
}

int64_t Loader::windows_per_epoch() const {
  return std::accumulate(per_epoch_.begin(), per_epoch_.end(), int64_t{0});
}
int64_t Loader::tokens_per_epoch() const {
  return windows_per_epoch() * options_.seq;
}

void Loader::build_epoch() {
  if (built_epoch_ == state_.epoch && built_seed_ == state_.seed) return;
  Rng root(state_.seed);
  Rng epoch_rng = root.fork(state_.epoch);
  order_.clear();
  order_.reserve(static_cast<size_t>(windows_per_epoch()));
  for (size_t d = 0; d < datasets_.size(); ++d) {
    const uint64_t n = static_cast<uint64_t>(datasets_[d]->num_windows);
    uint64_t want = static_cast<uint64_t>(per_epoch_[d]);
    // Whole passes over the dataset, then a random subset for the remainder.
    for (; want >= n && n > 0; want -= n)
      for (uint64_t w = 0; w < n; ++w) order_.push_back({static_cast<uint32_t>(d), w});
    if (want > 0) {
      Rng sub = epoch_rng.fork(1 + d);
      std::vector<uint64_t> idx(n);
      std::iota(idx.begin(), idx.end(), uint64_t{0});
      for (uint64_t i = 0; i < want; ++i) {
        std::swap(idx[i], idx[i + sub.below(n - i)]);
        order_.push_back({static_cast<uint32_t>(d), idx[i]});
      }
    }
  }
  Rng shuffle = epoch_rng.fork(0);
  for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[shuffle.below(i)]);
  built_epoch_ = state_.epoch;
  built_seed_ = state_.seed;
}

void Loader::fill_row(const Entry& e, int64_t row, model::Batch& b) const {
  const Dataset& d = *datasets_[e.dataset];
  const int64_t T = options_.seq;
  const uint64_t s = e.window * static_cast<uint64_t>(T + 1);
  thread_local std::vector<int32_t> w;
  d.read(s, T + 1, w);
  int32_t* tok = b.tokens.data<int32_t>() + row * T;
  int32_t* tgt = b.targets.data<int32_t>() + row * T;
  int32_t* pos = b.positions.data<int32_t>() + row * T;
  int32_t* doc = b.doc_ids.data<int32_t>() + row * T;
  const auto& st = d.starts;
  size_t k = static_cast<size_t>(std::upper_bound(st.begin(), st.end(), s) - st.begin());
  int32_t p = 0, id = 0;
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t g = s + static_cast<uint64_t>(t);
    if (t > 0 && k < st.size() && st[k] == g) {
      p = 0;
      ++id;
      while (k < st.size() && st[k] == g) ++k;
    }
    tok[t] = w[static_cast<size_t>(t)];
    pos[t] = p++;
    doc[t] = id;
    const bool boundary = k < st.size() && st[k] == g + 1;
    tgt[t] = boundary ? -100 : w[static_cast<size_t>(t + 1)];
  }
}

model::Batch Loader::next() {
  const int64_t B = options_.batch;
  const auto step = static_cast<uint64_t>(step_rows());
  if (state_.cursor % step == 0 &&
      state_.cursor + step > static_cast<uint64_t>(windows_per_epoch())) {
    state_.epoch++;
    state_.cursor = 0;
  }
  build_epoch();
  const int64_t rows = B / options_.world;
  const int64_t first = options_.rank * rows;
  model::Batch b = empty_batch(rows);
  for (int64_t r = 0; r < rows; ++r)
    fill_row(order_[static_cast<size_t>(static_cast<int64_t>(state_.cursor) + first + r)], r, b);
  state_.cursor += static_cast<uint64_t>(B);
  return b;
}

model::Batch Loader::empty_batch(int64_t rows) const {
  model::Batch b;
  const Shape shape{rows, options_.seq};
  b.tokens = Tensor::empty(shape, DType::i32);
  b.targets = Tensor::empty(shape, DType::i32);
  b.positions = Tensor::empty(shape, DType::i32);
  b.doc_ids = Tensor::empty(shape, DType::i32);
  return b;
}

int64_t Loader::windows_total() const {
  int64_t total = 0;
  for (const auto& d : datasets_) total += d->num_windows;
  return total;
}

model::Batch Loader::windows(const std::vector<int64_t>& windows) const {
  model::Batch b = empty_batch(static_cast<int64_t>(windows.size()));
  const int64_t total = windows_total();
  for (size_t r = 0; r < windows.size(); ++r) {
    int64_t id = windows[r];
    POLLEN_CHECK(id >= 0 && id < total, "loader: window ", id, " is not in [0, ", total, ")");
    uint32_t d = 0;
    while (id >= datasets_[d]->num_windows) id -= datasets_[d++]->num_windows;
    fill_row({d, static_cast<uint64_t>(id)}, static_cast<int64_t>(r), b);
  }
  return b;
}

int64_t Loader::step_rows() const {
  return options_.step_batch > 0 ? options_.step_batch : options_.batch;
}

LoaderState Loader::state() const {
  return state_;
}

void Loader::restore(const LoaderState& s) {
  POLLEN_CHECK(s.cursor <= static_cast<uint64_t>(windows_per_epoch()), "loader state: cursor ",
               s.cursor, " is past the epoch's ", windows_per_epoch(), " windows");
  state_ = s;
  if (state_.cursor % static_cast<uint64_t>(step_rows()) != 0) {
    // Saved before epochs ended between steps: the next epoch starts now, so that from here on
    // every step reads one epoch's windows.
    log::warn_job("loader: resumed at window ", state_.cursor, " of epoch ", state_.epoch,
                  ", not between steps of ", step_rows(), " rows; starting epoch ",
                  state_.epoch + 1);
    state_.epoch++;
    state_.cursor = 0;
  }
}

}  // namespace pollen::data
