#include "eval/multiple_choice.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "autograd/tape.h"
#include "base/error.h"
#include "base/json_depth.h"
#include "base/rng.h"
#include "ops/gemm.h"

namespace pollen::eval {
namespace {

// Python's str.isspace() for one code point.
bool is_python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

// The last code point of non-empty UTF-8 text and how many bytes it takes.
std::pair<uint32_t, size_t> last_code_point(std::string_view s) {
  size_t start = s.size() - 1;
  while (start > 0 && s.size() - start < 4 && (static_cast<uint8_t>(s[start]) & 0xc0) == 0x80)
    --start;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data() + start);
  const size_t n = s.size() - start;
  uint32_t cp = p[0];
  if (n == 2 && (p[0] & 0xe0) == 0xc0)
    cp = ((p[0] & 0x1fu) << 6) | (p[1] & 0x3fu);
  else if (n == 3 && (p[0] & 0xf0) == 0xe0)
    cp = ((p[0] & 0x0fu) << 12) | ((p[1] & 0x3fu) << 6) | (p[2] & 0x3fu);
  else if (n == 4 && (p[0] & 0xf8) == 0xf0)
    cp = ((p[0] & 0x07u) << 18) | ((p[1] & 0x3fu) << 12) | ((p[2] & 0x3fu) << 6) | (p[3] & 0x3fu);
  else if (n != 1)
    return {0xfffd, 1};  // a stray continuation byte
  return {cp, n};
}

int64_t argmax(const std::vector<double>& v) {
  return static_cast<int64_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// lm-evaluation-harness's mean_stderr: sample standard deviation / sqrt(n).
std::optional<double> mean_stderr(const std::vector<double>& x) {
  const size_t n = x.size();
  if (n < 2) return std::nullopt;
  const double mean = std::accumulate(x.begin(), x.end(), 0.0) / static_cast<double>(n);
  double ss = 0;
  for (double v : x) ss += (v - mean) * (v - mean);
  return std::sqrt(ss / static_cast<double>(n - 1)) / std::sqrt(static_cast<double>(n));
}

// Refuses, naming the item's line and choice, a pair that continuation_logprobs could not score.
void check_pair(const model::Llama& model, const TokenPair& p, int64_t max_len,
                const std::string& where) {
  POLLEN_CHECK(static_cast<int64_t>(p.continuation.size()) <= max_len, where, ": the choice is ",
               p.continuation.size(), " tokens, more than the window of ", max_len,
               " (--window) can score");
  const int64_t V = model.config().vocab_size;
  for (const auto* part : {&p.context, &p.continuation})
    for (uint32_t t : *part)
      POLLEN_CHECK(t < static_cast<uint64_t>(V), where, ": token id ", t,
                   " is outside the model's vocabulary of ", V, " (a tokenizer of another model?)");
}

}  // namespace

std::vector<ChoiceItem> read_choice_items(const std::filesystem::path& jsonl) {
  std::ifstream in(jsonl);
  POLLEN_CHECK(in.good(), "cannot open task file '", jsonl.string(), "'");
  std::vector<ChoiceItem> items;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = cat("'", jsonl.string(), "' line ", n);
    const nlohmann::json j = parse_json_object(line, where);
    POLLEN_CHECK(j.contains("context") && j["context"].is_string(), where,
                 ": \"context\" must be a string");
    POLLEN_CHECK(j.contains("choices") && j["choices"].is_array() && !j["choices"].empty(), where,
                 ": \"choices\" must be a non-empty list of strings");
    POLLEN_CHECK(j.contains("gold") && j["gold"].is_number_integer(), where,
                 ": \"gold\" must be an integer index into choices");
    ChoiceItem item;
    item.where = where;
    item.context = j["context"].get<std::string>();
    for (const auto& c : j["choices"]) {
      POLLEN_CHECK(c.is_string(), where, ": \"choices\" must be a list of strings");
      item.choices.push_back(c.get<std::string>());
    }
    POLLEN_CHECK(j["gold"].is_number_unsigned() &&
                     j["gold"].get<uint64_t>() < static_cast<uint64_t>(item.choices.size()),
                 where, ": \"gold\" is ", j["gold"].dump(), ", outside the ", item.choices.size(),
                 " choices");
    item.gold = j["gold"].get<int64_t>();
    items.push_back(std::move(item));
  }
  POLLEN_CHECK(!items.empty(), "task file '", jsonl.string(), "' holds no items");
  return items;
}

