#include "fed/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "base/config.h"
#include "base/host_port.h"
#include "base/log.h"
#include "fed/wire.h"
#include "optim/schedule.h"

namespace pollen::fed {

namespace {

// `init_from`: where model.init_from goes (null: refused).
model::LlamaConfig read_model(ConfigTable& root, std::string* init_from = nullptr) {
  auto m = root.table("model");
  POLLEN_CHECK(m.has_value(), root.where("model"), ": a [model] table is required");
  if (init_from) *init_from = m->get_string("init_from", "");
  const std::string file = m->get_string("file", "");
  if (!file.empty()) {  // a pollen model file, relative to the working directory
    model::check_model_file_stands_alone(*m);
    m->finish();
    return model::load_config(file);
  }
  return model::read_config(*m);
}

std::string read_tokenizer(ConfigTable& root) {
  auto t = root.table("tokenizer");
  POLLEN_CHECK(t.has_value(), root.where("tokenizer"),
               ": a [tokenizer] table with fingerprint is required");
  std::string fp = t->require_string("fingerprint");
  POLLEN_CHECK(!fp.empty() && fp.size() <= 128, t->where("fingerprint"),
               ": expected 1 to 128 characters");
  t->finish();
  return fp;
}

}  // namespace

void read_compression(ConfigTable& root, ServerConfig& c) {
  if (auto t = root.table("compression")) {
    auto codec = [&](const char* key) {
      const std::string name = t->get_string(key, "none");
      try {
        return parse_codec(name);
      } catch (const Error& e) {
        fail(t->where(key), ": ", e.what());
      }
    };
    c.compression.codec = codec("codec");
    c.compression.block = t->get_int("block", c.compression.block);
    c.compression.topk = t->get_int("topk", c.compression.topk);
    c.server_codec = codec("server_codec");
    try {
      c.compression.scale = parse_scale_format(t->get_string("scale", "float32"));
    } catch (const Error& e) {
      fail(t->where("scale"), ": ", e.what());
    }
    const bool topk = c.compression.codec == Codec::topk || c.server_codec == Codec::topk;
    POLLEN_CHECK(topk || !t->has("topk"), t->where("topk"),
                 ": only used by the topk codec (codec or server_codec)");
    t->finish();
    for (const CompressOptions& o : {c.compression, c.download()})
      if (const auto p = o.problem()) fail(t->where(p->key), ": ", p->what);
  }
}

void check_seconds(const ConfigTable& t, const std::string& key, double seconds, bool positive) {
  // Finite and within a steady clock's range (deadlines are taken as now + seconds).
  POLLEN_CHECK(std::isfinite(seconds) && (positive ? seconds > 0 : seconds >= 0) &&
                   seconds <= kMaxConfigSeconds,
               t.where(key), ": must be ", positive ? "more than 0" : "0 or more", " and at most ",
               static_cast<int64_t>(kMaxConfigSeconds), " seconds, got ", seconds);
}

// Without a port gRPC would use 443 (and a port past 65535 another one).
void check_grpc_address(const std::string& address, const std::string& where) {
  std::string_view named = address;
  for (const char* scheme : {"unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:"})
    if (named.starts_with(scheme)) return;
  if (named.starts_with("dns:")) {
    named.remove_prefix(4);
    if (named.starts_with("//"))
      named.remove_prefix(std::min(named.size(), named.find('/', 2) + 1));
  }
  POLLEN_CHECK(parse_host_port(named), where,
               ": expected host:port with a port in [0, 65535] (an IPv6 host in brackets), or "
               "unix:PATH, got '",
               address, "'");
}

namespace {

void read_server_table(ConfigTable& s, ServerConfig& c) {
  c.dir = s.require_string("dir");
  c.address = s.get_string("address", c.address);
  check_grpc_address(c.address, s.where("address"));
  c.metrics_address = s.get_string("metrics_address", c.metrics_address);
  POLLEN_CHECK(c.metrics_address.empty() || parse_host_port(c.metrics_address),
               s.where("metrics_address"),
               ": expected host:port with a port in [0, 65535] (an IPv6 host in brackets), got '",
               c.metrics_address, "'");
  c.allow_plaintext = s.get_bool("allow_plaintext", c.allow_plaintext);
  c.seed = static_cast<uint64_t>(s.get_int_in("seed", 0, 0, kConfigIntMax));
  c.rounds = s.get_int("rounds", c.rounds);
  c.local_steps = s.get_int("local_steps", c.local_steps);
  c.eval_every = s.get_int("eval_every", c.eval_every);
  c.round_timeout_s = s.get_double("round_timeout_s", c.round_timeout_s);
  c.wait_for_clients_s = s.get_double("wait_for_clients_s", c.wait_for_clients_s);
  c.client_timeout_s = s.get_double("client_timeout_s", c.client_timeout_s);
  c.max_round_retries = s.get_int("max_round_retries", c.max_round_retries);
  c.keep_checkpoints =  // 0: all
      static_cast<int>(s.get_int_in("keep_checkpoints", c.keep_checkpoints, 0, INT32_MAX));
  POLLEN_CHECK(c.rounds >= 1, s.where("rounds"), ": must be at least 1");
  // A client refuses a task of more local steps (fed/received.h): checked here, not by every
  // client's first round.
  POLLEN_CHECK(c.local_steps >= 1 && c.local_steps <= kMaxLocalSteps, s.where("local_steps"),
               ": must be 1 to ", kMaxLocalSteps, ", got ", c.local_steps);
  POLLEN_CHECK(c.eval_every >= 0, s.where("eval_every"), ": must be 0 or more");
  check_seconds(s, "round_timeout_s", c.round_timeout_s, true);
  check_seconds(s, "wait_for_clients_s", c.wait_for_clients_s, false);
  check_seconds(s, "client_timeout_s", c.client_timeout_s, true);
  // Negative retries would stop the run after its first round (retries are counted from 0).
  POLLEN_CHECK(c.max_round_retries >= 0, s.where("max_round_retries"), ": must be 0 or more, got ",
               c.max_round_retries);
  s.finish();
}

// With [post] the base's architecture and tokenizer come from the run file: [model] and
// [tokenizer] (and a client's [data], [train], [parallel]) would say it twice.
void refuse_beside_post(ConfigTable& root, const std::vector<std::string>& tables,
                        const std::string& why) {
  for (const auto& t : tables)
    POLLEN_CHECK(!root.has(t), root.where(t), ": not allowed with [post]: ", why);
}

}  // namespace

PostSettings read_post_settings(ConfigTable& p, bool client) {
  PostSettings s;
  s.run = p.require_string("run");
  s.objective = p.get_string("objective", s.objective);
  POLLEN_CHECK(
      s.objective == "sft" || s.objective == "dpo" || s.objective == "grpo" || s.objective == "rm",
      p.where("objective"),
      ": expected \"sft\", \"dpo\", \"grpo\" or \"rm\" (the objectives that "
      "federate), got \"",
      s.objective, "\"");
  if (client) s.data = p.require_string("data");
  p.finish();
  return s;
}

TlsFiles read_tls(ConfigTable& root, bool server) {
  TlsFiles t;
  auto tls = root.table("tls");
  if (!tls) return t;
  t.ca = tls->require_string("ca");
  t.cert = tls->require_string("cert");
  t.key = tls->require_string("key");
  if (server) {
    t.crl = tls->get_string("crl", "");
  } else {
    t.server_name = tls->get_string("server_name", "");
  }
  tls->finish();
  return t;
}

// A local step's sequences fit the model's positions (past them rotary has no trained angles).
void check_seq_fits(const LocalTrainConfig& train, const model::LlamaConfig& model,
                    const ConfigTable& root) {
  POLLEN_CHECK(train.seq <= model.max_position_embeddings, root.where("train.seq"), ": ", train.seq,
               " is more than model.max_position_embeddings (", model.max_position_embeddings,
               "); expected 1 to that");
}

LocalTrainConfig read_local_train(ConfigTable& t) {
  LocalTrainConfig c;
  c.micro_batch = t.get_int("micro_batch", c.micro_batch);
  c.seq = t.get_int("seq", c.seq);
  c.accumulation = t.get_int("accumulation", c.accumulation);
  train::read_optimizer_keys(t, c.optimizer);
  c.min_lr = t.get_double("min_lr", c.min_lr);
  c.schedule = t.get_string("schedule", c.schedule);
  c.warmup_steps = t.get_int("warmup_steps", c.warmup_steps);
  c.round_warmup_steps = t.get_int("round_warmup_steps", c.round_warmup_steps);
  POLLEN_CHECK(c.round_warmup_steps >= 0, t.where("round_warmup_steps"), ": must be 0 or more");
  c.drift_correction = t.get_double("drift_correction", c.drift_correction);
  POLLEN_CHECK(c.drift_correction >= 0 && c.drift_correction <= 1, t.where("drift_correction"),
               ": must be in [0, 1], got ", c.drift_correction);
  c.proximal_mu = t.get_double("proximal_mu", c.proximal_mu);
  POLLEN_CHECK(c.proximal_mu >= 0 && std::isfinite(c.proximal_mu), t.where("proximal_mu"),
               ": must be 0 or more, got ", c.proximal_mu);
  c.total_steps = t.get_int("total_steps", c.total_steps);
  c.grad_clip = t.get_double("grad_clip", c.grad_clip);
  c.eval_batches = t.get_int("eval_batches", c.eval_batches);
  POLLEN_CHECK(c.eval_batches >= 1, t.where("eval_batches"),
               ": expected 1 or more validation batches, got ", c.eval_batches);
  c.device = t.get_string("device", c.device);
  POLLEN_CHECK(c.device == "cpu" || c.device == "cuda", t.where("device"),
               ": expected \"cpu\" or \"cuda\", got \"", c.device, "\"");
  c.precision = t.get_string("precision", c.precision);
  POLLEN_CHECK(c.precision == "f32" || c.precision == "bf16", t.where("precision"),
               ": expected \"f32\" or \"bf16\", got \"", c.precision, "\"");
  POLLEN_CHECK(c.precision == "f32" || c.device == "cuda", t.where("precision"),
               ": \"bf16\" needs train.device = \"cuda\": the CPU trains in f32");
  POLLEN_CHECK(c.micro_batch >= 1 && c.seq >= 1 && c.accumulation >= 1, t.where("micro_batch"),
               ": micro_batch, seq and accumulation must be at least 1");
  POLLEN_CHECK(c.optimizer.lr > 0, t.where("lr"), ": must be positive");
  try {
    optim::parse_schedule_kind(c.schedule);
  } catch (const Error& e) {
    fail(t.where("schedule"), ": ", e.what());
  }
  POLLEN_CHECK(c.schedule == "constant" || c.total_steps > 0, t.where("total_steps"),
               ": schedule '", c.schedule, "' needs total_steps");
  t.finish();
  return c;
}

void set_train_device(ClientConfig& c, const std::string& device) {
  POLLEN_CHECK(device == "cpu" || device == "cuda", "--device: expected cpu or cuda, got '", device,
               "'");
  POLLEN_CHECK(!c.post.enabled() || device == "cpu", "--device ", device, ": client '", c.id,
               "' is a post-training silo ([post]), which trains on the CPU");
  POLLEN_CHECK(c.train.precision == "f32" || device == "cuda", "--device ", device, ": client '",
               c.id, "' has train.precision = \"", c.train.precision, "\", which needs the GPU");
  c.train.device = device;
}

ServerConfig read_server_config(ConfigTable& root) {
  ServerConfig c;
  auto s = root.table("server");
  POLLEN_CHECK(s.has_value(), root.where("server"), ": a [server] table is required");
  read_server_table(*s, c);
  if (auto p = root.table("post")) {
    c.post = read_post_settings(*p, false);
    refuse_beside_post(root, {"model", "tokenizer"},
                       "the base, its architecture and its tokenizer are post.run's");
  } else {
    c.model = read_model(root, &c.init_from);
    c.tokenizer_fingerprint = read_tokenizer(root);
  }
  if (auto st = root.table("strategy")) {
    c.strategy = read_strategy_options(*st);
    st->finish();
  }
  read_compression(root, c);
  if (auto sa = root.table("secure_aggregation")) {
    c.secure_aggregation = secagg::read_options(*sa);
    POLLEN_CHECK(!c.secure_aggregation.enabled || c.compression.codec == Codec::none,
                 sa->where("enabled"),
                 ": secure aggregation sends masked ring words, so "
                 "compression.codec must be none (it is '",
                 codec_name(c.compression.codec), "')");
  }
  if (auto p = root.table("privacy")) {
    c.privacy = read_privacy_options(*p);
    p->finish();
    POLLEN_CHECK(c.strategy.robust.aggregation == "mean" && c.strategy.robust.norm_bound == 0,
                 root.where("privacy"),
                 ": central DP clips and averages updates itself; it "
                 "needs strategy.aggregation = 'mean' and no strategy.norm_bound");
    // Under secure aggregation the clients clip and noise (distributed DP, fed/privacy.h).
    if (c.secure_aggregation.enabled && c.privacy.secure_noise) {
      log::warn_job(p->where("secure_noise"),
                    ": no effect with secure aggregation, whose clients add discrete Gaussian "
                    "noise (no floating-point noise to harden)");
    }
    POLLEN_CHECK(!c.secure_aggregation.enabled || !c.privacy.poisson(), p->where("sampling"),
                 ": with secure aggregation the clients add the noise, and an empty or failed "
                 "Poisson sample would release nothing the accountant counts; use 'fixed'");
    POLLEN_CHECK(!c.secure_aggregation.enabled || !c.privacy.adaptive_clip ||
                     c.secure_aggregation.range >= 0.5,
                 root.where("secure_aggregation.range"),
                 ": adaptive clipping masks each client's indicator +-1/2 with its update, so "
                 "range must be at least 0.5, got ",
                 c.secure_aggregation.range);
  }
  POLLEN_CHECK(!c.secure_aggregation.enabled ||
                   (c.strategy.robust.aggregation == "mean" && c.strategy.robust.norm_bound == 0),
               root.where("secure_aggregation"),
               ": the server learns only the sum, so strategy.aggregation must be 'mean' and "
               "strategy.norm_bound 0 (robust rules need the single updates)");
  // Row weighting needs each client's token counts in the clear and per-row weights; neither
  // the masked sum nor central DP's bounded weights carry them (docs/federated.md).
  POLLEN_CHECK(!c.strategy.weights_rows() || !c.secure_aggregation.enabled,
               root.where("strategy.row_weighting"), ": '", c.strategy.row_weighting,
               "' needs every client's token counts in the clear, which would reveal each "
               "silo's token histogram that secure aggregation is there to hide, and per-row "
               "weights that the masked sum does not carry; use row_weighting = 'none' with "
               "secure aggregation");
  POLLEN_CHECK(!c.strategy.weights_rows() || !c.privacy.enabled,
               root.where("strategy.row_weighting"), ": '", c.strategy.row_weighting,
               "' weights rows by token counts, which central DP's clip and bounded weights do "
               "not cover; use row_weighting = 'none' with [privacy]");
  POLLEN_CHECK(!c.strategy.weights_rows() || !c.post.enabled(),
               root.where("strategy.row_weighting"), ": '", c.strategy.row_weighting,
               "' weights the rows of token embeddings, and a [post] federation exchanges only "
               "LoRA adapters; use row_weighting = 'none' with [post]");
  POLLEN_CHECK(c.strategy.embedding_lr_scale == 1.0 || !c.post.enabled(),
               root.where("strategy.embedding_lr_scale"), ": ", c.strategy.embedding_lr_scale,
               " scales the token embedding's outer step, and a [post] federation exchanges only "
               "LoRA adapters; leave it at 1 with [post]");
  // Shared moments (second and first) travel per client in the clear, outside the masked sum
  // and the DP clip, and a [post] silo trains adapters with its own optimizer
  // (docs/federated.md).
  for (const auto& [key, value] : {std::pair{"second_moments", c.strategy.second_moments},
                                   std::pair{"first_moments", c.strategy.first_moments}}) {
    if (value == "none") continue;
    POLLEN_CHECK(c.strategy.robust.aggregation == "mean" && c.strategy.robust.norm_bound == 0,
                 root.where(cat("strategy.", key)), ": '", value,
                 "' averages the clients' moments by tokens, which robust aggregation would not "
                 "protect; it needs strategy.aggregation = 'mean' and no strategy.norm_bound");
    POLLEN_CHECK(!c.secure_aggregation.enabled && !c.privacy.enabled && !c.post.enabled(),
                 root.where(cat("strategy.", key)), ": '", value,
                 "' sends each client's optimizer statistics in the clear, which secure "
                 "aggregation and [privacy] do not cover, and a [post] federation does not "
                 "exchange; use ",
                 key, " = 'none' with them");
  }
  // First moments are encoded with the round's codecs, where top-k and sign would lose most of
  // them: no error feedback carries what they leave out of a moment to the next round.
  const std::string& fm = c.strategy.first_moments;
  POLLEN_CHECK(!c.strategy.shares_first_moments() ||
                   (c.compression.codec != Codec::topk && c.server_codec != Codec::topk &&
                    c.compression.codec != Codec::sign && c.server_codec != Codec::sign),
               root.where("strategy.first_moments"), ": '", fm,
               "' sends the moments with the round's codecs, and topk or sign without error "
               "feedback would lose most of them; use none, bf16, int8, int4, nf3, nf2 or mix");
  // A client steps by m / sqrt(v): with the federation's m and its own v, a row its silo rarely
  // writes (a small v) takes the other silos' m at full scale. bench/fed_vs_central diverged so in
  // round 2, float32 and nf2, 4 and 8 clients (bench/README.md, "The baseline at its own learning
  // rate"); shared second moments give every client the federation's v as well.
  POLLEN_CHECK(!c.strategy.shares_first_moments() || c.strategy.shares_second_moments(),
               root.where("strategy.first_moments"), ": '", fm,
               "' needs strategy.second_moments = 'factored': the clients would divide the "
               "federation's first moments by their own second moments, which are small on the "
               "rows their silo rarely writes, and training diverges");
  // nf2 and nf3 have no zero level (mix codes blocks with them too), and a moment has no error
  // feedback: a block that spans two token rows hands a rarely written row a busy row's noise,
  // every round. bench/fed_vs_central diverged so (blocks of 256 over rows of 64, bench/README.md
  // "int8 at 400x"); blocks within a row do not.
  const int64_t row = c.model.hidden_size, block = c.compression.block;
  const auto no_zero_level = [](Codec codec) {
    return codec == Codec::nf2 || codec == Codec::nf3 || codec == Codec::mix;
  };
  const Codec zeroless = no_zero_level(c.compression.codec) ? c.compression.codec : c.server_codec;
  POLLEN_CHECK(!c.strategy.shares_first_moments() || !no_zero_level(zeroless) || row % block == 0,
               root.where("compression.block"), ": ", block,
               " values per scale span more than one token row (model.hidden_size ", row,
               ") of the first moments that strategy.first_moments = '", fm, "' sends with ",
               codec_name(zeroless),
               zeroless == Codec::mix ? ", whose nf2 and nf3 blocks have no zero level"
                                      : ", which has no zero level",
               ": a rarely written row would take a busy row's noise "
               "and training diverges; use a block that divides ",
               row, ", or int8 or int4");
  c.tls = read_tls(root, true);
  return c;
}

void check_plaintext(const std::string& address, const TlsFiles& tls, bool allowed,
                     const std::string& where) {
  if (tls.enabled() || allowed || address.starts_with("unix:") ||
      address.starts_with("unix-abstract:"))
    return;
  std::string host = address.substr(0, address.rfind(':'));
  if (host.starts_with('[') && host.ends_with(']')) host = host.substr(1, host.size() - 2);
  for (char& ch : host) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (host.starts_with("::ffff:")) host = host.substr(7);  // an IPv4 address mapped into IPv6
  // 127.x.y.z written as an address, not a name that starts so (127.example.org).
  const bool ipv4_loopback = host.starts_with("127.") &&
                             host.find_first_not_of("0123456789.") == std::string::npos &&
                             std::count(host.begin(), host.end(), '.') == 3;
  const bool loopback = host == "localhost" || host == "::1" || ipv4_loopback;
  POLLEN_CHECK(loopback, where, ": '", address,
               "' is reachable from other hosts, and without [tls] anyone there could join, "
               "pull and push as any client; add [tls] (pollen fed certs makes its files), listen "
               "on 127.0.0.1, or set server.allow_plaintext = true on a network you trust");
}

SiloParallel read_silo_parallel(ConfigTable& p) {
  SiloParallel c;
  c.zero = train::read_zero_key(p);
  train::read_reduction_keys(p, c.bucket_mb, c.timeout_s);
  p.finish();
  return c;
}

namespace {

// [dp_sgd]: pollen train's [privacy] keys, less target_epsilon (a client does not know how many
// local steps the federation will ask of it).
optim::DpSgdOptions read_silo_dp_sgd(ConfigTable& t) {
  POLLEN_CHECK(!t.has("target_epsilon"), t.where("target_epsilon"),
               ": a client does not know how many local steps the federation will ask of it; "
               "give noise_multiplier (the client logs its epsilon after each round)");
  return train::read_dp_sgd(t);
}

ServerConfig read_server_root(ConfigTable& root) {
  ServerConfig c = read_server_config(root);
  // fed server listens (a simulation, on the same config keys, does not).
  check_plaintext(c.address, c.tls, c.allow_plaintext, root.where("server.address"));
  root.finish();
  c.settings = root.flat();
  return c;
}

ClientConfig read_client_root(ConfigTable& root) {
  ClientConfig c;
  auto t = root.table("client");
  POLLEN_CHECK(t.has_value(), root.where("client"), ": a [client] table is required");
  c.id = t->require_string("id");
  check_client_id(c.id, t->where("id"));
  c.server = t->get_string("server", c.server);
  check_grpc_address(c.server, t->where("server"));
  c.seed = static_cast<uint64_t>(t->get_int_in("seed", 0, 0, kConfigIntMax));
  c.threads = static_cast<int>(t->get_int_in("threads", 0, 0, kConfigThreadsMax));
  c.connect_timeout_s = t->get_double("connect_timeout_s", c.connect_timeout_s);
  check_seconds(*t, "connect_timeout_s", c.connect_timeout_s, true);
  c.busy_timeout_s = t->get_double("busy_timeout_s", c.busy_timeout_s);
  check_seconds(*t, "busy_timeout_s", c.busy_timeout_s, true);
  c.state_dir = t->get_string("state_dir", "");
  c.allow_repeatable_noise = t->get_bool("allow_repeatable_noise", c.allow_repeatable_noise);
  c.keep_checkpoints =
      static_cast<int>(t->get_int_in("keep_checkpoints", c.keep_checkpoints, 1, INT32_MAX));
  t->finish();
  if (auto l = root.table("local_dp")) {
    c.local_dp = read_local_dp_options(*l);
    POLLEN_CHECK(c.local_dp.noise_seed < 0 || c.allow_repeatable_noise, l->where("noise_seed"),
                 ": repeatable noise gives no privacy against anyone who knows the seed; set "
                 "client.allow_repeatable_noise = true to take it (tests)");
  }
  c.tls = read_tls(root, false);
  if (auto p = root.table("post")) {
    c.post = read_post_settings(*p, true);
    refuse_beside_post(root, {"data", "train", "model", "tokenizer", "dp_sgd"},
                       "a post-training silo's base, tokenizer, optimizer and objective are "
                       "post.run's, its data post.data");
    if (auto par = root.table("parallel")) {
      c.parallel = read_silo_parallel(*par);
      POLLEN_CHECK(c.parallel.zero == 0, par->where("zero"),
                   ": a post-training silo does not shard its optimizer (its AdamW state is the "
                   "adapters' alone); leave zero out");
    }
    root.finish();
    return c;
  }
  auto d = root.table("data");
  POLLEN_CHECK(d.has_value(), root.where("data"), ": a [data] table with manifests is required");
  c.manifests = d->get_strings("manifests");
  POLLEN_CHECK(!c.manifests.empty(), d->where("manifests"), ": at least one manifest is required");
  d->finish();
  if (auto tr = root.table("train")) c.train = read_local_train(*tr);
  if (auto p = root.table("parallel")) c.parallel = read_silo_parallel(*p);
  if (auto p = root.table("dp_sgd")) {
    c.dp_sgd = read_silo_dp_sgd(*p);
    POLLEN_CHECK(c.dp_sgd.noise_seed < 0 || c.allow_repeatable_noise, p->where("noise_seed"),
                 ": a repeatable sample and noise give no privacy against anyone who knows the "
                 "seed; set client.allow_repeatable_noise = true to take them (tests)");
  }
  c.model = read_model(root, &c.init_from);
  check_seq_fits(c.train, c.model, root);
  c.tokenizer_fingerprint = read_tokenizer(root);
  root.finish();
  return c;
}

SimConfig read_sim_root(ConfigTable& root) {
  SimConfig c;
  c.server = read_server_config(root);
  LocalTrainConfig train;
  if (auto tr = root.table("train")) train = read_local_train(*tr);
  check_seq_fits(train, c.server.model, root);
  LocalDpOptions local_dp;
  if (auto l = root.table("local_dp")) local_dp = read_local_dp_options(*l);
  optim::DpSgdOptions dp_sgd;
  if (auto p = root.table("dp_sgd")) dp_sgd = read_silo_dp_sgd(*p);
  auto sim = root.table("sim");
  POLLEN_CHECK(sim.has_value(), root.where("sim"), ": a [sim] table is required");
  const auto ids = sim->get_strings("clients");
  const auto manifests = sim->get_strings("manifests");
  c.threads = static_cast<int>(sim->get_int_in("threads", 0, 0, kConfigThreadsMax));
  c.client_states = sim->get_bool("client_states", true);
  POLLEN_CHECK(!ids.empty(), sim->where("clients"), ": at least one client id is required");
  POLLEN_CHECK(manifests.size() == ids.size(), sim->where("manifests"),
               ": one manifest per client is required (", ids.size(), " clients, ",
               manifests.size(), " manifests)");
  sim->finish();
  POLLEN_CHECK(!c.server.post.enabled(), root.where("post"),
               ": post-training federations are simulated by `pollen fed post`");
  POLLEN_CHECK(!c.server.tls.enabled(), root.where("tls"),
               ": the simulation runs in one process and takes no TLS files");
  for (size_t i = 0; i < ids.size(); ++i) {
    ClientConfig cc;
    cc.id = ids[i];
    check_client_id(cc.id, sim->where("clients"));
    // Two clients of one id would share a state folder and count as one in every round.
    POLLEN_CHECK(std::find(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(i), ids[i]) ==
                     ids.begin() + static_cast<std::ptrdiff_t>(i),
                 sim->where("clients"), ": client id '", ids[i], "' appears twice");
    cc.seed = c.server.seed + 1 + i;
    cc.threads = c.threads;
    cc.model = c.server.model;
    cc.init_from = c.server.init_from;
    cc.tokenizer_fingerprint = c.server.tokenizer_fingerprint;
    cc.manifests = {manifests[i]};
    cc.train = train;
    cc.local_dp = local_dp;
    // One process runs the server and every client: whoever set the server's noise_seed speaks
    // for the clients too.
    cc.allow_repeatable_noise = true;
    if (local_dp.noise_seed >= 0)
      cc.local_dp.noise_seed = local_dp.noise_seed + static_cast<int64_t>(i);
    cc.dp_sgd = dp_sgd;
    if (dp_sgd.noise_seed >= 0) cc.dp_sgd.noise_seed = dp_sgd.noise_seed + static_cast<int64_t>(i);
    c.clients.push_back(cc);
  }
  root.finish();
  c.server.settings = root.flat();
  c.server.command = c.command;
  return c;
}

}  // namespace

ServerConfig load_server_config(const std::filesystem::path& path) {
  ConfigTable root = ConfigTable::load(path);
  return read_server_root(root);
}

ClientConfig load_client_config(const std::filesystem::path& path) {
  ConfigTable root = ConfigTable::load(path);
  return read_client_root(root);
}

SimConfig load_sim_config(const std::filesystem::path& path) {
  ConfigTable root = ConfigTable::load(path);
  return read_sim_root(root);
}

ServerConfig parse_server_config(const std::string& text, const std::string& source) {
  ConfigTable root = ConfigTable::parse(text, source);
  return read_server_root(root);
}

ClientConfig parse_client_config(const std::string& text, const std::string& source) {
  ConfigTable root = ConfigTable::parse(text, source);
  return read_client_root(root);
}

SimConfig parse_sim_config(const std::string& text, const std::string& source) {
  ConfigTable root = ConfigTable::parse(text, source);
  return read_sim_root(root);
}

}  // namespace pollen::fed
