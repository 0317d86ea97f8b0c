#include "train/sft.h"

#include <algorithm>
#include <numeric>

#include "autograd/tape.h"
#include "base/error.h"
#include "base/log.h"
#include "train/config.h"
#include "train/jsonl_data.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace pollen::train {
namespace {

// FNV-1a over the conversation: which examples are held out does not depend on the seed.
uint64_t conversation_hash(const std::vector<tokenizer::ChatMessage>& messages) {
  uint64_t h = 1469598103934665603ull;
  auto add = [&](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  };
  for (const auto& m : messages) {
    add(m.role);
    add(m.content);
  }
  return h;
}

// The rendered conversation up to where assistant message i's content begins (the messages before
// it and its header), cut from the conversation through message i. Rendering the messages before
// it with a generation prompt is not the same for a first message: Llama 3 opens a conversation
// with <|begin_of_text|> and Qwen's ChatML with a default system message, which no messages at all
// do not get.
std::string text_before_message(const tokenizer::ChatFormat& format,
                                const std::vector<tokenizer::ChatMessage>& messages, size_t i) {
  const std::string marker = "pollen-reply-marker";
  std::vector<tokenizer::ChatMessage> through(messages.begin(), messages.begin() + i + 1);
  through[i].content = marker;
  const std::string text = tokenizer::render_chat(format, through, false);
  const size_t at = text.rfind(marker);
  POLLEN_ASSERT(at != std::string::npos);
  return text.substr(0, at);
}

int64_t positions(const SftExample& e) {
  return static_cast<int64_t>(e.tokens.size()) - 1;
}

}  // namespace

std::vector<SftRecord> read_sft_jsonl(const fs::path& path) {
  std::vector<SftRecord> out;
  for_each_jsonl_object(
      path, "SFT data", [&](const nlohmann::json& j, int64_t line, const std::string& where) {
        SftRecord r;
        r.line = line;
        if (j.contains("messages")) {
          r.messages = read_messages(j["messages"], "messages", where);
          POLLEN_CHECK(std::any_of(r.messages.begin(), r.messages.end(),
                                   [](const auto& msg) { return msg.role == "assistant"; }),
                       where, ": field 'messages': no message has role 'assistant'");
        } else if (j.contains("prompt") || j.contains("completion")) {
          r.messages.push_back({"user", string_field(j, "prompt", "prompt", where)});
          r.messages.push_back({"assistant", string_field(j, "completion", "completion", where)});
        } else {
          fail(where, ": expected a field 'messages' (an array of {role, content}) or the fields ",
               "'prompt' and 'completion'");
        }
        out.push_back(std::move(r));
      });
  return out;
}

int64_t SftExample::scored_count() const {
  return std::accumulate(scored.begin(), scored.end(), int64_t{0});
}

SftExample tokenize_conversation(const tokenizer::Tokenizer& tok,
                                 const tokenizer::ChatFormat& format,
                                 const std::vector<tokenizer::ChatMessage>& messages,
                                 bool assistant_only, const std::string& where) {
  tokenizer::EncodeOptions eo;
  eo.special = tokenizer::SpecialPolicy::allow_all();
  SftExample e;
  e.tokens = tok.encode(tokenizer::render_chat(format, messages, false), eo);
  e.scored.assign(e.tokens.size(), 0);
  if (!assistant_only) {
    std::fill(e.scored.begin() + (e.tokens.empty() ? 0 : 1), e.scored.end(), 1);
    return e;
  }
  // The number of tokens of `text`, a prefix of the rendered conversation that must end on one
  // of its token boundaries.
  auto boundary = [&](const std::string& text, size_t i, const char* what) {
    const auto ids = tok.encode(text, eo);
    POLLEN_CHECK(
        ids.size() <= e.tokens.size() && std::equal(ids.begin(), ids.end(), e.tokens.begin()),
        where, ": the text ", what, " assistant message ", i,
        " does not end on a token boundary of the whole conversation, so its tokens ",
        "cannot be told apart; use loss_on = \"all\" or change the message");
    return ids.size();
  };
  const std::string_view eot = tokenizer::end_of_turn(format.kind);
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != "assistant") continue;
    const std::vector<tokenizer::ChatMessage> through(messages.begin(), messages.begin() + i + 1);
    const size_t start = boundary(text_before_message(format, messages, i), i, "before");
    std::string done = tokenizer::render_chat(format, through, false);
    const size_t at = done.rfind(eot);
    POLLEN_ASSERT(at != std::string::npos);
    done.resize(at + eot.size());  // through the end-of-turn token, not what follows it
    const size_t end = boundary(done, i, "through the end of");
    std::fill(e.scored.begin() + static_cast<std::ptrdiff_t>(start),
              e.scored.begin() + static_cast<std::ptrdiff_t>(end), 1);
  }
  return e;
}