std::string fewshot_prefix(std::span<const ChoiceItem* const> examples) {
  std::string out;
  for (const ChoiceItem* e : examples)
    out += e->context + " " + e->choices[static_cast<size_t>(e->gold)] + "\n\n";
  return out;
}

std::vector<const ChoiceItem*> pick_fewshot(std::span<const ChoiceItem> pool,
                                            const ChoiceItem& item, int64_t index, int64_t count,
                                            uint64_t seed) {
  std::vector<size_t> candidates;
  for (size_t i = 0; i < pool.size(); ++i)
    if (pool[i].context != item.context || pool[i].choices != item.choices ||
        pool[i].gold != item.gold)
      candidates.push_back(i);
  POLLEN_CHECK(count <= static_cast<int64_t>(candidates.size()), "few-shot: ", count,
               " examples asked for, the pool has ", candidates.size());
  Rng rng = Rng(seed).fork(static_cast<uint64_t>(index));
  std::vector<const ChoiceItem*> out;
  for (int64_t k = 0; k < count; ++k) {  // a partial Fisher-Yates shuffle
    const size_t j = static_cast<size_t>(k) + rng.below(candidates.size() - static_cast<size_t>(k));
    std::swap(candidates[static_cast<size_t>(k)], candidates[j]);
    out.push_back(&pool[candidates[static_cast<size_t>(k)]]);
  }
  return out;
}

TokenPair encode_pair(const tokenizer::Tokenizer& tok, std::string_view context,
                      std::string_view continuation, std::optional<uint32_t> prefix) {
  tokenizer::EncodeOptions eo;
  eo.special = tokenizer::SpecialPolicy::allow_all();  // HF tokenizers match special tokens
  TokenPair out;
  const auto prefix_token = [&] {
    POLLEN_CHECK(prefix.has_value(),
                 "an empty context stands for the prefix token (BOS, else EOS), which this "
                 "tokenizer does not have");
    return *prefix;
  };
  if (context.empty()) {
    out.context = {prefix_token()};
    out.continuation = tok.encode(continuation, eo);
    return out;
  }
  size_t cut = context.size();
  while (cut > 0) {
    const auto [cp, bytes] = last_code_point(context.substr(0, cut));
    if (!is_python_space(cp)) break;
    cut -= bytes;
  }
  const std::string whole = std::string(context) + std::string(continuation);
  if (cut == 0) {  // a context of whitespace alone: nothing is left to predict the first token
    out.context = {prefix_token()};
    out.continuation = tok.encode(whole, eo);
    return out;
  }
  out.context = tok.encode(context.substr(0, cut), eo);
  const std::vector<uint32_t> all = tok.encode(whole, eo);
  if (all.size() > out.context.size())
    out.continuation.assign(all.begin() + static_cast<std::ptrdiff_t>(out.context.size()),
                            all.end());
  return out;
}

