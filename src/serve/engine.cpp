#include "serve/engine.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"

namespace pollen::serve {
namespace {

// log-softmax of one row of logits (the model's whole vocabulary, as prompt tokens are scored)
// at `token`, with the `top` most likely among the first `top_vocab` (the ids the tokenizer
// can decode).
eval::TokenScore score_logits(std::span<const float> z, uint32_t token, int64_t top,
                              size_t top_vocab) {
  return eval::score_row(z, eval::log_sum_exp(z), token, top, static_cast<int64_t>(top_vocab));
}

}  // namespace

Engine::Engine(const model::Llama& model, const tokenizer::Tokenizer& tok, int64_t max_batch_rows,
               int64_t prefill_chunk)
    : model_(model),
      tok_(tok),
      max_rows_(std::max<int64_t>(1, max_batch_rows)),
      prefill_chunk_(std::max<int64_t>(0, prefill_chunk)) {
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
  job->stop = std::make_shared<std::atomic<bool>>(false);
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
  // Generated text follows its prompt: decoded as a continuation (a SentencePiece marker of the
  // first token is its space, as in the whole text), special tokens left out.
  const auto decode = [this](std::span<const uint32_t> ids) { return tok_.generated_text(ids); };
  const auto on_token = [this](size_t id, uint32_t token, std::span<const float> logits) {
    this->on_token(id, token, logits);
  };
  const auto fresh_batch = [&](std::optional<model::GenerationBatch>& b) {
    b.emplace(model_, decode, on_token, true, prefill_chunk_);
  };
  std::optional<model::GenerationBatch> batch;
  fresh_batch(batch);
  for (;;) {
    bool stopping = false;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock,
                 [&] { return stop_ || !running_.empty() || (!queue_.empty() && holds_ == 0); });
      stopping = stop_;
    }
    // Shutting down, the requests already running finish; those still waiting fail below.
    if (stopping && running_.empty()) break;
    try {
      admit(*batch, stopping);
      for (model::GenerationBatch::Finished& f : batch->step()) {
        const Owner owner = owners_.at(f.id);
        owners_.erase(f.id);
        Job& job = *owner.job;
        if (f.error) fail(job, f.error);
        job.results[owner.sequence].generation = std::move(f.generation);
        ++job.finished;
        settle(job);
      }
    } catch (...) {  // the forward itself: every running request is lost
      fail_running(std::current_exception());
      fresh_batch(batch);
    }
  }
  // Whatever is still queued at shutdown fails rather than hanging its caller.
  std::lock_guard lock(mu_);
  for (auto& job : queue_)
    job->done.set_exception(std::make_exception_ptr(Error("the server is shutting down")));
}

void Engine::admit(model::GenerationBatch& batch, bool stopping) {
  const auto free_rows = [&] { return max_rows_ - static_cast<int64_t>(batch.live()); };
  {
    std::lock_guard lock(mu_);
    // Requests already running first (one of more sequences than rows enters in turns), then
    // waiting ones in their order while their sequences would find rows.
    int64_t rows = free_rows();
    for (const auto& job : running_)
      rows -= static_cast<int64_t>(job->sequences.size() - job->admitted);
    while (!stopping && holds_ == 0 && !queue_.empty() && rows > 0) {
      std::unique_ptr<Job> job = std::move(queue_.front());
      queue_.pop_front();
      if (job->sequences.empty()) {
        job->done.set_value({});
        continue;
      }
      rows -= static_cast<int64_t>(job->sequences.size());
      job->results.resize(job->sequences.size());
      running_.push_back(std::move(job));
    }
  }
  std::vector<Job*> jobs;
  for (const auto& job : running_) jobs.push_back(job.get());
  for (Job* job : jobs) {
    // A client that went away: its live sequences end at this step, the rest never start.
    if (job->cancelled && job->cancelled->load()) job->stop->store(true);
    if (job->stop->load()) {
      for (; job->admitted < job->sequences.size(); ++job->admitted, ++job->finished)
        job->results[job->admitted].generation.finish_reason = "cancelled";
      settle(*job);
      continue;
    }
    while (job->admitted < job->sequences.size() && free_rows() > 0) {
      try {
        add_sequence(batch, *job);
      } catch (...) {  // this request's alone (scoring its prompt, a row refused)
        fail(*job, std::current_exception());
        break;
      }
    }
  }
  most_rows_ = std::max(most_rows_.load(), static_cast<int64_t>(batch.live()));
  // Counted before the step runs: its callers may look as soon as their answers arrive.
  std::lock_guard lock(mu_);
  largest_ = std::max(largest_, static_cast<int64_t>(running_.size()));
}

void Engine::add_sequence(model::GenerationBatch& batch, Job& job) {
  const size_t s = job.admitted;
  const Sequence& seq = job.sequences[s];
  if (seq.prompt_logprobs)
    job.results[s].prompt_scores =
        eval::sequence_scores(model_, seq.prompt, static_cast<int64_t>(seq.prompt.size()),
                              seq.top_logprobs, static_cast<int64_t>(tok_.vocab_size()));
  model::GenerationRow row{seq.prompt, seq.options, seq.rng, job.stop};
  // Only ids the tokenizer can decode (a model's vocabulary may be padded beyond them).
  row.options.vocab_size = static_cast<int64_t>(tok_.vocab_size());
  owners_[batch.add(std::move(row))] = {&job, s};
  ++job.admitted;
}

void Engine::fail(Job& job, std::exception_ptr error) {
  if (job.failed) return;
  job.failed = true;
  job.done.set_exception(error);
  job.stop->store(true);  // its other sequences end at the next step
  for (; job.admitted < job.sequences.size(); ++job.admitted) ++job.finished;
  settle(job);
}

void Engine::settle(Job& job) {
  if (job.finished < job.sequences.size()) return;
  if (!job.failed) job.done.set_value(std::move(job.results));
  std::erase_if(running_, [&](const std::unique_ptr<Job>& j) { return j.get() == &job; });
}

void Engine::on_token(size_t id, uint32_t token, std::span<const float> logits) {
  const auto [job, s] = owners_.at(id);
  if (job->failed) return;  // answered already
  job->results[s].token_scores.push_back(
      score_logits(logits, token, job->sequences[s].top_logprobs, tok_.vocab_size()));
  ++tokens_;
  if (!job->first_token) {
    job->first_token = true;
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - job->submitted;
    std::lock_guard lock(mu_);
    first_token_.observe(waited.count());
  }
  if (job->sink) job->sink(s, token);
}

void Engine::fail_running(std::exception_ptr error) {
  for (auto& job : running_)
    if (!job->failed) job->done.set_exception(error);
  running_.clear();
  owners_.clear();
}

}  // namespace pollen::serve