std::vector<std::vector<int64_t>> pack_rows(const std::vector<SftExample>& examples,
                                            const std::vector<int64_t>& order, int64_t seq) {
  std::vector<std::vector<int64_t>> rows;
  int64_t used = 0;
  for (const int64_t i : order) {
    const int64_t n = positions(examples[static_cast<size_t>(i)]);
    POLLEN_ASSERT(n <= seq);
    if (rows.empty() || used + n > seq) {
      rows.emplace_back();
      used = 0;
    }
    rows.back().push_back(i);
    used += n;
  }
  return rows;
}

model::Batch make_packed_batch(const std::vector<SftExample>& examples,
                               const std::vector<std::vector<int64_t>>& rows) {
  const int64_t b = static_cast<int64_t>(rows.size());
  int64_t t = 1;
  for (const auto& row : rows) {
    int64_t n = 0;
    for (const int64_t i : row) n += positions(examples[static_cast<size_t>(i)]);
    t = std::max(t, n);
  }
  model::Batch batch;
  batch.tokens = Tensor::zeros({b, t}, DType::i32);
  batch.targets = Tensor::full({b, t}, -1, DType::i32);
  batch.positions = Tensor::zeros({b, t}, DType::i32);
  batch.doc_ids = Tensor::zeros({b, t}, DType::i32);
  int32_t* tokens = batch.tokens.data<int32_t>();
  int32_t* targets = batch.targets.data<int32_t>();
  int32_t* pos = batch.positions.data<int32_t>();
  int32_t* doc = batch.doc_ids.data<int32_t>();
  for (int64_t r = 0; r < b; ++r) {
    int64_t at = r * t;
    int32_t id = 0;
    for (const int64_t i : rows[static_cast<size_t>(r)]) {
      const SftExample& e = examples[static_cast<size_t>(i)];
      for (int64_t p = 0; p < positions(e); ++p, ++at) {
        tokens[at] = static_cast<int32_t>(e.tokens[static_cast<size_t>(p)]);
        targets[at] = e.scored[static_cast<size_t>(p + 1)]
                          ? static_cast<int32_t>(e.tokens[static_cast<size_t>(p + 1)])
                          : -1;
        pos[at] = static_cast<int32_t>(p);
        doc[at] = id;
      }
      ++id;
    }
    for (int32_t p = 0; at < (r + 1) * t; ++at, ++p) {  // padding: a document of its own
      pos[at] = p;
      doc[at] = id;
    }
  }
  return batch;
}