std::vector<double> continuation_logprobs(const model::Llama& model,
                                          std::span<const TokenPair> pairs, int64_t max_len,
                                          int64_t batch,
                                          const std::function<void(size_t, size_t)>& on_batch) {
  POLLEN_CHECK(max_len >= 1 && batch >= 1, "continuation scores: max_len and batch must be >= 1");
  const int64_t V = model.config().vocab_size;
  // inputs[i] = (context + continuation)[-(max_len + 1):][:-1]; its last `scored` positions
  // predict the continuation.
  std::vector<std::vector<uint32_t>> inputs(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    const TokenPair& p = pairs[i];
    POLLEN_CHECK(!p.continuation.empty(), "continuation scores: pair ", i,
                 " has a continuation of no tokens");
    POLLEN_CHECK(!p.context.empty(), "continuation scores: pair ", i,
                 " has a context of no tokens (the prefix token stands for an empty one)");
    POLLEN_CHECK(static_cast<int64_t>(p.continuation.size()) <= max_len,
                 "continuation scores: pair ", i, " has ", p.continuation.size(),
                 " continuation tokens, over max_len ", max_len);
    std::vector<uint32_t> all = p.context;
    all.insert(all.end(), p.continuation.begin(), p.continuation.end());
    const size_t keep = std::min(all.size(), static_cast<size_t>(max_len) + 1);
    inputs[i].assign(all.end() - static_cast<std::ptrdiff_t>(keep), all.end() - 1);
    for (uint32_t t : all)
      POLLEN_CHECK(t < static_cast<uint64_t>(V), "token id ", t,
                   " is outside the model's vocabulary of ", V);
  }
  std::vector<size_t> order(pairs.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return inputs[a].size() > inputs[b].size(); });

  ag::NoGrad no_grad;
  std::vector<double> out(pairs.size(), 0.0);
  for (size_t begin = 0; begin < order.size(); begin += static_cast<size_t>(batch)) {
    const size_t end = std::min(order.size(), begin + static_cast<size_t>(batch));
    const int64_t B = static_cast<int64_t>(end - begin);
    const int64_t T = static_cast<int64_t>(inputs[order[begin]].size());
    // (B, T) rows, each its own document; the padding after it a document of its own.
    std::vector<int32_t> tokens(static_cast<size_t>(B * T), 0), positions(tokens.size(), 0),
        docs(tokens.size(), 1);
    std::vector<int64_t> scored_rows;  // positions in (B*T) whose next token is scored
    std::vector<uint32_t> targets;
    for (int64_t r = 0; r < B; ++r) {
      const size_t i = order[begin + static_cast<size_t>(r)];
      const auto& in = inputs[i];
      const int64_t t = static_cast<int64_t>(in.size());
      for (int64_t k = 0; k < t; ++k) {
        tokens[static_cast<size_t>(r * T + k)] = static_cast<int32_t>(in[static_cast<size_t>(k)]);
        positions[static_cast<size_t>(r * T + k)] = static_cast<int32_t>(k);
        docs[static_cast<size_t>(r * T + k)] = 0;
      }
      const auto& cont = pairs[i].continuation;
      const int64_t n = static_cast<int64_t>(cont.size());
      for (int64_t j = 0; j < n; ++j) {
        scored_rows.push_back(r * T + t - n + j);
        targets.push_back(cont[static_cast<size_t>(j)]);
      }
    }
    model::Batch b;
    b.tokens = Tensor::from({B, T}, tokens);
    b.targets = b.tokens;
    b.positions = Tensor::from({B, T}, positions);
    b.doc_ids = Tensor::from({B, T}, docs);
    const Tensor h = model.hidden_states(b).value();  // (B*T, C)
    const int64_t C = h.size(1), n = static_cast<int64_t>(scored_rows.size());
    Tensor picked = Tensor::empty({n, C}, DType::f32);  // the scored positions' states
    for (int64_t k = 0; k < n; ++k)
      std::memcpy(picked.data<float>() + k * C,
                  h.data<float>() + scored_rows[static_cast<size_t>(k)] * C,
                  sizeof(float) * static_cast<size_t>(C));
    Tensor logits = Tensor::empty({n, V}, DType::f32);  // (n, V)
    ops::gemm(picked, false, model.head_weight().value(), true, logits);
    size_t k = 0;
    for (int64_t r = 0; r < B; ++r) {
      const size_t i = order[begin + static_cast<size_t>(r)];
      double sum = 0;
      for (size_t j = 0; j < pairs[i].continuation.size(); ++j, ++k) {
        const float* z = logits.data<float>() + static_cast<int64_t>(k) * V;
        double best = z[0];
        for (int64_t v = 1; v < V; ++v) best = std::max(best, static_cast<double>(z[v]));
        double total = 0;
        for (int64_t v = 0; v < V; ++v) total += std::exp(static_cast<double>(z[v]) - best);
        POLLEN_CHECK(!std::isnan(total), "scoring: the model's logits hold NaN");
        sum += static_cast<double>(z[targets[k]]) - best - std::log(total);
      }
      out[i] = sum;
    }
    if (on_batch) on_batch(end, order.size());
  }
  return out;
}

