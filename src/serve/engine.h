#pragma once
// The engine: one worker thread that owns every use of the model, and a queue of requests in
// front of it. The worker runs one batch continuously (model::GenerationBatch: one forward per
// step for every live sequence, each with its own options and random stream): before each step
// it admits waiting requests' sequences into the rows that sequences finishing have left (up to
// a number of rows), scoring the prompts that ask for their log-probabilities, so a request
// never waits for another to finish. HTTP threads only queue work and wait for it, so the model
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
#include <unordered_map>
#include <vector>

#include "eval/rolling.h"
#include "model/generate.h"
#include "model/generation_batch.h"
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
  // prefill_chunk: most prompt tokens one step runs (0: whole prompts), so that a long prompt
  // joining the batch holds the sequences already generating for a step of that size, not for
  // all of it.
  Engine(const model::Llama& model, const tokenizer::Tokenizer& tok, int64_t max_batch_rows,
         int64_t prefill_chunk = 0);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues one request's sequences; the future holds their results in order (or the error).
  // Once `cancelled` is set (the client went away) its sequences end before their next step,
  // finish_reason "cancelled".
  std::future<std::vector<SequenceResult>> submit(
      std::vector<Sequence> sequences, TokenSink sink = {},
      std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  // While a Hold lives the worker admits no new request (they queue up; sequences already
  // running go on); for tests that need requests to be waiting at a known moment.
  class Hold {
   public:
    explicit Hold(Engine& e);
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    Engine& engine_;
  };

  int64_t pending() const;        // requests none of whose sequences has been admitted yet
  int64_t largest_batch() const;  // most requests generating at once
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
    // Set when the client went away or the request failed: its rows end at the next step.
    std::shared_ptr<std::atomic<bool>> stop;
    std::vector<SequenceResult> results;
    size_t admitted = 0;  // sequences that entered the batch (or never will) so far
    size_t finished = 0;
    bool failed = false;       // answered with an error
    bool first_token = false;  // seen
  };
  // A live sequence of the batch: whose it is.
  struct Owner {
    Job* job;
    size_t sequence;
  };
  void work();
  // Moves waiting sequences into the batch while rows are free (none of new requests when
  // stopping or held).
  void admit(model::GenerationBatch& batch, bool stopping);
  void add_sequence(model::GenerationBatch& batch, Job& job);
  void on_token(size_t id, uint32_t token, std::span<const float> logits);
  // Answers one request with `error`; its sequences in the batch end at the next step.
  void fail(Job& job, std::exception_ptr error);
  // Answers and forgets a request once all its sequences are done.
  void settle(Job& job);
  // Fails every request in the batch or waiting to enter it (the batch is dropped).
  void fail_running(std::exception_ptr error);

  const model::Llama& model_;
  const tokenizer::Tokenizer& tok_;
  int64_t max_rows_, prefill_chunk_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Job>> queue_;
  // Worker thread only: requests with sequences in the batch (or some still to admit), and each
  // live sequence's owner by its id in the batch.
  std::vector<std::unique_ptr<Job>> running_;
  std::unordered_map<size_t, Owner> owners_;
  std::atomic<int64_t> most_rows_{0};
  std::atomic<int64_t> tokens_{0};
  obs::SecondsHistogram first_token_;  // under mu_
  int holds_ = 0;
  bool stop_ = false;
  int64_t largest_ = 0;
  std::thread worker_;
};

}  // namespace pollen::serve
