#pragma once
// The engine: one worker thread that owns every use of the model, and a queue of requests in
// front of it. Each time the worker is free it takes every pending request (up to a number of
// rows), scores the prompts that ask for their log-probabilities, and generates for all their
// sequences in one batch (model::generate_rows: one forward per step for every row, each row with
// its own options and random stream). HTTP threads only queue work and wait for it, so the model
// is never run from two threads at once.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "eval/rolling.h"
#include "model/generate.h"
#include "obs/seconds_histogram.h"
#include "tokenizer/tokenizer.h"

namespace pollen::serve {

struct Sequence {
  std::vector<uint32_t> prompt;
  model::SamplingOptions options;
  Rng rng;
  bool prompt_logprobs = false;  // score the prompt (echo with logprobs)
  int64_t top_logprobs = 0;      // alternatives per scored position (prompt and generated)
};

struct SequenceResult {
  model::Generation generation;
  std::vector<std::optional<eval::TokenScore>> prompt_scores;  // when asked; first is none
  std::vector<eval::TokenScore> token_scores;                  // one per generated token
};

// Called on the worker thread for each token a sequence keeps (streaming).
using TokenSink = std::function<void(size_t sequence, uint32_t token)>;

class Engine {
 public:
  Engine(const model::Llama& model, const tokenizer::Tokenizer& tok, int64_t max_batch_rows);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues one request's sequences; the future holds their results in order (or the error).
  // Once `cancelled` is set (the client went away) its sequences end before their next step,
  // finish_reason "cancelled".
  std::future<std::vector<SequenceResult>> submit(
      std::vector<Sequence> sequences, TokenSink sink = {},
      std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  // While a Hold lives the worker starts no new batch (requests queue up); for draining and for
  // tests that need requests to be waiting at a known moment.
  class Hold {
   public:
    explicit Hold(Engine& e);
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    Engine& engine_;
  };

  int64_t pending() const;        // requests waiting for the worker
  int64_t largest_batch() const;  // most requests that shared one batch
  int64_t most_rows() const;      // most sequences generated at once (at most max_batch_rows)
  int64_t tokens_generated() const { return tokens_.load(); }  // over every request so far
  // Seconds from each request's submission to its first generated token, so far.
  obs::SecondsHistogram time_to_first_token() const;

 private:
  struct Job {
    std::vector<Sequence> sequences;
    TokenSink sink;
    std::shared_ptr<const std::atomic<bool>> cancelled;
    std::promise<std::vector<SequenceResult>> done;
    std::chrono::steady_clock::time_point submitted;
    bool first_token = false;  // seen
  };
  void work();
  void run_batch(std::vector<std::unique_ptr<Job>>& jobs);

  const model::Llama& model_;
  const tokenizer::Tokenizer& tok_;
  int64_t max_rows_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Job>> queue_;
  std::atomic<int64_t> most_rows_{0};
  std::atomic<int64_t> tokens_{0};
  obs::SecondsHistogram first_token_;  // under mu_
  int holds_ = 0;
  bool stop_ = false;
  int64_t largest_ = 0;
  std::thread worker_;
};

}  // namespace pollen::serve