int64_t char_length(std::string_view text) {
  int64_t n = 0;
  for (char c : text)
    if ((static_cast<uint8_t>(c) & 0xc0) != 0x80) ++n;
  return n;
}

ItemResult judge(const ChoiceItem& item, std::vector<double> logprobs) {
  POLLEN_ASSERT(logprobs.size() == item.choices.size());
  ItemResult r;
  r.logprobs = std::move(logprobs);
  std::vector<double> normalised;
  for (size_t c = 0; c < item.choices.size(); ++c) {
    r.lengths.push_back(char_length(item.choices[c]));
    normalised.push_back(r.logprobs[c] / static_cast<double>(r.lengths.back()));
  }
  r.pred = argmax(r.logprobs);
  r.pred_norm = argmax(normalised);
  r.correct = r.pred == item.gold;
  r.correct_norm = r.pred_norm == item.gold;
  return r;
}

ChoiceMetrics summarize(std::span<const ItemResult> items) {
  std::vector<double> acc, acc_norm;
  for (const ItemResult& r : items) {
    acc.push_back(r.correct ? 1.0 : 0.0);
    acc_norm.push_back(r.correct_norm ? 1.0 : 0.0);
  }
  ChoiceMetrics m;
  m.items = static_cast<int64_t>(items.size());
  if (items.empty()) return m;
  m.acc = std::accumulate(acc.begin(), acc.end(), 0.0) / static_cast<double>(m.items);
  m.acc_norm =
      std::accumulate(acc_norm.begin(), acc_norm.end(), 0.0) / static_cast<double>(m.items);
  m.acc_stderr = mean_stderr(acc);
  m.acc_norm_stderr = mean_stderr(acc_norm);
  return m;
}

ChoiceEvalResult evaluate_choices(const model::Llama& model, const tokenizer::Tokenizer& tok,
                                  std::span<const ChoiceItem> items, const ChoiceEvalOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  ChoiceEvalResult result;
  const std::span<const ChoiceItem> pool = o.fewshot_pool.empty() ? items : o.fewshot_pool;
  std::vector<TokenPair> pairs;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto examples = pick_fewshot(pool, items[i], static_cast<int64_t>(i), o.fewshot, o.seed);
    result.contexts.push_back(fewshot_prefix(examples) + items[i].context);
    const std::string where = items[i].where.empty() ? cat("item ", i) : items[i].where;
    for (size_t c = 0; c < items[i].choices.size(); ++c) {
      try {
        pairs.push_back(
            encode_pair(tok, result.contexts.back(), " " + items[i].choices[c], o.prefix));
      } catch (const Error& e) {
        fail(where, ": ", e.what());
      }
      check_pair(model, pairs.back(), o.max_len, cat(where, " choice ", c));
    }
  }
  const std::vector<double> scores =
      continuation_logprobs(model, pairs, o.max_len, o.batch, o.on_batch);
  size_t at = 0;
  for (const ChoiceItem& item : items) {
    std::vector<double> lps(scores.begin() + static_cast<std::ptrdiff_t>(at),
                            scores.begin() + static_cast<std::ptrdiff_t>(at + item.choices.size()));
    at += item.choices.size();
    result.items.push_back(judge(item, std::move(lps)));
  }
  result.metrics = summarize(result.items);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace pollen::eval