SftSettings read_sft_settings(ConfigTable& s, const fs::path& base_dir, int64_t max_seq) {
  SftSettings c;
  c.data = resolve_config_path(base_dir, s.require_string("data"));
  const std::string validation = s.get_string("validation", "");
  if (!validation.empty()) c.validation = resolve_config_path(base_dir, validation);
  c.validation_fraction = s.get_double("validation_fraction", validation.empty() ? 0.05 : 0.0);
  POLLEN_CHECK(c.validation_fraction >= 0 && c.validation_fraction < 1,
               s.where("validation_fraction"), ": expected [0, 1)");
  POLLEN_CHECK(validation.empty() || c.validation_fraction == 0, s.where("validation_fraction"),
               ": set either validation (a file) or validation_fraction, not both");
  const std::string loss_on = s.get_string("loss_on", "assistant");
  POLLEN_CHECK(loss_on == "assistant" || loss_on == "all", s.where("loss_on"),
               ": expected \"assistant\" or \"all\", got \"", loss_on, "\"");
  c.assistant_only = loss_on == "assistant";
  c.seq = s.get_int("seq", max_seq);
  POLLEN_CHECK(c.seq > 0 && c.seq <= max_seq, s.where("seq"),
               ": expected 1 to the model's max_position_embeddings (", max_seq, ")");
  c.micro_batch = s.get_int("micro_batch", 4);
  POLLEN_CHECK(c.micro_batch > 0, s.where("micro_batch"), ": expected a positive integer");
  c.accumulation = s.get_int("accumulation", 1);
  POLLEN_CHECK(c.accumulation > 0, s.where("accumulation"), ": expected a positive integer");
  c.pack = s.get_bool("pack", true);
  const std::string too_long = s.get_string("too_long", "truncate");
  POLLEN_CHECK(too_long == "truncate" || too_long == "drop", s.where("too_long"),
               ": expected \"truncate\" or \"drop\", got \"", too_long, "\"");
  c.drop_long = too_long == "drop";
  s.finish();
  return c;
}

SftObjective::SftObjective(const ObjectiveContext& ctx) : seed_(ctx.seed) {
  ConfigTable section = ctx.section;
  settings_ = read_sft_settings(section, ctx.base_dir, ctx.max_seq);
  POLLEN_CHECK(ctx.tokenizer != nullptr, "sft: no tokenizer");
  const int64_t limit = settings_.seq + 1;  // tokens of an example that fills a row
  struct Counts {
    int64_t truncated = 0, dropped = 0, unscored = 0;
  };
  auto load = [&](const fs::path& file, bool split, std::vector<SftExample>& kept,
                  std::vector<SftExample>* held_out, Counts& counts) {
    for (const auto& r : read_sft_jsonl(file)) {
      const std::string where = cat("file '", file.string(), "', line ", r.line);
      SftExample e = tokenize_conversation(*ctx.tokenizer, ctx.chat_format, r.messages,
                                           settings_.assistant_only, where);
      if (static_cast<int64_t>(e.tokens.size()) > limit) {
        if (settings_.drop_long) {
          ++counts.dropped;
          continue;
        }
        ++counts.truncated;
        e.tokens.resize(static_cast<size_t>(limit));
        e.scored.resize(static_cast<size_t>(limit));
      }
      if (e.tokens.size() < 2) continue;
      // Nothing to learn from (its replies truncated away, say): a step of such examples alone
      // would have no loss, which would read as a diverging run.
      if (e.scored_count() == 0) {
        ++counts.unscored;
        continue;
      }
      const bool hold = split && static_cast<double>(conversation_hash(r.messages) % 1000000) <
                                     settings_.validation_fraction * 1e6;
      (hold ? *held_out : kept).push_back(std::move(e));
    }
  };
  Counts counts;
  load(settings_.data, settings_.validation.empty() && settings_.validation_fraction > 0, train_,
       &validation_, counts);
  const Counts in_data = counts;  // sft.data's alone, for the error below
  if (!settings_.validation.empty() && jsonl_has_records(settings_.validation))
    load(settings_.validation, false, validation_, nullptr, counts);
  if (train_.empty()) {
    std::string why;
    if (in_data.dropped > 0)
      why = cat(": ", in_data.dropped, " dropped for being longer than sft.seq = ", settings_.seq,
                " positions (sft.too_long = \"drop\")");
    if (in_data.unscored > 0)
      why += cat(why.empty() ? ": " : "; ", in_data.unscored,
                 " have no token to score (sft.loss_on = \"",
                 settings_.assistant_only ? "assistant" : "all",
                 "\"), their replies cut off by truncation to sft.seq = ", settings_.seq,
                 " positions (sft.too_long) or empty");
    fail("sft: no training examples left in '", settings_.data.string(), "'", why);
  }
  // The files read well. Where examples were left out for having no token to score, the key says
  // so: checkpoints of pollen that kept them count positions in another list of examples.
  identity_.emplace("sft.data", settings_.data, "sft.validation", settings_.validation, ctx);
  identity_->add("unscored", "the examples left out for having no token to score",
                 counts.unscored > 0 ? "examples without a scored token left out" : "");
  log::info("sft: ", train_.size(), " training and ", validation_.size(),
            " validation examples; longer than ", settings_.seq, " positions: ", counts.truncated,
            " truncated, ", counts.dropped, " dropped; ", counts.unscored,
            " left out with no token to score");
  std::vector<int64_t> in_order(validation_.size());
  std::iota(in_order.begin(), in_order.end(), 0);
  if (settings_.pack) {
    validation_rows_ = pack_rows(validation_, in_order, settings_.seq);
  } else {
    for (int64_t i : in_order) validation_rows_.push_back({i});
  }
  order_ = epoch_order(0);
}

