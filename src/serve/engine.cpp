#include "serve/engine.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"

namespace pollen::serve {
namespace {

// log-softmax of one row of logits at `token`, with the `top` most likely tokens.
eval::TokenScore score_logits(std::span<const float> z, uint32_t token, int64_t top) {
  double best = z[0];
  for (float v : z) best = std::max(best, static_cast<double>(v));
  double sum = 0;
  for (float v : z) sum += std::exp(static_cast<double>(v) - best);
  const double lse = best + std::log(sum);
  eval::TokenScore s;
  s.logprob = static_cast<double>(z[token]) - lse;
  std::vector<uint32_t> order(z.size());
  for (uint32_t v = 0; v < order.size(); ++v) order[v] = v;
  const size_t k = std::min(z.size(), static_cast<size_t>(std::max<int64_t>(top, 0)));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](uint32_t a, uint32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  for (size_t i = 0; i < k; ++i)
    s.top.emplace_back(order[i], static_cast<double>(z[order[i]]) - lse);
  return s;
}

}  // namespace

Engine::Engine(const model::Llama& model, const tokenizer::Tokenizer& tok, int64_t max_batch_rows)
    : model_(model), tok_(tok), max_rows_(std::max<int64_t>(1, max_batch_rows)) {
  worker_ = std::thread([this] { work(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
}

std::future<std::vector<SequenceResult>> Engine::submit(
    std::vector<Sequence> sequences, TokenSink sink,
    std::shared_ptr<const std::atomic<bool>> cancelled) {
  auto job = std::make_unique<Job>();
  job->sequences = std::move(sequences);
  job->sink = std::move(sink);
  job->cancelled = std::move(cancelled);
  job->submitted = std::chrono::steady_clock::now();
  auto future = job->done.get_future();
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(job));
  }
  wake_.notify_all();
  return future;
}

Engine::Hold::Hold(Engine& e) : engine_(e) {
  std::lock_guard lock(e.mu_);
  ++e.holds_;
}

Engine::Hold::~Hold() {
  {
    std::lock_guard lock(engine_.mu_);
    --engine_.holds_;
  }
  engine_.wake_.notify_all();
}

int64_t Engine::pending() const {
  std::lock_guard lock(mu_);
  return static_cast<int64_t>(queue_.size());
}

int64_t Engine::largest_batch() const {
  std::lock_guard lock(mu_);
  return largest_;
}

obs::SecondsHistogram Engine::time_to_first_token() const {
  std::lock_guard lock(mu_);
  return first_token_;
}

int64_t Engine::most_rows() const {
  return most_rows_.load();
}

void Engine::work() {
  for (;;) {
    std::vector<std::unique_ptr<Job>> jobs;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || (!queue_.empty() && holds_ == 0); });
      if (stop_) break;
      // Every waiting request that fits; the first one always does.
      int64_t rows = 0;
      while (!queue_.empty()) {
        const int64_t n = static_cast<int64_t>(queue_.front()->sequences.size());
        if (!jobs.empty() && rows + n > max_rows_) break;
        rows += n;
        jobs.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      // Counted before the batch runs: its callers may look as soon as their answers arrive.
      largest_ = std::max(largest_, static_cast<int64_t>(jobs.size()));
    }
    run_batch(jobs);
  }
  // Whatever is still queued at shutdown fails rather than hanging its caller.
  std::lock_guard lock(mu_);
  for (auto& job : queue_)
    job->done.set_exception(std::make_exception_ptr(Error("the server is shutting down")));
}

void Engine::run_batch(std::vector<std::unique_ptr<Job>>& jobs) {
  std::vector<std::vector<SequenceResult>> results(jobs.size());
  try {
    std::vector<model::GenerationRow> rows;
    std::vector<std::pair<size_t, size_t>> owner;  // row -> (job, sequence)
    for (size_t j = 0; j < jobs.size(); ++j) {
      results[j].resize(jobs[j]->sequences.size());
      for (size_t s = 0; s < jobs[j]->sequences.size(); ++s) {
        const Sequence& seq = jobs[j]->sequences[s];
        if (seq.prompt_logprobs)
          results[j][s].prompt_scores =
              eval::sequence_scores(model_, seq.prompt, static_cast<int64_t>(seq.prompt.size()),
                                    seq.top_logprobs, static_cast<int64_t>(tok_.vocab_size()));
        rows.push_back({seq.prompt, seq.options, seq.rng, jobs[j]->cancelled});
        // Only ids the tokenizer can decode (a model's vocabulary may be padded beyond them).
        rows.back().options.vocab_size = static_cast<int64_t>(tok_.vocab_size());
        owner.emplace_back(j, s);
      }
    }
    const auto decode = [this](std::span<const uint32_t> ids) { return tok_.decode(ids); };
    // At most max_rows_ rows at a time: a request of more prompts than that (the first waiting
    // request is always taken whole) runs in turns, so the KV caches never hold more rows.
    const auto step = static_cast<size_t>(max_rows_);
    for (size_t first = 0; first < rows.size(); first += step) {
      const size_t end = std::min(rows.size(), first + step);
      std::vector<model::GenerationRow> part(std::make_move_iterator(rows.begin() + first),
                                             std::make_move_iterator(rows.begin() + end));
      most_rows_ = std::max(most_rows_.load(), static_cast<int64_t>(part.size()));
      const auto on_token = [&](size_t row, uint32_t token, std::span<const float> logits) {
        const auto [j, s] = owner[first + row];
        const Sequence& seq = jobs[j]->sequences[s];
        results[j][s].token_scores.push_back(score_logits(logits, token, seq.top_logprobs));
        ++tokens_;
        if (!jobs[j]->first_token) {
          jobs[j]->first_token = true;
          const std::chrono::duration<double> waited =
              std::chrono::steady_clock::now() - jobs[j]->submitted;
          std::lock_guard lock(mu_);
          first_token_.observe(waited.count());
        }
        if (jobs[j]->sink) jobs[j]->sink(s, token);
      };
      const auto gens = model::generate_rows(model_, std::move(part), decode, on_token);
      for (size_t r = 0; r < gens.size(); ++r)
        results[owner[first + r].first][owner[first + r].second].generation = gens[r];
    }
  } catch (...) {
    for (auto& job : jobs) job->done.set_exception(std::current_exception());
    return;
  }
  for (size_t j = 0; j < jobs.size(); ++j) jobs[j]->done.set_value(std::move(results[j]));
}

}  // namespace pollen::serve