std::vector<int64_t> SftObjective::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(train_.size());
  std::iota(order.begin(), order.end(), 0);
  Rng rng = Rng(seed_).fork(0x5f7ull << 32 | static_cast<uint64_t>(epoch));
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  return order;
}

std::vector<int64_t> SftObjective::next_row() {
  if (next_ >= static_cast<int64_t>(order_.size())) {
    ++epoch_;
    next_ = 0;
    order_ = epoch_order(epoch_);
  }
  std::vector<int64_t> row{order_[static_cast<size_t>(next_++)]};
  int64_t used = positions(train_[static_cast<size_t>(row[0])]);
  while (settings_.pack && next_ < static_cast<int64_t>(order_.size())) {
    const int64_t i = order_[static_cast<size_t>(next_)];
    const int64_t n = positions(train_[static_cast<size_t>(i)]);
    if (used + n > settings_.seq) break;
    row.push_back(i);
    used += n;
    ++next_;
  }
  return row;
}

ObjectiveStep SftObjective::train_step(const model::Llama& model, int64_t) {
  // The whole step's rows, read on every rank so that the data position is the same on all.
  std::vector<std::vector<std::vector<int64_t>>> step_rows;
  int64_t examples = 0, rows = 0, tokens = 0;
  for (int64_t m = 0; m < settings_.accumulation; ++m) {
    std::vector<std::vector<int64_t>> batch_rows;
    for (int64_t r = 0; r < settings_.micro_batch; ++r) {
      batch_rows.push_back(next_row());
      examples += static_cast<int64_t>(batch_rows.back().size());
      for (int64_t i : batch_rows.back()) tokens += positions(train_[static_cast<size_t>(i)]);
    }
    rows += static_cast<int64_t>(batch_rows.size());
    step_rows.push_back(std::move(batch_rows));
  }
  const int64_t world = comm_ ? comm_->world() : 1, rank = comm_ ? comm_->rank() : 0;
  const int64_t first = rank * settings_.accumulation / world;
  const int64_t end = (rank + 1) * settings_.accumulation / world;
  std::vector<model::Batch> micro;
  for (int64_t m = first; m < end; ++m)
    micro.push_back(make_packed_batch(train_, step_rows[static_cast<size_t>(m)]));
  AccumulatedLoss acc;
  if (comm_) {
    // LoRA dropout draws each forward pass's masks by its number in the step: this rank's come
    // after the ones the ranks before it run.
    if (model.lora()) model.lora()->skip_dropout_forwards(static_cast<uint64_t>(first));
    bool stop = false;  // the loop agrees on stopping after the step
    double reduce_wait_s = 0;
    acc = accumulate_gradients(model, micro, *comm_, *reducer_, stop, reduce_wait_s);
  } else {
    acc = accumulate_gradients(model, micro);
  }
  ObjectiveStep s;
  s.loss = acc.loss;
  s.tokens = tokens;
  s.metrics["scored"] = acc.scored;
  s.metrics["examples"] = examples;
  s.metrics["rows"] = rows;
  s.metrics["epoch"] =
      static_cast<double>(epoch_) + static_cast<double>(next_) / static_cast<double>(order_.size());
  return s;
}

void SftObjective::split_across(dist::Communicator& comm, dist::GradReducer& reducer) {
  if (settings_.accumulation % comm.world() != 0) {
    // The same rows per step in other micro-batches, when the world size allows it: what a
    // resumed run may change (docs/posttraining.md); else a larger step.
    const int64_t rows = settings_.micro_batch * settings_.accumulation;
    std::string advice = cat("sft.accumulation = ", comm.world(),
                             " or a multiple of it; the step's batch grows with it");
    for (int64_t a = comm.world(); a <= rows; a += comm.world()) {
      if (rows % a != 0) continue;
      advice = cat("sft.accumulation = ", a, " with sft.micro_batch = ", rows / a,
                   " keeps the step's ", rows, " rows, also when resuming");
      break;
    }
    fail("sft.accumulation (", settings_.accumulation, ") is not a multiple of the job's ",
         comm.world(), " ranks: each rank runs the same number of a step's micro-batches (", advice,
         "; set them in the run file, or with --set on pollen sft)");
  }
  comm_ = &comm;
  reducer_ = &reducer;
}

ObjectiveStep SftObjective::evaluate(const model::Llama& model) {
  ag::NoGrad no_grad;
  const size_t world = comm_ ? static_cast<size_t>(comm_->world()) : 1;
  const size_t rank = comm_ ? static_cast<size_t>(comm_->rank()) : 0;
  double sums[2] = {0, 0};  // loss, scored tokens
  int64_t tokens = 0;
  const auto per = static_cast<size_t>(settings_.micro_batch);
  for (size_t at = 0, batch = 0; at < validation_rows_.size(); at += per, ++batch) {
    const std::vector<std::vector<int64_t>> rows(
        validation_rows_.begin() + static_cast<std::ptrdiff_t>(at),
        validation_rows_.begin() +
            static_cast<std::ptrdiff_t>(std::min(at + per, validation_rows_.size())));
    for (const auto& row : rows)
      for (int64_t i : row) tokens += positions(validation_[static_cast<size_t>(i)]);
    if (batch % world != rank) continue;
    const model::Batch b = make_packed_batch(validation_, rows);
    int64_t n = 0;
    sums[0] += model.loss(b, ag::Reduction::sum, &n).value().item();
    sums[1] += static_cast<double>(n);
  }
  if (comm_) comm_->all_reduce_sum(sums, "the held-out loss");
  const auto scored = static_cast<int64_t>(sums[1]);
  ObjectiveStep s;
  s.loss = scored > 0 ? sums[0] / sums[1] : NAN;
  s.tokens = tokens;
  s.metrics["scored"] = scored;
  s.metrics["examples"] = static_cast<int64_t>(validation_.size());
  return s;
}

std::string SftObjective::no_validation_data() const {
  if (!validation_rows_.empty()) return "";
  if (!settings_.validation.empty())
    return cat("sft.validation '", settings_.validation.string(), "' holds no examples");
  return cat("sft.validation_fraction (", settings_.validation_fraction, ") held out none of ",
             train_.size(), " examples; set a larger fraction or sft.validation (a file)");
}

nlohmann::ordered_json SftObjective::state() const {
  nlohmann::ordered_json st = {{"epoch", epoch_}, {"next", next_}};
  st.update(identity_->state());
  return st;
}

void SftObjective::restore(const nlohmann::ordered_json& st) {
  // The data position counts examples of the data the run started with.
  identity_->check(st, "sft");
  epoch_ = st.at("epoch").get<int64_t>();
  next_ = st.at("next").get<int64_t>();
  order_ = epoch_order(epoch_);
  POLLEN_CHECK(next_ >= 0 && next_ <= static_cast<int64_t>(order_.size()),
               "sft: the checkpoint's data position (", next_, ") is past the ", order_.size(),
               " training examples: was the data changed?");
}

std::unique_ptr<Objective> make_sft_objective(const ObjectiveContext& context) {
  return std::make_unique<SftObjective>(context);
}

}  // namespace pollen::train
