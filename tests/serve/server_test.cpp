// The OpenAI-compatible server over real HTTP on an ephemeral port, with a tiny random model:
// completions equal model::generate (greedy, seeded, batched), echo + logprobs equal `pollen
// score`'s values, chat whole and streamed, concurrent requests batched and served correctly, and
// each error with its status and OpenAI-style body. `pollen serve` itself: refusing an open
// address without a key, and serving a post-training checkpoint with the chat template it names
// and only its tokenizer's ids.
#include "serve/server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>

#include "eval/multiple_choice.h"
#include "eval/rolling.h"
#include "io/model_source.h"
#include "support/errors.h"
#include "support/process.h"
#include "support/tiny_lm.h"
#include "tokenizer/hf_format.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/post_run.h"
#include "train/sft.h"

namespace pollen {
namespace {

using json = nlohmann::json;

// A TCP connection to 127.0.0.1:port, for requests no HTTP client library would send; -1 when
// it fails.
int connect_loopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` as it is on a fresh connection; everything the server answers until it closes.
std::string raw_exchange(int port, const std::string& request) {
  const int fd = connect_loopback(port);
  EXPECT_GE(fd, 0);
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) response.append(buffer, n);
  close(fd);
  return response;
}

class Serving : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tok_ = new tokenizer::Tokenizer(testing::tiny_tokenizer());
    model_ = new model::Llama(testing::tiny_model(tok_->vocab_size()));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tok_;
  }

  static uint32_t eot() {
    return tok_->encode("<|endoftext|>", {tokenizer::SpecialPolicy::allow_all()})[0];
  }

  static serve::ServerOptions options() {
    serve::ServerOptions o;
    o.port = 0;
    o.model = {"tiny", 256, {eot()}, {}, {}, {}};
    o.limits.max_prompt_tokens = 64;
    o.limits.max_tokens = 32;
    o.limits.max_body_bytes = 4096;
    o.limits.max_concurrent = 4;
    o.chat = tokenizer::ChatFormat{tokenizer::ChatTemplate::chatml, {}};
    return o;
  }

  void start(serve::ServerOptions o = options()) {
    server_ = std::make_unique<serve::Server>(*model_, *tok_, std::move(o));
    server_->start();
  }

  // POSTs a JSON body; returns (status, parsed body or the raw text as a string).
  std::pair<int, json> post(const std::string& path, const std::string& body,
                            const httplib::Headers& headers = {}) {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60);
    auto r = c.Post(path.c_str(), headers, body, "application/json");
    if (!r) return {0, json()};
    json j = json::parse(r->body, nullptr, false);
    return {r->status, j.is_discarded() ? json(r->body) : j};
  }
  std::pair<int, json> post(const std::string& path, const json& body,
                            const httplib::Headers& headers = {}) {
    return post(path, body.dump(), headers);
  }

  static std::vector<uint32_t> prompt_ids(const std::string& text) {
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    eo.add_bos_eos = true;
    return tok_->encode(text, eo);
  }

  // The prompt the server renders for a conversation (the fixture's ChatML template).
  static std::vector<uint32_t> chat_prompt(const std::vector<tokenizer::ChatMessage>& msgs) {
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    return tok_->encode(tokenizer::render_chat(tokenizer::ChatTemplate::chatml, msgs, true), eo);
  }

  static model::SamplingOptions sampling(int64_t max_tokens, double temperature, uint64_t seed) {
    model::SamplingOptions o;
    o.max_tokens = max_tokens;
    o.temperature = temperature;
    o.seed = seed;
    o.stop_tokens = {eot()};
    return o;
  }

  // Text as the server sends it: JSON strings hold UTF-8, so bytes a random model strings
  // together invalidly arrive as U+FFFD.
  static std::string sent(const std::string& text) {
    return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace))
        .get<std::string>();
  }
  static std::string decode(const std::vector<uint32_t>& ids) { return sent(tok_->decode(ids)); }
  // Generated text as the server sends it: special tokens left out.
  static std::string reply_text(const std::vector<uint32_t>& ids) {
    return sent(tok_->generated_text(ids));
  }

  static void expect_error(const std::pair<int, json>& r, int status, const std::string& param) {
    EXPECT_EQ(r.first, status) << r.second.dump();
    ASSERT_TRUE(r.second.is_object() && r.second.contains("error")) << r.second.dump();
    const json& e = r.second["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty());
    EXPECT_TRUE(e["type"].is_string());
    EXPECT_TRUE(e.contains("param") && e.contains("code"));
    if (!param.empty()) EXPECT_EQ(e["param"], param) << e.dump();
  }

  // The data: payloads of a server-sent event stream.
  static std::vector<std::string> events(const std::string& body) {
    std::vector<std::string> out;
    size_t at = 0;
    while ((at = body.find("data: ", at)) != std::string::npos) {
      const size_t end = body.find("\n\n", at);
      out.push_back(body.substr(at + 6, end - at - 6));
      at = end;
    }
    return out;
  }

  std::string post_stream(const std::string& path, const json& body) {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60);
    auto r = c.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return {};
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream; charset=utf-8");
    return r->body;
  }

  static tokenizer::Tokenizer* tok_;
  static model::Llama* model_;
  std::unique_ptr<serve::Server> server_;
};

tokenizer::Tokenizer* Serving::tok_ = nullptr;
model::Llama* Serving::model_ = nullptr;

TEST_F(Serving, HealthAndModels) {
  start();
  httplib::Client c("127.0.0.1", server_->port());
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  const json j = json::parse(m->body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["data"][0]["id"], "tiny");
}

TEST_F(Serving, ASecondServerOnTheSamePortIsRefused) {
  // It would otherwise take a share of the first one's requests.
  start();
  serve::ServerOptions o = options();
  o.port = server_->port();
  try {
    serve::Server second(*model_, *tok_, o);
    ADD_FAILURE() << "a second server listened on port " << o.port;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen"), std::string::npos) << e.what();
  }
  httplib::Client c("127.0.0.1", server_->port());
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

TEST_F(Serving, AServerStoppedRightAfterItStartedEnds) {
  // Before its thread listened, cpp-httplib's stop() did nothing and stop() waited for ever.
  for (int i = 0; i < 20; ++i) {
    serve::Server s(*model_, *tok_, options());
    s.start();
    s.stop();
  }
}

TEST_F(Serving, CompletionsEqualGenerate) {
  start();
  // Greedy, one prompt.
  const std::string p0 = "The cat sat", p1 = "Rome is";
  auto r = post("/v1/completions",
                json{{"model", "tiny"}, {"prompt", p0}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const auto greedy = model::generate(*model_, {prompt_ids(p0)}, sampling(8, 0, 0));
  EXPECT_EQ(r.second["object"], "text_completion");
  EXPECT_EQ(r.second["choices"][0]["text"], reply_text(greedy[0].tokens));
  EXPECT_EQ(r.second["choices"][0]["finish_reason"], greedy[0].finish_reason);
  EXPECT_EQ(r.second["usage"]["completion_tokens"], greedy[0].tokens.size());
  EXPECT_EQ(r.second["usage"]["prompt_tokens"], prompt_ids(p0).size());
  // Seeded sampling over a list of prompts: prompt i draws from Rng(seed).fork(i).
  r = post("/v1/completions",
           json{{"prompt", {p0, p1}}, {"max_tokens", 12}, {"temperature", 0.9}, {"seed", 11}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const auto sampled =
      model::generate(*model_, {prompt_ids(p0), prompt_ids(p1)}, sampling(12, 0.9, 11));
  ASSERT_EQ(r.second["choices"].size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_EQ(r.second["choices"][i]["text"], reply_text(sampled[i].tokens)) << i;
  // Token-id prompts go to the model as given.
  const auto ids = prompt_ids(p1);
  r = post("/v1/completions",
           json{{"prompt", {ids}}, {"max_tokens", 12}, {"temperature", 0.9}, {"seed", 11}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const auto alone = model::generate(*model_, {ids}, sampling(12, 0.9, 11));  // fork(0) now
  EXPECT_EQ(r.second["choices"][0]["text"], reply_text(alone[0].tokens));
  EXPECT_NE(alone[0].tokens, sampled[1].tokens);
}

// n choices per prompt: choice k is prompt k / n's, sampled from Rng(seed).fork(k), as
// `pollen generate` samples its k-th prompt; prompt tokens count once per prompt in the usage.
TEST_F(Serving, NChoicesPerPromptEachFromItsOwnFork) {
  start();
  const std::string p0 = "The cat sat", p1 = "Rome is";
  auto r = post(
      "/v1/completions",
      json{{"prompt", {p0, p1}}, {"n", 2}, {"max_tokens", 10}, {"temperature", 0.9}, {"seed", 5}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const auto ids0 = prompt_ids(p0), ids1 = prompt_ids(p1);
  const auto expected = model::generate(*model_, {ids0, ids0, ids1, ids1}, sampling(10, 0.9, 5));
  ASSERT_EQ(r.second["choices"].size(), 4u);
  size_t generated = 0;
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(r.second["choices"][k]["index"], k);
    EXPECT_EQ(r.second["choices"][k]["text"], reply_text(expected[k].tokens)) << k;
    generated += expected[k].tokens.size();
  }
  EXPECT_NE(expected[0].tokens, expected[1].tokens) << "two choices of one prompt should differ";
  EXPECT_EQ(r.second["usage"]["prompt_tokens"], ids0.size() + ids1.size());
  EXPECT_EQ(r.second["usage"]["completion_tokens"], generated);

  // Chat: choice j from fork(j), whole and streamed alike.
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Hello"}}}},
                     {"n", 3},
                     {"max_tokens", 8},
                     {"temperature", 0.9},
                     {"seed", 9}};
  r = post("/v1/chat/completions", chat);
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const auto prompt = chat_prompt({{"user", "Hello"}});
  const auto replies = model::generate(*model_, {prompt, prompt, prompt}, sampling(8, 0.9, 9));
  ASSERT_EQ(r.second["choices"].size(), 3u);
  for (size_t j = 0; j < 3; ++j)
    EXPECT_EQ(r.second["choices"][j]["message"]["content"], reply_text(replies[j].tokens)) << j;
  json streamed_chat = chat;
  streamed_chat["stream"] = true;
  const auto ev = events(post_stream("/v1/chat/completions", streamed_chat));
  std::vector<std::string> streamed(3);
  std::vector<int> roles(3), finishes(3);
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    const json c = json::parse(ev[i])["choices"][0];
    const size_t j = c["index"].get<size_t>();
    ASSERT_LT(j, 3u);
    roles[j] += c["delta"].contains("role");
    finishes[j] += !c["finish_reason"].is_null();
    if (c["delta"].contains("content")) streamed[j] += c["delta"]["content"].get<std::string>();
  }
  for (size_t j = 0; j < 3; ++j) {
    EXPECT_EQ(streamed[j], reply_text(replies[j].tokens)) << j;
    EXPECT_EQ(roles[j], 1) << j;
    EXPECT_EQ(finishes[j], 1) << j;
  }
  // Choices are bounded as prompts are: prompts times n at most --max-prompts.
  json many = chat;
  many["n"] = 65;
  expect_error(post("/v1/chat/completions", many), 400, "n");
  auto opts = options();
  expect_error(post("/v1/completions", json{{"prompt", {p0, p1}}, {"n", opts.limits.max_prompts}}),
               400, "n");
}

TEST_F(Serving, EchoLogprobsEqualScore) {
  start();
  const std::string text = "Paris is the capital of France.";
  const auto ids = prompt_ids(text);
  const auto expected = eval::sequence_logprobs(*model_, ids, 256);  // what `pollen score` writes
  for (const json& prompt : {json(text), json(ids)}) {
    auto r = post("/v1/completions", json{{"prompt", prompt},
                                          {"max_tokens", 0},
                                          {"echo", true},
                                          {"logprobs", 2},
                                          {"temperature", 0}});
    ASSERT_EQ(r.first, 200) << r.second.dump();
    const json& c = r.second["choices"][0];
    EXPECT_EQ(c["text"], text);
    const json& lp = c["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), ids.size());
    ASSERT_EQ(lp["token_logprobs"].size(), ids.size());
    EXPECT_TRUE(lp["token_logprobs"][0].is_null());
    EXPECT_TRUE(lp["top_logprobs"][0].is_null());
    std::string joined;
    for (size_t i = 0; i < ids.size(); ++i) {
      joined += lp["tokens"][i].get<std::string>();
      if (i == 0) continue;
      EXPECT_EQ(lp["token_logprobs"][i].get<double>(), *expected[i]) << i;  // bit for bit
      // the two most likely, and the token itself when it is not one of them (OpenAI: up to
      // logprobs + 1)
      ASSERT_GE(lp["top_logprobs"][i].size(), 2u);
      ASSERT_LE(lp["top_logprobs"][i].size(), 3u);
      const std::string name = lp["tokens"][i].get<std::string>();
      ASSERT_TRUE(lp["top_logprobs"][i].contains(name)) << i << ": " << lp.dump();
      EXPECT_EQ(lp["top_logprobs"][i].at(name), lp["token_logprobs"][i]);
      double best = -1e300;
      for (const auto& [t, v] : lp["top_logprobs"][i].items())
        best = std::max(best, v.get<double>());
      EXPECT_GE(best, lp["token_logprobs"][i].get<double>());
      EXPECT_EQ(lp["text_offset"][i].get<int64_t>(),
                eval::char_length(decode({ids.begin(), ids.begin() + static_cast<long>(i)})));
    }
    EXPECT_EQ(joined, text);
    EXPECT_EQ(lp["text_offset"][0], 0);
  }
  // lm-evaluation-harness's loglikelihood request: max_tokens 1, echo, logprobs 1; it sums
  // token_logprobs[ctxlen:-1], the continuation's tokens given the context's.
  const auto pair = eval::encode_pair(*tok_, "Paris is the capital of", " France.", 0);
  std::vector<uint32_t> all = pair.context;
  all.insert(all.end(), pair.continuation.begin(), pair.continuation.end());
  auto r = post("/v1/completions", json{{"model", "tiny"},
                                        {"prompt", {all}},
                                        {"temperature", 0},
                                        {"max_tokens", 1},
                                        {"logprobs", 1},
                                        {"seed", 1234},
                                        {"echo", true}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const json& lps = r.second["choices"][0]["logprobs"]["token_logprobs"];
  ASSERT_EQ(lps.size(), all.size() + 1);
  double sum = 0;
  for (size_t i = pair.context.size(); i + 1 < lps.size(); ++i) sum += lps[i].get<double>();
  const auto direct =
      eval::continuation_logprobs(*model_, std::vector<eval::TokenPair>{pair}, 256, 1);
  EXPECT_NEAR(sum, direct[0], 1e-4);
}

// Bytes that are no character come back as U+FFFD in the text, one per invalid run; such a token is
// named "bytes:\xNN" in the logprobs, as OpenAI names them; text_offset counts the text as it comes
// back, so each token's offset is where its text starts in the reply's text.
TEST_F(Serving, TextOffsetsCountInvalidBytesAsTheTextShowsThem) {
  start();
  const auto ids = prompt_ids("Sun\x80\xBFrom");  // two stray continuation bytes
  auto r = post("/v1/completions",
                json{{"prompt", ids}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const json& c = r.second["choices"][0];
  EXPECT_EQ(c["text"], "Sun\uFFFD\uFFFDrom");
  const json& lp = c["logprobs"];
  EXPECT_EQ(lp["tokens"][2], "bytes:\\x80");
  EXPECT_EQ(lp["tokens"][3], "bytes:\\xbf");
  int64_t at = 0;  // code points of the tokens before this one, as the reply shows them
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    EXPECT_EQ(lp["text_offset"][i].get<int64_t>(), at) << "token " << i << ": " << lp.dump();
    const std::string name = lp["tokens"][i].get<std::string>();
    at += name.starts_with("bytes:") ? 1 : eval::char_length(name);  // a stray byte: one U+FFFD
  }
}

// Generated special tokens are left out of the text, and text_offset counts the text as it comes
// back: each plain token's text starts at its offset, and a special token adds nothing.
TEST_F(Serving, TextOffsetsPointIntoTheTextWithoutItsSpecialTokens) {
  start();
  // (seed 5's fork 2 samples <|im_start|> in the middle of this prompt's continuation)
  auto r = post("/v1/completions", json{{"prompt", {"The cat sat", "Rome is"}},
                                        {"n", 2},
                                        {"max_tokens", 10},
                                        {"temperature", 0.9},
                                        {"seed", 5},
                                        {"echo", true},
                                        {"logprobs", 0}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  size_t specials = 0;
  for (const json& c : r.second["choices"]) {
    const std::string text = c["text"].get<std::string>();
    std::vector<std::string> chars;  // the text as code points (JSON text is UTF-8)
    for (size_t i = 0; i < text.size(); ++i) {
      if ((static_cast<uint8_t>(text[i]) & 0xC0) != 0x80) chars.emplace_back();
      chars.back() += text[i];
    }
    const json& lp = c["logprobs"];
    for (size_t i = 0; i < lp["tokens"].size(); ++i) {
      const std::string name = lp["tokens"][i].get<std::string>();
      const auto at = lp["text_offset"][i].get<size_t>();
      ASSERT_LE(at, chars.size()) << c.dump();
      if (name == "<|im_start|>" || name == "<|im_end|>" || name == "<|endoftext|>") {
        ++specials;
        const size_t next =
            i + 1 < lp["tokens"].size() ? lp["text_offset"][i + 1].get<size_t>() : chars.size();
        EXPECT_EQ(next, at) << "token " << i << ": " << c.dump();
        continue;
      }
      if (name.starts_with("bytes:")) continue;  // part of a character
      std::string from;
      for (size_t k = at; k < chars.size(); ++k) from += chars[k];
      EXPECT_TRUE(from.starts_with(name)) << "token " << i << " '" << name << "': " << c.dump();
    }
  }
  EXPECT_GT(specials, 0u) << r.second.dump();  // the case this test is about was generated
}

TEST_F(Serving, StopStringsCutTheText) {
  start();
  const auto full = model::generate(*model_, {prompt_ids("Bees make")}, sampling(16, 0, 0),
                                    [](std::span<const uint32_t> t) { return tok_->decode(t); });
  const std::string text = full[0].text;
  ASSERT_GE(text.size(), 6u) << text;
  size_t at = 3;  // a stop string of two printable ASCII bytes from the middle of the text
  while (at + 1 < text.size() && !(std::isprint(static_cast<unsigned char>(text[at])) &&
                                   std::isprint(static_cast<unsigned char>(text[at + 1]))))
    ++at;
  ASSERT_LT(at + 1, text.size()) << text;
  const std::string stop = text.substr(at, 2);
  auto r =
      post("/v1/completions",
           json{{"prompt", "Bees make"}, {"max_tokens", 16}, {"temperature", 0}, {"stop", {stop}}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_EQ(r.second["choices"][0]["text"], sent(text.substr(0, text.find(stop))));
  EXPECT_EQ(r.second["choices"][0]["finish_reason"], "stop");
  // Streamed, the same text arrives in pieces, never past the stop string.
  const std::string body = post_stream("/v1/completions", json{{"prompt", "Bees make"},
                                                               {"max_tokens", 16},
                                                               {"temperature", 0},
                                                               {"stop", stop},
                                                               {"stream", true}});
  const auto ev = events(body);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(ev.back(), "[DONE]");
  std::string streamed;
  for (size_t i = 0; i + 1 < ev.size(); ++i)
    streamed += json::parse(ev[i])["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(streamed, sent(text.substr(0, text.find(stop))));
}

TEST_F(Serving, ChatWholeAndStreamed) {
  start();
  const json messages = {{{"role", "system"}, {"content", "You are terse."}},
                         {{"role", "user"}, {"content", "What is two plus two?"}}};
  const std::vector<tokenizer::ChatMessage> msgs = {{"system", "You are terse."},
                                                    {"user", "What is two plus two?"}};
  const auto prompt = chat_prompt(msgs);
  const auto expected = model::generate(*model_, {prompt}, sampling(20, 0, 0));
  auto r = post("/v1/chat/completions",
                json{{"messages", messages}, {"max_tokens", 20}, {"temperature", 0}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_EQ(r.second["object"], "chat.completion");
  EXPECT_EQ(r.second["choices"][0]["message"]["role"], "assistant");
  const std::string content = r.second["choices"][0]["message"]["content"];
  EXPECT_EQ(content, reply_text(expected[0].tokens));
  EXPECT_EQ(r.second["usage"]["prompt_tokens"], prompt.size());

  const std::string body = post_stream(
      "/v1/chat/completions",
      json{{"messages", messages}, {"max_tokens", 20}, {"temperature", 0}, {"stream", true}});
  const auto ev = events(body);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev.back(), "[DONE]");
  const json first = json::parse(ev[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  std::string streamed;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    const json d = json::parse(ev[i])["choices"][0]["delta"];
    if (d.contains("content")) streamed += d["content"].get<std::string>();
  }
  EXPECT_EQ(streamed, content);
  EXPECT_EQ(json::parse(ev[ev.size() - 2])["choices"][0]["finish_reason"],
            expected[0].finish_reason);

  // Text parts are one message, joined by newlines as vLLM joins them.
  const json parts = {
      {{"role", "system"}, {"content", "You are terse."}},
      {{"role", "user"},
       {"content",
        {{{"type", "text"}, {"text", "What is two"}}, {{"type", "text"}, {"text", "plus two?"}}}}}};
  const auto joined =
      chat_prompt({{"system", "You are terse."}, {"user", "What is two\nplus two?"}});
  const auto parted = post("/v1/chat/completions",
                           json{{"messages", parts}, {"max_tokens", 20}, {"temperature", 0}});
  ASSERT_EQ(parted.first, 200) << parted.second.dump();
  EXPECT_EQ(parted.second["choices"][0]["message"]["content"],
            decode(model::generate(*model_, {joined}, sampling(20, 0, 0))[0].tokens));
  EXPECT_EQ(parted.second["usage"]["prompt_tokens"], joined.size());
}

// Chat logprobs: one entry per generated token with its text, bytes and log-probability (as
// scoring the whole conversation gives it) and the most likely alternatives, best first.
TEST_F(Serving, ChatLogprobsScoreEachGeneratedToken) {
  start();
  const json messages = {{{"role", "user"}, {"content", "What is two plus two?"}}};
  const json ask = {{"messages", messages}, {"max_tokens", 12}, {"temperature", 0}};
  json with = ask;
  with["logprobs"] = true;
  with["top_logprobs"] = 3;
  auto r = post("/v1/chat/completions", with);
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const auto prompt = chat_prompt({{"user", "What is two plus two?"}});
  const auto reply = model::generate(*model_, {prompt}, sampling(12, 0, 0));
  const std::vector<uint32_t>& gen = reply[0].tokens;
  std::vector<uint32_t> all = prompt;
  all.insert(all.end(), gen.begin(), gen.end());
  const auto expected = eval::sequence_logprobs(*model_, all, 256);
  ASSERT_GE(gen.size(), 4u) << "a reply this short tests little";
  const json& content = r.second["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), gen.size()) << r.second.dump();
  std::string bytes;
  for (size_t i = 0; i < gen.size(); ++i) {
    const json& e = content[i];
    EXPECT_EQ(e["token"], decode({gen[i]})) << i;
    for (const json& b : e["bytes"]) bytes += static_cast<char>(b.get<int>());
    EXPECT_NEAR(e["logprob"].get<double>(), *expected[prompt.size() + i], 1e-4) << i;
    ASSERT_EQ(e["top_logprobs"].size(), 3u) << i;
    EXPECT_EQ(e["top_logprobs"][0]["token"], e["token"]) << i;  // greedy: the best is chosen
    for (size_t k = 1; k < 3; ++k)
      EXPECT_LE(e["top_logprobs"][k]["logprob"].get<double>(),
                e["top_logprobs"][k - 1]["logprob"].get<double>())
          << i;
  }
  EXPECT_EQ(bytes, tok_->decode(gen));
  EXPECT_EQ(r.second["choices"][0]["message"]["content"], decode(gen));

  r = post("/v1/chat/completions", ask);
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_TRUE(r.second["choices"][0]["logprobs"].is_null()) << r.second.dump();
  json bad = ask;
  bad["top_logprobs"] = 2;
  expect_error(post("/v1/chat/completions", bad), 400, "top_logprobs");
  bad["logprobs"] = true;
  bad["top_logprobs"] = 21;
  expect_error(post("/v1/chat/completions", bad), 400, "top_logprobs");
  bad["top_logprobs"] = 2;
  bad["stream"] = true;
  expect_error(post("/v1/chat/completions", bad), 400, "logprobs");
}

// The peer: OpenAI's official Python client (tests/serve/openai_client.py) validates every
// response against its own types and reads what pollen's generation gives.
TEST_F(Serving, TheOfficialOpenAiClientReadsEveryResponse) {
  const std::string python = POLLEN_PEERS_PYTHON;
  ASSERT_TRUE(std::filesystem::exists(python)) << python << " is missing: run scripts/test-peers";
  start();
  int status = 0;
  const std::string out = testing::run_capture(
      cat(python, " ", POLLEN_SOURCE_DIR,
          "/tests/serve/openai_client.py http://127.0.0.1:", server_->port(), "/v1"),
      &status, /*with_stderr=*/false);
  ASSERT_EQ(status, 0) << out;
  const json got = json::parse(out);
  std::printf("openai client %s\n", got["client_version"].get<std::string>().c_str());
  EXPECT_EQ(got["models"], json({"tiny"}));

  const auto usage = [](size_t prompt, size_t completion) {
    return json{{"prompt_tokens", prompt},
                {"completion_tokens", completion},
                {"total_tokens", prompt + completion}};
  };
  const auto cat_ids = prompt_ids("The cat sat");
  const auto greedy = model::generate(*model_, {cat_ids}, sampling(8, 0, 0));
  EXPECT_EQ(got["completion"]["text"], reply_text(greedy[0].tokens));
  EXPECT_EQ(got["completion"]["finish_reason"], greedy[0].finish_reason);
  EXPECT_EQ(got["completion"]["usage"], usage(cat_ids.size(), greedy[0].tokens.size()));
  EXPECT_EQ(got["completion_streamed"]["text"], got["completion"]["text"]);
  EXPECT_EQ(got["completion_streamed"]["usage"], got["completion"]["usage"]);

  const std::string text = "Paris is the capital of France.";
  const auto ids = prompt_ids(text);
  const auto expected = eval::sequence_logprobs(*model_, ids, 256);
  const json& echo = got["echo"];
  EXPECT_EQ(echo["text"], text);
  ASSERT_EQ(echo["token_logprobs"].size(), ids.size());
  EXPECT_TRUE(echo["token_logprobs"][0].is_null());
  for (size_t i = 1; i < ids.size(); ++i) {
    EXPECT_EQ(echo["token_logprobs"][i].get<double>(), *expected[i]) << i;
    EXPECT_GE(echo["top_logprobs"][i].size(), 2u) << i;
    EXPECT_LE(echo["top_logprobs"][i].size(), 3u) << i;
  }

  const std::vector<tokenizer::ChatMessage> msgs = {{"system", "You are terse."},
                                                    {"user", "What is two plus two?"}};
  const auto prompt = chat_prompt(msgs);
  const auto reply = model::generate(*model_, {prompt}, sampling(20, 0, 0));
  EXPECT_EQ(got["chat"]["role"], "assistant");
  EXPECT_EQ(got["chat"]["content"], decode(reply[0].tokens));
  EXPECT_EQ(got["chat"]["finish_reason"], reply[0].finish_reason);
  EXPECT_EQ(got["chat"]["usage"], usage(prompt.size(), reply[0].tokens.size()));
  EXPECT_EQ(got["chat_streamed"]["content"], got["chat"]["content"]);
  EXPECT_EQ(got["chat_streamed"]["finish_reason"], got["chat"]["finish_reason"]);
  EXPECT_EQ(got["chat_streamed"]["usage"], got["chat"]["usage"]);
  EXPECT_EQ(got["chat_stream_manager"], got["chat"]["content"]);
  const auto two = model::generate(*model_, {prompt, prompt}, sampling(8, 0.9, 3));
  EXPECT_EQ(got["chat_n"], json({{0, decode(two[0].tokens)}, {1, decode(two[1].tokens)}}));
  const json& scored = got["chat_logprobs"];
  ASSERT_EQ(scored.size(), reply[0].tokens.size());
  std::string bytes;
  for (size_t i = 0; i < scored.size(); ++i) {
    EXPECT_EQ(scored[i]["token"], decode({reply[0].tokens[i]})) << i;
    EXPECT_EQ(scored[i]["top"].size(), 2u) << i;
    for (const json& b : scored[i]["bytes"]) bytes += static_cast<char>(b.get<int>());
  }
  EXPECT_EQ(bytes, tok_->decode(reply[0].tokens));

  const json& errors = got["errors"];
  EXPECT_EQ(errors["bad_temperature"]["class"], "BadRequestError");
  EXPECT_EQ(errors["bad_temperature"]["param"], "temperature");
  EXPECT_EQ(errors["bad_temperature"]["type"], "invalid_request_error");
  EXPECT_EQ(errors["unknown_model"]["class"], "NotFoundError");
  EXPECT_EQ(errors["unknown_model"]["code"], "model_not_found");
  EXPECT_EQ(errors["options_without_stream"]["class"], "BadRequestError");
  EXPECT_EQ(errors["options_without_stream"]["param"], "stream_options");
}

TEST_F(Serving, InvalidRequestsGet4xxWithOpenAiErrors) {
  start();
  expect_error(post("/v1/completions", std::string("{\"prompt\": ")), 400, "");
  expect_error(post("/v1/completions", std::string("[1, 2]")), 400, "");
  expect_error(post("/v1/completions", json{{"prompt", "hi"}, {"max_tokens", "ten"}}), 400,
               "max_tokens");
  expect_error(post("/v1/completions", json{{"prompt", "hi"}, {"temperature", 5}}), 400,
               "temperature");
  expect_error(post("/v1/completions", json{{"prompt", 7}}), 400, "prompt");
  expect_error(post("/v1/completions", json{{"prompt", "hi"}, {"echo", "yes"}}), 400, "echo");
  expect_error(post("/v1/completions", json{{"prompt", "hi"}, {"frobnicate", 1}}), 400,
               "frobnicate");
  expect_error(post("/v1/completions", json{{"prompt", {1, 99999}}}), 400, "prompt");
  // More than --max-tokens (32 here), as many clients ask by default: as many as the server
  // generates.
  const auto clamped = post("/v1/completions", json{{"prompt", "hi"}, {"max_tokens", 33}});
  EXPECT_EQ(clamped.first, 200) << clamped.second.dump();
  EXPECT_LE(clamped.second["usage"]["completion_tokens"].get<int64_t>(), 32);
  std::string long_prompt;
  for (int i = 0; i < 40; ++i) long_prompt += "The cat sat. ";
  auto r = post("/v1/completions", json{{"prompt", long_prompt}, {"max_tokens", 1}});
  expect_error(r, 400, "prompt");
  EXPECT_EQ(r.second["error"]["code"], "context_length_exceeded");
  expect_error(post("/v1/completions", json{{"prompt", std::string(5000, 'a')}}), 413, "");
  expect_error(post("/v1/completions", json{{"model", "gpt-9"}, {"prompt", "hi"}}), 404, "model");
  expect_error(post("/v1/completions",
                    json{{"prompt", "hi"}, {"stream_options", {{"include_usage", true}}}}),
               400, "stream_options");
  expect_error(
      post("/v1/completions",
           json{{"prompt", "hi"}, {"stream", true}, {"stream_options", {{"include_usage", 1}}}}),
      400, "stream_options");
  expect_error(post("/v1/completions",
                    json{{"prompt", "hi"}, {"stream", true}, {"stream_options", {{"frob", true}}}}),
               400, "stream_options");
  expect_error(post("/v1/nothing", json{{"prompt", "hi"}}), 404, "");
  // A known endpoint with the wrong method: 405, naming the method it takes.
  {
    httplib::Client c("127.0.0.1", server_->port());
    auto m = c.Post("/v1/models", "{}", "application/json");
    ASSERT_TRUE(m);
    expect_error({m->status, json::parse(m->body)}, 405, "");
    EXPECT_EQ(m->get_header_value("Allow"), "GET");
    EXPECT_EQ(json::parse(m->body)["error"]["message"],
              "POST is not allowed on /v1/models: it takes GET");
    auto g = c.Get("/v1/chat/completions");
    ASSERT_TRUE(g);
    expect_error({g->status, json::parse(g->body)}, 405, "");
    EXPECT_EQ(g->get_header_value("Allow"), "POST");
    // Without a body too (which httplib would answer 400).
    auto empty = c.Post("/v1/models");
    ASSERT_TRUE(empty);
    EXPECT_EQ(empty->status, 405) << empty->body;
    auto d = c.Delete("/tokenize");
    ASSERT_TRUE(d);
    EXPECT_EQ(d->status, 405) << d->body;
  }
  expect_error(post("/v1/chat/completions", json{{"messages", "hi"}}), 400, "messages");
  expect_error(
      post("/v1/chat/completions", json{{"messages", {{{"role", "wizard"}, {"content", "hi"}}}}}),
      400, "messages[0].role");
  expect_error(
      post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", 3}}}}}), 400,
      "messages[0].content");
  expect_error(post("/v1/completions", json{{"prompt", "hi"}, {"stream", true}, {"logprobs", 2}}),
               400, "logprobs");
  expect_error(
      post("/v1/chat/completions",
           json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"top_logprobs", 3}}),
      400, "top_logprobs");
  const json typed = {{"role", "user"}, {"content", {{{"type", 5}, {"text", "x"}}}}};
  expect_error(post("/v1/chat/completions", json{{"messages", {typed}}}), 400,
               "messages[0].content");
}

// Bodies are bounded however they are framed, and JSON however deep: a body sent in chunks past
// max_body_bytes is refused (cpp-httplib bounds Content-Length bodies only), a body nested
// 100000 levels deep is a 400, not a stack overflow, and the server goes on answering.
TEST_F(Serving, BodiesAreBoundedHoweverFramedAndJsonHoweverDeep) {
  serve::ServerOptions o = options();
  const std::string deep = "{\"prompt\": \"hi\", \"temperature\": " + std::string(100000, '[') +
                           std::string(100000, ']') + "}";
  o.limits.max_body_bytes = deep.size() + 1;
  start(o);
  expect_error(post("/v1/completions", deep), 400, "");
  // Sent in chunks: served below the limit, refused above it (a 413, or the connection closed
  // before the client read it).
  auto chunked = [&](const std::string& body) {
    std::string request =
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (size_t at = 0; at < body.size(); at += 1000) {
      const std::string piece = body.substr(at, 1000);
      char size[16];
      std::snprintf(size, sizeof size, "%zx\r\n", piece.size());
      request += size + piece + "\r\n";
    }
    request += "0\r\n\r\n";
    return raw_exchange(server_->port(), request);
  };
  const json small = {{"prompt", "hi"}, {"max_tokens", 1}};
  EXPECT_TRUE(chunked(small.dump()).starts_with("HTTP/1.1 200")) << chunked(small.dump());
  const json large = {{"prompt", "hi"}, {"max_tokens", 1}, {"user", std::string(deep.size(), 'u')}};
  const std::string refused = chunked(large.dump());
  EXPECT_TRUE(refused.empty() || refused.starts_with("HTTP/1.1 413")) << refused.substr(0, 300);
  // A refused body's unread bytes are never read as another request: a GET hidden past the
  // first read of a multipart body, or of a chunked body over the limit, gets no answer.
  const std::string hidden = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  auto answers = [&](const std::string& request) {
    const std::string response = raw_exchange(server_->port(), request);
    size_t count = 0;
    for (size_t at = 0; (at = response.find("HTTP/1.1 ", at)) != std::string::npos; ++at) ++count;
    return count;
  };
  const std::string multipart = std::string(4096, 'x') + hidden;
  EXPECT_LE(answers("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                    "multipart/form-data; boundary=b\r\nContent-Length: " +
                    std::to_string(multipart.size()) + "\r\n\r\n" + multipart),
            1u);
  const std::string big(o.limits.max_body_bytes + 8, 'x');
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", big.size());
  EXPECT_LE(answers("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                    "application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
                    std::string(size) + big + "\r\n0\r\n\r\n" + hidden),
            1u);
  // A JSON body sent as a form (curl -d) over httplib's 8 KiB form limit is still JSON to us.
  httplib::Client c("127.0.0.1", server_->port());
  const json form = {{"prompt", "hi"}, {"max_tokens", 1}, {"user", std::string(9000, 'u')}};
  auto r = c.Post("/v1/completions", form.dump(), "application/x-www-form-urlencoded");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  // A POST without a body, or with one compressed, is told so.
  const auto reply = [&](const std::string& request) {
    return raw_exchange(server_->port(), request);
  };
  const std::string bodiless =
      reply("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(bodiless.starts_with("HTTP/1.1 411")) << bodiless;
  EXPECT_NE(bodiless.find("has no body"), std::string::npos) << bodiless;
  const std::string gzipped = reply(
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
      "Content-Encoding: gzip\r\nContent-Length: 4\r\n\r\n\x1f\x8b\x08\x00");
  EXPECT_TRUE(gzipped.starts_with("HTTP/1.1 415")) << gzipped;
  EXPECT_NE(gzipped.find("Content-Encoding 'gzip'"), std::string::npos) << gzipped;
  // Broken framing is named: a Content-Length that is no byte count, a request line that is no
  // HTTP, and JSON with where its syntax breaks.
  for (const std::string length : {"abc", "-1"}) {
    const std::string framed = reply(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        "Content-Length: " +
        length + "\r\n\r\n{\"prompt\":\"a\"}");
    EXPECT_TRUE(framed.starts_with("HTTP/1.1 400")) << framed;
    EXPECT_NE(framed.find("Content-Length '" + length + "' is not a byte count"), std::string::npos)
        << framed;
  }
  const std::string garbage = reply("GARBAGE\r\n\r\n");
  EXPECT_TRUE(garbage.starts_with("HTTP/1.1 400")) << garbage;
  EXPECT_NE(garbage.find("not valid HTTP/1.1: expected a request line"), std::string::npos)
      << garbage;
  const auto broken =
      post("/v1/completions", std::string("{\"prompt\": \"hi\", \"max_tokens\": 1,}"));
  expect_error(broken, 400, "");
  EXPECT_NE(broken.second["error"]["message"].get<std::string>().find(
                "not valid JSON: parse error at line 1, column"),
            std::string::npos)
      << broken.second.dump();
}

// max_completion_tokens replaces max_tokens, unless it is null.
TEST_F(Serving, ANullMaxCompletionTokensLeavesMaxTokens) {
  start();
  const json messages = {{{"role", "user"}, {"content", "hi"}}};
  auto r = post("/v1/chat/completions", json{{"messages", messages},
                                             {"max_completion_tokens", nullptr},
                                             {"max_tokens", 2},
                                             {"temperature", 0}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_LE(r.second["usage"]["completion_tokens"].get<int>(), 2) << r.second.dump();
  expect_error(post("/v1/chat/completions", json{{"messages", messages},
                                                 {"max_completion_tokens", nullptr},
                                                 {"max_tokens", "junk"}}),
               400, "max_tokens");
}

// A request of more prompts than --max-batch-rows runs in turns of at most that many rows, so
// that one request cannot make the KV caches hold more; each prompt gets what generate() gives.
TEST_F(Serving, ARequestOfMorePromptsThanABatchRunsInTurns) {
  serve::ServerOptions o = options();
  o.max_batch_rows = 2;
  start(o);
  const std::vector<std::string> prompts = {"The cat", "Paris", "Water boils", "Bees", "Rome"};
  auto r = post("/v1/completions",
                json{{"prompt", prompts}, {"max_tokens", 6}, {"temperature", 0.8}, {"seed", 11}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  std::vector<std::vector<uint32_t>> ids;
  for (const auto& p : prompts) ids.push_back(prompt_ids(p));
  const auto g = model::generate(*model_, ids, sampling(6, 0.8, 11));
  ASSERT_EQ(r.second["choices"].size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(r.second["choices"][i]["text"], decode(g[i].tokens)) << i;
  EXPECT_EQ(server_->engine().most_rows(), 2);
}

// A chat without max_tokens may run to the end of the context (the default budget, --max-tokens,
// shrinks to what the context leaves), and a conversation over the prompt limit is refused
// naming 'messages', the field the client sent.
TEST_F(Serving, AChatBudgetEndsAtTheContextAndLongChatsNameMessages) {
  serve::ServerOptions o = options();
  o.model.context = 48;
  o.limits.max_prompt_tokens = 40;
  start(o);
  std::string words;
  for (int i = 0; i < 4; ++i) words += "The cat sat. ";
  const json messages = {{{"role", "user"}, {"content", words}}};
  const auto prompt = chat_prompt({{"user", words}});
  ASSERT_GT(prompt.size() + 32, 48u);  // the default budget would pass the context
  ASSERT_LE(prompt.size(), 40u);
  auto r = post("/v1/chat/completions", json{{"messages", messages}, {"temperature", 0}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_LE(r.second["usage"]["completion_tokens"].get<size_t>(), 48 - prompt.size());
  // With max_tokens given, it is kept and checked.
  expect_error(post("/v1/chat/completions", json{{"messages", messages}, {"max_tokens", 32}}), 400,
               "messages");
  std::string more;
  for (int i = 0; i < 12; ++i) more += "The cat sat. ";
  auto long_chat =
      post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", more}}}}});
  expect_error(long_chat, 400, "messages");
  EXPECT_EQ(long_chat.second["error"]["code"], "context_length_exceeded");
  // Over the context itself: OpenAI's wording, which clients look for.
  EXPECT_EQ(long_chat.second["error"]["message"].get<std::string>().rfind(
                "This model's maximum context length is 48 tokens. However, you requested ", 0),
            0u)
      << long_chat.second.dump();
  // A budget past --max-tokens (32) is capped, and the check takes the capped one: a short prompt
  // with a client's default of 4096 is answered, ending at the cap.
  auto short_prompt = post("/v1/completions",
                           json{{"prompt", "The cat"}, {"max_tokens", 4096}, {"temperature", 0}});
  ASSERT_EQ(short_prompt.first, 200) << short_prompt.second.dump();
  EXPECT_LE(short_prompt.second["usage"]["completion_tokens"].get<int64_t>(), 32);
  // Over the context even so: the budget is named as the client sent it.
  auto capped = post("/v1/completions", json{{"prompt", words}, {"max_tokens", 5000}});
  expect_error(capped, 400, "prompt");
  EXPECT_NE(capped.second["error"]["message"].get<std::string>().find(
                " in the prompt, 5000 in the completion)"),
            std::string::npos)
      << capped.second.dump();
  // The largest max_tokens: the sum in the message does not wrap round.
  const int64_t most = std::numeric_limits<int64_t>::max();
  capped = post("/v1/completions", json{{"prompt", words}, {"max_tokens", most}});
  expect_error(capped, 400, "prompt");
  const std::string said = capped.second["error"]["message"];
  const size_t at = said.find("you requested ");
  ASSERT_NE(at, std::string::npos) << said;
  EXPECT_GT(std::stoull(said.substr(at + 14)), static_cast<uint64_t>(most)) << said;
  // Over the server's prompt limit, within the context: the limit and its option are named.
  std::string mid = words;
  while (chat_prompt({{"user", mid}}).size() <= 40) mid += "cat ";
  ASSERT_LE(chat_prompt({{"user", mid}}).size(), 48u);
  auto limited =
      post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", mid}}}}});
  expect_error(limited, 400, "messages");
  EXPECT_EQ(limited.second["error"]["code"], "context_length_exceeded");
  EXPECT_NE(limited.second["error"]["message"].get<std::string>().find(
                "this server takes at most 40 (--max-prompt-tokens)"),
            std::string::npos)
      << limited.second.dump();
}

// A chat reply ends at the template's end of turn even where the tokenizer does not list it
// among its end tokens; a completion does not.
TEST_F(Serving, AChatReplyEndsAtTheEndOfTurnToken) {
  const json messages = {{{"role", "user"}, {"content", "What is two plus two?"}}};
  const auto prompt = chat_prompt({{"user", "What is two plus two?"}});
  const auto free = model::generate(*model_, {prompt}, sampling(8, 0, 0))[0];
  ASSERT_GE(free.tokens.size(), 3u);
  ASSERT_NE(free.tokens[2], free.tokens[0]);
  ASSERT_NE(free.tokens[2], free.tokens[1]);
  serve::ServerOptions o = options();
  o.model.end_of_turn = free.tokens[2];  // the third token it would write ends the turn
  start(o);
  auto r = post("/v1/chat/completions",
                json{{"messages", messages}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_EQ(r.second["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.second["choices"][0]["message"]["content"],
            decode({free.tokens.begin(), free.tokens.begin() + 2}));
  // /tokenizer_info names the configured EOS when there is one, else the first end token.
  httplib::Client c("127.0.0.1", server_->port());
  auto info = c.Get("/tokenizer_info");
  ASSERT_TRUE(info);
  EXPECT_EQ(json::parse(info->body)["eos_token"], tok_->decode(std::vector<uint32_t>{eot()}));
  server_.reset();
  o.model.eos = free.tokens[0];
  start(o);
  httplib::Client c2("127.0.0.1", server_->port());
  info = c2.Get("/tokenizer_info");
  ASSERT_TRUE(info);
  EXPECT_EQ(json::parse(info->body)["eos_token"],
            tok_->decode(std::vector<uint32_t>{free.tokens[0]}));
}

// A model whose vocabulary is padded beyond its tokenizer's: the echoed prompt's alternatives
// are ids the tokenizer can name (the padding rows, untrained, often rank among the top).
TEST_F(Serving, EchoedAlternativesOfAPaddedVocabularyAreTokens) {
  const model::Llama padded = testing::tiny_model(tok_->vocab_size() + 200, 3);
  server_ = std::make_unique<serve::Server>(padded, *tok_, options());
  server_->start();
  auto r = post("/v1/completions", json{{"prompt", "Paris is the capital of France."},
                                        {"max_tokens", 0},
                                        {"echo", true},
                                        {"logprobs", 20}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  for (const json& top : r.second["choices"][0]["logprobs"]["top_logprobs"])  // by text: ids
    if (!top.is_null()) EXPECT_TRUE(!top.empty() && top.size() <= 21u);  // and the token itself
  // A generated token's log-probability is normalised over the whole vocabulary, as an echoed
  // one is (and pollen score's): the same token in the same context, the same number.
  const auto ids = prompt_ids("Paris is the capital of");
  auto gen = post("/v1/completions",
                  json{{"prompt", ids}, {"max_tokens", 1}, {"temperature", 0}, {"logprobs", 1}});
  ASSERT_EQ(gen.first, 200) << gen.second.dump();
  const json& glp = gen.second["choices"][0]["logprobs"];
  std::vector<uint32_t> with = ids;
  with.push_back(tok_->encode(glp["tokens"][0].get<std::string>()).at(0));
  auto echo = post("/v1/completions",
                   json{{"prompt", with}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}});
  ASSERT_EQ(echo.first, 200) << echo.second.dump();
  EXPECT_NEAR(glp["token_logprobs"][0].get<double>(),
              echo.second["choices"][0]["logprobs"]["token_logprobs"].back().get<double>(), 1e-5);
  // A tokenizer with more ids than the model has rows is refused when the server starts.
  const model::Llama small = testing::tiny_model(tok_->vocab_size() - 1, 3);
  try {
    serve::Server refused(small, *tok_, options());
    ADD_FAILURE() << "a tokenizer larger than the model was served";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than the model's vocab_size"), std::string::npos)
        << e.what();
  }
}

TEST_F(Serving, ApiKeyIsCheckedAsBearerToken) {
  serve::ServerOptions o = options();
  o.host = "0.0.0.0";
  EXPECT_THROW(serve::Server s(*model_, *tok_, o), Error);  // another address needs a key
  o.api_key = "sekret";
  start(o);
  const json body = {{"prompt", "hi"}, {"max_tokens", 1}};
  auto r = post("/v1/completions", body);
  expect_error(r, 401, "");
  EXPECT_EQ(r.second["error"]["code"], "invalid_api_key");
  expect_error(post("/v1/completions", body, {{"Authorization", "Bearer wrong"}}), 401, "");
  expect_error(post("/v1/completions", body, {{"Authorization", "sekret"}}), 401, "");
  EXPECT_EQ(post("/v1/completions", body, {{"Authorization", "Bearer sekret"}}).first, 200);
  // The scheme is case-insensitive (RFC 9110); the key is not.
  EXPECT_EQ(post("/v1/completions", body, {{"Authorization", "bearer sekret"}}).first, 200);
  expect_error(post("/v1/completions", body, {{"Authorization", "bearer SEKRET"}}), 401, "");
  httplib::Client c("127.0.0.1", server_->port());
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 401);
}

// Fields that clients and frameworks send at values asking for nothing the server lacks are
// accepted (LangChain and agent SDKs send response_format, tools, store, metadata); other values
// are refused as unsupported, not as unknown. Longer stop lists (evaluation harnesses), top_p 0
// (greedy) and GET /v1/models/{id} work as OpenAI's.
// CORS: without allowed origins no answer carries its headers. With them, an allowed origin's
// preflight is answered 204 without the key (browsers send none with it), allowing the headers
// it asks for, and every answer to that origin, errors too, names it; another origin's get
// nothing, and "*" allows any.
TEST_F(Serving, OnlyAllowedOriginsGetCorsHeaders) {
  const json body = {{"prompt", "hi"}, {"max_tokens", 1}};
  const httplib::Headers preflight = {
      {"Origin", "https://ui.example"},
      {"Access-Control-Request-Method", "POST"},
      {"Access-Control-Request-Headers", "authorization, content-type, x-stainless-os"}};
  const auto call = [&](const httplib::Headers& headers) {
    httplib::Client c("127.0.0.1", server_->port());
    auto r = c.Post("/v1/completions", headers, body.dump(), "application/json");
    EXPECT_TRUE(r);
    return r;
  };
  const auto options_call = [&](const httplib::Headers& headers) {
    httplib::Client c("127.0.0.1", server_->port());
    auto r = c.Options("/v1/completions", headers);
    EXPECT_TRUE(r);
    return r;
  };
  start();
  EXPECT_FALSE(options_call(preflight)->has_header("Access-Control-Allow-Origin"));
  EXPECT_FALSE(call({{"Origin", "https://ui.example"}})->has_header("Access-Control-Allow-Origin"));

  serve::ServerOptions o = options();
  o.api_key = "sekret";
  o.allowed_origins = {"https://ui.example", "http://localhost:3000"};
  start(o);
  const auto pre = options_call(preflight);
  EXPECT_EQ(pre->status, 204);
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Origin"), "https://ui.example");
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Headers"),
            "authorization, content-type, x-stainless-os");
  EXPECT_NE(pre->get_header_value("Access-Control-Allow-Methods").find("POST"), std::string::npos);
  EXPECT_EQ(pre->get_header_value("Vary"), "Origin");
  const auto served =
      call({{"Origin", "http://localhost:3000"}, {"Authorization", "Bearer sekret"}});
  EXPECT_EQ(served->status, 200) << served->body;
  EXPECT_EQ(served->get_header_value("Access-Control-Allow-Origin"), "http://localhost:3000");
  const auto unkeyed = call({{"Origin", "https://ui.example"}});
  EXPECT_EQ(unkeyed->status, 401);
  EXPECT_EQ(unkeyed->get_header_value("Access-Control-Allow-Origin"), "https://ui.example");
  httplib::Headers other = preflight;
  other.erase("Origin");
  other.emplace("Origin", "https://elsewhere.example");
  const auto refused = options_call(other);
  EXPECT_NE(refused->status, 204);
  EXPECT_FALSE(refused->has_header("Access-Control-Allow-Origin"));
  const auto theirs =
      call({{"Origin", "https://elsewhere.example"}, {"Authorization", "Bearer sekret"}});
  EXPECT_EQ(theirs->status, 200);
  EXPECT_FALSE(theirs->has_header("Access-Control-Allow-Origin"));

  o.allowed_origins = {"*"};
  start(o);
  EXPECT_EQ(options_call(other)->get_header_value("Access-Control-Allow-Origin"), "*");
  EXPECT_FALSE(options_call(other)->has_header("Vary"));

  for (const std::string bad : {"ui.example", "https://", "https://ui.example/", "ftp://x"}) {
    try {
      serve::check_allowed_origins({"https://ok.example", bad});
      ADD_FAILURE() << "'" << bad << "' was taken as an origin";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + bad + "' is not an origin"), std::string::npos)
          << e.what();
    }
  }
}

TEST_F(Serving, FieldsClientsSendAtNeutralValuesAreAccepted) {
  start();
  const json messages = {{{"role", "user"}, {"content", "hi"}}};
  const json neutral = {{"messages", messages},
                        {"max_tokens", 2},
                        {"response_format", {{"type", "text"}}},
                        {"tools", json::array()},
                        {"tool_choice", "none"},
                        {"parallel_tool_calls", true},
                        {"store", false},
                        {"metadata", {{"team", "a"}}},
                        {"service_tier", "auto"}};
  auto r = post("/v1/chat/completions", neutral);
  EXPECT_EQ(r.first, 200) << r.second.dump();
  // The completions endpoint ignores the same (docs/serving.md).
  const auto completion = post("/v1/completions", json{{"prompt", "hi"},
                                                       {"max_tokens", 2},
                                                       {"store", false},
                                                       {"metadata", {{"team", "a"}}},
                                                       {"service_tier", "auto"}});
  EXPECT_EQ(completion.first, 200) << completion.second.dump();
  expect_error(post("/v1/completions", json{{"prompt", "hi"}, {"store", "no"}}), 400, "store");
  const auto refused = [&](const std::string& key, const json& value) {
    json body = neutral;
    body[key] = value;
    const auto got = post("/v1/chat/completions", body);
    expect_error(got, 400, key);
    EXPECT_EQ(got.second["error"]["code"], "unsupported_value") << got.second.dump();
  };
  refused("response_format", {{"type", "json_object"}});
  refused("response_format", {{"type", 5}});  // not a string: a 400, never a 500
  refused("tools", json::array({{{"type", "function"}, {"function", {{"name", "f"}}}}}));
  refused("tool_choice", "required");
  // Stop lists past OpenAI's 4 (lm-evaluation-harness sends a task's stops and the EOS).
  r = post("/v1/completions",
           json{{"prompt", "hi"}, {"max_tokens", 2}, {"stop", {"a\n", "b", "c", "d", "e", "f"}}});
  EXPECT_EQ(r.first, 200) << r.second.dump();
  // top_p 0: the most likely token alone, as temperature 0.
  const auto greedy =
      post("/v1/completions", json{{"prompt", "The cat"}, {"max_tokens", 4}, {"temperature", 0}});
  r = post("/v1/completions", json{{"prompt", "The cat"}, {"max_tokens", 4}, {"top_p", 0}});
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_EQ(r.second["choices"][0]["text"], greedy.second["choices"][0]["text"]);
  // A chat reply needs one token: max_tokens 0 is refused.
  expect_error(post("/v1/chat/completions", json{{"messages", messages}, {"max_tokens", 0}}), 400,
               "max_tokens");
  httplib::Client c("127.0.0.1", server_->port());
  auto one = c.Get("/v1/models/tiny");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 200) << one->body;
  EXPECT_EQ(json::parse(one->body)["id"], "tiny");
  auto other = c.Get("/v1/models/gpt-9");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);
  EXPECT_EQ(json::parse(other->body)["error"]["code"], "model_not_found");
}

// /metrics for Prometheus: requests by path and status, in flight, waiting, tokens generated;
// behind the API key, and a scrape is no request slot.
TEST_F(Serving, MetricsCountRequestsAndTokensForPrometheus) {
  serve::ServerOptions o = options();
  o.api_key = "sekret";
  start(o);
  const httplib::Headers key = {{"Authorization", "Bearer sekret"}};
  ASSERT_EQ(
      post("/v1/completions", json{{"prompt", "The dog"}, {"max_tokens", 5}}.dump(), key).first,
      200);
  ASSERT_EQ(post("/v1/completions", json{{"prompt", "hi"}, {"temperature", 5}}.dump(), key).first,
            400);
  ASSERT_EQ(post("/v1/completions", json{{"prompt", "hi"}}.dump()).first, 401);
  httplib::Client c("127.0.0.1", server_->port());
  c.Get("/no/such/path", key);
  auto refused = c.Get("/metrics");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);
  const std::vector<std::string> expected = {
      "pollen_serve_requests_total{path=\"/v1/completions\",code=\"200\"} 1",
      "pollen_serve_requests_total{path=\"/v1/completions\",code=\"400\"} 1",
      "pollen_serve_requests_total{path=\"/v1/completions\",code=\"401\"} 1",
      "pollen_serve_requests_total{path=\"/metrics\",code=\"401\"} 1",
      "pollen_serve_requests_total{path=\"other\",code=\"404\"} 1",
      "pollen_serve_requests_in_flight 0",
      "pollen_serve_requests_waiting 0",
      "# TYPE pollen_serve_generated_tokens_total counter",
      cat("pollen_serve_generated_tokens_total ", server_->engine().tokens_generated()),
      "pollen_serve_largest_batch 1",
      "# TYPE pollen_serve_request_seconds histogram",
      "pollen_serve_request_seconds_bucket{path=\"/v1/completions\",le=\"+Inf\"} 3",
      "pollen_serve_request_seconds_count{path=\"/v1/completions\"} 3",
      "# TYPE pollen_serve_time_to_first_token_seconds histogram",
      "pollen_serve_time_to_first_token_seconds_count 1"};  // the request that generated
  // A request is counted once its answer is written, which its client may see first, and the
  // server's threads may count them in any order: scrape until every one is in.
  std::string text;
  const auto all_in = [&] {
    for (const std::string& line : expected)
      if (text.find(line + "\n") == std::string::npos) return false;
    return true;
  };
  for (int w = 0; w < 100; ++w) {
    auto m = c.Get("/metrics", key);
    ASSERT_TRUE(m);
    ASSERT_EQ(m->status, 200);
    EXPECT_EQ(m->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
    text = m->body;
    if (all_in()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (const std::string& line : expected)
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << line << " in:\n" << text;
  EXPECT_GT(server_->engine().tokens_generated(), 0);
  // The Prometheus project's own parser reads the scrape, the histogram's series included.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / cat("pollen_serve_metrics_", getpid());
  std::filesystem::create_directories(dir);
  write_file_atomic(dir / "scrape.txt", text);
  int status = 0;
  const std::string parsed = testing::run_capture(
      cat(POLLEN_PEERS_PYTHON, " -c \"import sys\nfrom prometheus_client.parser import ",
          "text_string_to_metric_families as f\nfor m in f(open(sys.argv[1]).read()):\n",
          " print(m.name, m.type, sum(1 for s in m.samples))\" ", (dir / "scrape.txt").string()),
      &status);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(status, 0) << parsed;
  // 15 buckets, a sum and a count for each timed path.
  size_t timed_paths = 1;  // and the time to first token
  for (size_t at = 0;
       (at = text.find("pollen_serve_request_seconds_count{", at)) != std::string::npos; ++at)
    ++timed_paths;
  EXPECT_GE(timed_paths, 3u);
  EXPECT_NE(
      parsed.find(cat("pollen_serve_request_seconds histogram ", 17 * (timed_paths - 1), "\n")),
      std::string::npos)
      << parsed;
  EXPECT_NE(parsed.find("pollen_serve_time_to_first_token_seconds histogram 17\n"),
            std::string::npos)
      << parsed;
  EXPECT_NE(parsed.find("pollen_serve_requests counter"), std::string::npos) << parsed;
}

// A server that answers before reading the body closes its socket on unread bytes, which resets
// the connection: a client still sending, or not yet reading, loses the answer. So a request
// with a wrong key is answered only once its whole body has arrived.
TEST_F(Serving, ARefusedKeyIsAnsweredAfterTheBody) {
  serve::ServerOptions o = options();
  o.api_key = "sekret";
  start(o);
  const int fd = connect_loopback(server_->port());
  ASSERT_GE(fd, 0);
  const std::string body = json{{"prompt", "hi"}, {"max_tokens", 1}}.dump();
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Authorization: Bearer wrong\r\nContent-Type: application/json\r\n"
      "Connection: close\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n";
  ASSERT_EQ(send(fd, head.data(), head.size(), 0), static_cast<ssize_t>(head.size()));
  pollfd readable{fd, POLLIN, 0};
  EXPECT_EQ(poll(&readable, 1, 300), 0) << "answered before the body was sent";
  ASSERT_EQ(send(fd, body.data(), body.size(), 0), static_cast<ssize_t>(body.size()));
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) response.append(buffer, n);
  close(fd);
  EXPECT_TRUE(response.starts_with("HTTP/1.1 401")) << response;
  EXPECT_NE(response.find("invalid_api_key"), std::string::npos) << response;
}

TEST_F(Serving, WaitingRequestsShareABatchAndExtraOnesGet429) {
  serve::ServerOptions o = options();
  o.limits.max_concurrent = 2;
  start(o);
  const std::vector<std::string> prompts = {"The dog", "Ice melts"};
  std::vector<std::pair<int, json>> got(2);
  {
    std::optional<serve::Engine::Hold> hold;
    hold.emplace(server_->engine());
    std::vector<std::thread> clients;
    for (size_t i = 0; i < 2; ++i)
      clients.emplace_back([&, i] {
        got[i] = post(
            "/v1/completions",
            json{
                {"prompt", prompts[i]}, {"max_tokens", 10}, {"temperature", 0.7}, {"seed", 5 + i}});
      });
    for (int w = 0; w < 1000 && server_->engine().pending() < 2; ++w)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(server_->engine().pending(), 2);
    ASSERT_EQ(server_->in_flight(), 2);
    auto r = post("/v1/completions", json{{"prompt", "hi"}});
    expect_error(r, 429, "");
    EXPECT_EQ(r.second["error"]["type"], "rate_limit_error");
    hold.reset();
    for (auto& t : clients) t.join();
  }
  EXPECT_EQ(server_->engine().largest_batch(), 2);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_EQ(got[i].first, 200) << got[i].second.dump();
    const auto g = model::generate(*model_, {prompt_ids(prompts[i])}, sampling(10, 0.7, 5 + i));
    EXPECT_EQ(got[i].second["choices"][0]["text"], decode(g[0].tokens)) << i;
  }
}

// A client that leaves before its answer ends its generation, whole or streamed: the server sees
// the connection closed while the request waits, before any token is due (a whole answer through
// serve/connection.h, a stream through cpp-httplib's is_writable()).
TEST_F(Serving, AClientThatLeavesEndsItsGenerationStreamedOrNot) {
  start();
  serve::Engine& engine = server_->engine();
  const json body = {{"prompt", "The dog"}, {"max_tokens", 32}, {"temperature", 0.7}, {"seed", 3}};
  ASSERT_EQ(post("/v1/completions", body.dump()).first, 200);
  const int64_t whole = engine.tokens_generated();  // what the request takes when its client stays
  ASSERT_GT(whole, 2);
  for (const bool stream : {false, true}) {
    json b = body;
    if (stream) b["stream"] = true;
    const std::string text = b.dump();
    const int64_t before = engine.tokens_generated();
    {
      serve::Engine::Hold hold(engine);  // the request waits in the queue
      const int fd = connect_loopback(server_->port());
      ASSERT_GE(fd, 0);
      const std::string request =
          "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
          "Content-Length: " +
          std::to_string(text.size()) + "\r\n\r\n" + text;
      ASSERT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
      for (int w = 0; w < 1000 && engine.pending() < 1; ++w)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      ASSERT_EQ(engine.pending(), 1);
      if (stream) {
        // A streamed answer's head comes at once; read, so that closing sends no reset (which
        // the next write would notice) but the orderly end of a client that left.
        std::string head;
        char c;
        while (!head.ends_with("\r\n\r\n") && recv(fd, &c, 1, 0) == 1) head += c;
        ASSERT_TRUE(head.starts_with("HTTP/1.1 200")) << head;
      }
      close(fd);
      // The server looks every 50 ms (whole) or 20 ms (streamed) while the request waits.
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
    }
    for (int w = 0; w < 1000 && server_->in_flight() > 0; ++w)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(server_->in_flight(), 0);
    EXPECT_EQ(engine.tokens_generated() - before, 0)
        << (stream ? "streamed" : "whole") << ": generated for a client that left (" << whole
        << " tokens when it stays)";
  }
  // And a client that stays gets its whole answer.
  const int64_t before = engine.tokens_generated();
  EXPECT_EQ(post("/v1/completions", body.dump()).first, 200);
  EXPECT_EQ(engine.tokens_generated() - before, whole);
  // The whole answer that went nowhere is counted as such (499, nginx's "client closed
  // request"), not as one answered.
  httplib::Client c("127.0.0.1", server_->port());
  const auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(
      metrics->body.find("pollen_serve_requests_total{path=\"/v1/completions\",code=\"499\"} 1"),
      std::string::npos)
      << metrics->body;
}

// A request whose client went away (its cancelled flag set) ends before its next step; the
// requests batched with it go on as if alone.
TEST_F(Serving, ACancelledRequestEndsAtTheNextStepAndItsBatchGoesOn) {
  start();
  serve::Engine& engine = server_->engine();
  const auto ids = prompt_ids("The dog");
  const auto seq = [&](uint64_t seed) {
    return serve::Sequence{ids, sampling(12, 0.7, seed), Rng(seed).fork(0), false, 0};
  };
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  std::future<std::vector<serve::SequenceResult>> gone, kept;
  {
    serve::Engine::Hold hold(engine);  // both requests in one batch
    int seen = 0;
    gone = engine.submit(
        {seq(3)}, [&](size_t, uint32_t) { cancelled->store(++seen == 2); }, cancelled);
    kept = engine.submit({seq(4)});
  }
  const auto g = gone.get(), k = kept.get();
  EXPECT_EQ(g[0].generation.finish_reason, "cancelled");
  EXPECT_EQ(g[0].generation.tokens.size(), 2u);
  EXPECT_EQ(engine.largest_batch(), 2);
  const auto alone = model::generate(*model_, {ids}, sampling(12, 0.7, 4));
  EXPECT_EQ(k[0].generation.tokens, alone[0].tokens);
  ASSERT_GT(alone[0].tokens.size(), 2u) << "the kept request should outlive the cancelled one";
}

// Continuous batching: a request that arrives while another generates joins the running batch
// at the next step and finishes long before it, instead of waiting for it; both get what they
// get alone.
TEST_F(Serving, ARequestJoinsTheRunningBatchAndFinishesFirst) {
  start();
  serve::Engine& engine = server_->engine();
  const auto seq = [&](const std::string& prompt, int64_t budget, uint64_t seed) {
    return serve::Sequence{prompt_ids(prompt), sampling(budget, 0.7, seed), Rng(seed).fork(0),
                           false, 0};
  };
  std::future<std::vector<serve::SequenceResult>> late;
  size_t long_tokens = 0, when_late_done = 0;
  auto first = engine.submit({seq("The dog", 48, 8)}, [&](size_t, uint32_t) {
    ++long_tokens;
    if (long_tokens == 3) late = engine.submit({seq("Ice melts", 4, 9)});
    if (long_tokens > 3 && when_late_done == 0 &&
        late.wait_for(std::chrono::seconds(0)) == std::future_status::ready)
      when_late_done = long_tokens;
  });
  const auto a = first.get();
  ASSERT_TRUE(late.valid());
  const auto b = late.get();
  const auto alone_a = model::generate(*model_, {prompt_ids("The dog")}, sampling(48, 0.7, 8));
  const auto alone_b = model::generate(*model_, {prompt_ids("Ice melts")}, sampling(4, 0.7, 9));
  ASSERT_GT(alone_a[0].tokens.size(), 12u) << "the first request should outlive the second";
  EXPECT_EQ(a[0].generation.tokens, alone_a[0].tokens);
  EXPECT_EQ(b[0].generation.tokens, alone_b[0].tokens);
  // Joined at the first request's 4th step, 4 tokens: done by its 8th token, long before its end.
  EXPECT_GT(when_late_done, 0u) << "the second request waited for the first to finish";
  EXPECT_LE(when_late_done, 9u);
  EXPECT_EQ(engine.largest_batch(), 2);
}

// A request that fails to enter the batch (here: an empty prompt, which the routes refuse before
// the engine) fails alone; the request running beside it goes on as if alone.
TEST_F(Serving, ARequestThatFailsFailsAlone) {
  start();
  serve::Engine& engine = server_->engine();
  const auto ids = prompt_ids("The dog");
  std::future<std::vector<serve::SequenceResult>> bad, good;
  {
    serve::Engine::Hold hold(engine);
    good = engine.submit({{ids, sampling(12, 0.7, 4), Rng(4).fork(0), false, 0}});
    bad = engine.submit({{{}, sampling(12, 0.7, 5), Rng(5).fork(0), false, 0}});
  }
  const std::string e = pollen::testing::error_of([&] { bad.get(); });
  EXPECT_NE(e.find("every prompt needs at least one token"), std::string::npos) << e;
  const auto kept = good.get();
  const auto alone = model::generate(*model_, {ids}, sampling(12, 0.7, 4));
  EXPECT_EQ(kept[0].generation.tokens, alone[0].tokens);
}

// A client that leaves a request whose prompts enter in turns (more than --max-batch-rows) ends
// the prompts running and never starts the rest: not even their scoring (echo with logprobs).
TEST_F(Serving, ALeftRequestStartsNoneOfItsWaitingPrompts) {
  serve::ServerOptions o = options();
  o.max_batch_rows = 1;
  start(o);
  serve::Engine& engine = server_->engine();
  const auto ids = prompt_ids("The dog");
  std::vector<serve::Sequence> four;
  for (uint64_t s = 0; s < 4; ++s) four.push_back({ids, sampling(12, 0.7, s), Rng(s), true, 0});
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  const int64_t before = engine.tokens_generated();
  auto left = engine.submit(
      std::move(four), [&](size_t, uint32_t) { cancelled->store(true); }, cancelled);
  const auto r = left.get();
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(engine.tokens_generated() - before, 1);
  EXPECT_EQ(r[0].generation.tokens.size(), 1u);
  EXPECT_EQ(r[0].prompt_scores.size(), ids.size());
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(r[i].generation.finish_reason, "cancelled") << i;
    if (i > 0) EXPECT_TRUE(r[i].prompt_scores.empty()) << i;
  }
}

TEST_F(Serving, ConcurrentRequestsAreServedCorrectly) {
  serve::ServerOptions o = options();
  o.limits.max_concurrent = 8;
  start(o);
  const std::vector<std::string> prompts = {"The cat", "Paris",     "Water boils",
                                            "Bees",    "Question:", "Rome is the"};
  std::vector<std::pair<int, json>> got(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i)
    clients.emplace_back([&, i] {
      got[i] = post("/v1/completions", json{{"prompt", prompts[i]},
                                            {"max_tokens", 6 + i},
                                            {"temperature", 0.8},
                                            {"seed", 100 + i}});
    });
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i].first, 200) << got[i].second.dump();
    const auto g =
        model::generate(*model_, {prompt_ids(prompts[i])}, sampling(6 + i, 0.8, 100 + i));
    EXPECT_EQ(got[i].second["choices"][0]["text"], decode(g[0].tokens)) << i;
  }
}

TEST(ServeCli, AnotherAddressWithoutAKeyIsRefusedBeforeLoading) {
  // What `pollen serve ARGS` printed, having failed to start (a server that started would run
  // until stopped: the test then fails on its time limit).
  const auto refused = [](const std::string& args) {
    FILE* p =
        popen((std::string(POLLEN_BINARY) + " serve --model llama-tiny --port 0 " + args + " 2>&1")
                  .c_str(),
              "r");
    std::string out;
    char buf[512];
    while (p && fgets(buf, sizeof buf, p)) out += buf;
    EXPECT_NE(p ? pclose(p) : 0, 0) << args;
    return out;
  };
  const std::string open = refused("--host 0.0.0.0");
  EXPECT_NE(open.find("needs an API key"), std::string::npos) << open;
  // An empty key (an unset variable in --api-key "$KEY") would serve without one.
  const std::string empty = refused("--host 127.0.0.1 --api-key '  '");
  EXPECT_NE(empty.find("--api-key is empty"), std::string::npos) << empty;
  // A key file with a second line would make a key no request can send (HTTP trims a header's
  // value, and a line break ends it): refused, naming the file.
  const std::string key_file = ::testing::TempDir() + "pollen_two_line_key";
  write_file_atomic(key_file, "\n sekret\n# rotated in December\n");
  const std::string two_lines = refused("--host 127.0.0.1 --api-key-file " + key_file);
  EXPECT_NE(two_lines.find("API key file '" + key_file + "' holds whitespace inside the key"),
            std::string::npos)
      << two_lines;
  std::filesystem::remove(key_file);
}

// A chat template whose end-of-turn token the tokenizer lacks would encode its markers as plain
// bytes, and no reply could end: refused at start, as pollen chat refuses it.
TEST(ServeCli, AChatTemplateTheTokenizerCannotEndIsRefused) {
  namespace fs = std::filesystem;
  const fs::path dir = test_support::post_temp_dir("serve_no_im_end");
  const std::string pattern = tokenizer::pattern_regex("gpt2");
  tokenizer::PieceCounts counts(pattern);
  const std::vector<std::string_view> docs = {"hello there", "general kenobi"};
  counts.add_documents(docs);
  tokenizer::save_tokenizer(tokenizer::train_bpe(counts, {270, {}, pattern}),
                            dir / "tokenizer.json");
  // (under a time limit: a server that started would run until stopped)
  const std::string cmd =
      "timeout 60 " + std::string(POLLEN_BINARY) + " serve --model llama-tiny --tokenizer " +
      (dir / "tokenizer.json").string() + " --chat-template chatml --port 0 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  EXPECT_NE(pclose(p), 0) << out;
  EXPECT_NE(out.find("writes <|im_start|>, <|im_end|>, which the tokenizer does not have"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("no reply could end without <|im_end|>"), std::string::npos) << out;
  std::filesystem::remove_all(dir);
}

// `pollen serve` running in the background: its process, output and the port it printed.
class ServeProcess {
 public:
  // `at`: what the start line prints before the port.
  explicit ServeProcess(const std::string& args, const char* at = "on http://127.0.0.1:") {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    const std::string cmd = "exec " + std::string(POLLEN_BINARY) + " serve " + args + " 2>&1";
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[1024];
    while (port_ == 0 && fgets(line, sizeof line, out_)) {
      output_ += line;
      if (const char* p = std::strstr(line, at)) port_ = std::atoi(p + std::strlen(at));
    }
  }
  ~ServeProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    fclose(out_);
  }
  int port() const { return port_; }
  void signal(int sig) const { kill(pid_, sig); }
  // The wait status once the process ended.
  int wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  const std::string& output() const { return output_; }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
  std::string output_;
};

// An IPv6 host is printed in brackets, as a URL needs it.
TEST(ServeCli, TheStartLineNamesAnIpv6HostAsAUrl) {
  {
    const int probe = socket(AF_INET6, SOCK_STREAM, 0);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
    const bool bound =
        probe >= 0 && bind(probe, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
    if (probe >= 0) close(probe);
    if (!bound) GTEST_SKIP() << "this machine has no IPv6 loopback";
  }
  const std::filesystem::path dir = test_support::post_temp_dir("serve_ipv6");
  const std::string tok = test_support::make_chat_tokenizer(dir).string();
  ServeProcess server("--model llama-tiny --tokenizer " + tok + " --host ::1 --port 0 --threads 1",
                      "on http://[::1]:");
  ASSERT_GT(server.port(), 0) << server.output();
  httplib::Client c("::1", server.port());
  const auto health = c.Get("/health");
  ASSERT_TRUE(health) << server.output();
  EXPECT_EQ(health->status, 200);
  std::filesystem::remove_all(dir);
}

// SIGINT stops the server gracefully: a stream already running ends whole, with [DONE], /health
// answers 503, and the process exits 0; a second signal ends it at once, exit code 128 + SIGINT.
TEST(ServeCli, ASignalLetsRunningStreamsFinishAndASecondEndsAtOnce) {
  const std::filesystem::path dir = test_support::post_temp_dir("serve_signals");
  const std::string tok = test_support::make_chat_tokenizer(dir).string();
  for (const bool twice : {false, true}) {
    ServeProcess server("--model llama-tiny --tokenizer " + tok + " --port 0 --threads 1 " +
                        "--max-tokens 2000");
    ASSERT_GT(server.port(), 0) << server.output();
    std::atomic<bool> streaming = false;
    std::string body;
    std::thread client([&] {
      httplib::Client c("127.0.0.1", server.port());
      c.set_read_timeout(120);
      httplib::Request req;
      req.method = "POST";
      req.path = "/v1/completions";
      req.set_header("Content-Type", "application/json");
      req.body = json{
          {"prompt", "What is"},
          {"max_tokens", twice ? 2000 : 40},
          {"temperature", 0},
          {"stream",
           true}}.dump();
      req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
        body.append(data, n);
        streaming = true;
        return true;
      };
      c.send(req);
    });
    while (!streaming) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    server.signal(SIGINT);
    if (twice) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      // While draining, /health tells load balancers to send no more.
      httplib::Client probe("127.0.0.1", server.port());
      const auto health = probe.Get("/health");
      EXPECT_TRUE(health && health->status == 503) << (health ? health->body : "no answer");
      server.signal(SIGINT);
    }
    const int status = server.wait();
    client.join();
    ASSERT_TRUE(WIFEXITED(status)) << status;
    EXPECT_EQ(WEXITSTATUS(status), twice ? 128 + SIGINT : 0)
        << body.substr(body.size() > 600 ? body.size() - 600 : 0);
    EXPECT_EQ(body.find("data: [DONE]") != std::string::npos, !twice) << body;
  }
  std::filesystem::remove_all(dir);
}

// A client still sending its request's body (a byte now and then) when the signal comes was
// taken by nobody: it does not hold the stop for as long as it keeps sending (the stop gives the
// answers being written 5 s, then shuts the connections left down).
TEST(ServeCli, ASignalDoesNotWaitForAClientStillSendingItsRequest) {
  const std::filesystem::path dir = test_support::post_temp_dir("serve_trickle");
  const std::string tok = test_support::make_chat_tokenizer(dir).string();
  ServeProcess server("--model llama-tiny --tokenizer " + tok + " --port 0 --threads 1");
  ASSERT_GT(server.port(), 0) << server.output();
  const int fd = connect_loopback(server.port());
  ASSERT_GE(fd, 0);
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: 100000\r\n\r\n{";
  ASSERT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  std::atomic<bool> ended = false;
  std::thread trickle([&] {  // a byte every 100 ms for up to 30 s, while the server reads
    for (int i = 0; i < 300 && !ended; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (send(fd, " ", 1, MSG_NOSIGNAL) != 1) break;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto signalled = std::chrono::steady_clock::now();
  server.signal(SIGTERM);
  const int status = server.wait();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
  ended = true;
  trickle.join();
  close(fd);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_LT(waited, 15.0) << "the stop waited for the trickling client";  // its grace is 5 s
  std::filesystem::remove_all(dir);
}

// A post-training checkpoint names its chat template (config.toml's model.chat_template) and has
// no tokenizer_config.json: `pollen serve` takes the template from it, as `pollen chat` does, and
// samples only ids its tokenizer knows although its model has 80 more logits.
TEST(ServeCli, ServesAPostTrainingCheckpointWithItsChatTemplate) {
  namespace fs = std::filesystem;
  const fs::path dir = test_support::post_temp_dir("serve_checkpoint");
  const fs::path tokenizer_path = test_support::make_chat_tokenizer(dir);
  const fs::path model_file = dir / "padded-model.toml";
  std::ofstream(model_file)
      << "[model]\nname = \"tiny-padded\"\nvocab_size = 400\nhidden_size = 32\n"
         "intermediate_size = 64\nnum_hidden_layers = 2\n"
         "num_attention_heads = 2\nnum_key_value_heads = 1\n"
         "max_position_embeddings = 128\n";
  const fs::path data = test_support::write_sft_data(dir / "sft.jsonl", "arithmetic", 8, 1);
  train::PostOptions quiet;
  quiet.quiet = true;
  quiet.handle_signals = false;
  const train::PostResult sft = train::run_post_training(
      train::parse_post_config(
          test_support::tiny_post_toml(
              dir / "run", model_file, tokenizer_path, 1,
              "[sft]\ndata = \"" + data.string() + "\"\nvalidation_fraction = 0.0\nseq = 64\n"),
          "sft.toml", "sft"),
      quiet, train::make_sft_objective);
  ASSERT_EQ(sft.status, train::RunStatus::finished) << sft.message;

  const ServeProcess server("--model " + (dir / "run").string() + " --port 0 --threads 1");
  ASSERT_NE(server.port(), 0) << server.output();
  httplib::Client c("127.0.0.1", server.port());
  c.set_read_timeout(60);
  const json messages = {{{"role", "user"}, {"content", "What is 2 + 3?"}}};
  auto reply = c.Post("/v1/chat/completions",
                      json{{"messages", messages}, {"max_tokens", 8}, {"temperature", 0}}.dump(),
                      "application/json");
  ASSERT_TRUE(reply);
  ASSERT_EQ(reply->status, 200) << reply->body;

  // The checkpoint's model, greedy on the conversation rendered with ChatML.
  const io::ModelSource src = io::resolve_model((dir / "run").string());
  const model::Llama m = io::load_model(src);
  const tokenizer::Tokenizer tok = tokenizer::open_tokenizer(*src.tokenizer, "");
  tokenizer::EncodeOptions eo;
  eo.special = tokenizer::SpecialPolicy::allow_all();
  const std::vector<uint32_t> prompt =
      tok.encode(tokenizer::render_chat(tokenizer::ChatFormat{tokenizer::ChatTemplate::chatml, {}},
                                        {{"user", "What is 2 + 3?"}}, true),
                 eo);
  model::SamplingOptions greedy;
  greedy.temperature = 0;
  greedy.max_tokens = 8;
  greedy.vocab_size = tok.vocab_size();
  for (const char* end : {"<|endoftext|>", "<|im_end|>", "<|eot_id|>"})
    greedy.stop_tokens.push_back(tok.encode(end, eo)[0]);
  const model::Generation expected = model::generate(
      m, {prompt}, greedy, [&](std::span<const uint32_t> ids) { return tok.decode(ids); })[0];
  const json got = json::parse(reply->body);
  EXPECT_EQ(got["choices"][0]["message"]["content"],
            json::parse(json(expected.text).dump(-1, ' ', false, json::error_handler_t::replace)))
      << reply->body;

  // Sampled completions keep to the tokenizer's 320 ids (the model has 400 logits).
  auto sampled =
      c.Post("/v1/completions", json{{"prompt", "What is"}, {"max_tokens", 24}, {"seed", 1}}.dump(),
             "application/json");
  ASSERT_TRUE(sampled);
  EXPECT_EQ(sampled->status, 200) << sampled->body;

  // Exported to HF, the checkpoint's template goes into tokenizer_config.json, where
  // transformers (and pollen chat) find it.
  const std::string export_cmd = std::string(POLLEN_BINARY) + " export hf --model " +
                                 (dir / "run").string() + " --output " + (dir / "hf").string() +
                                 " > /dev/null 2>&1";
  ASSERT_EQ(std::system(export_cmd.c_str()), 0);
  EXPECT_EQ(tokenizer::chat_format_from_config(dir / "hf" / "tokenizer_config.json").kind,
            tokenizer::ChatTemplate::chatml);
  std::filesystem::remove_all(dir);
}

// A SentencePiece tokenizer (Llama-2's decoder: markers become spaces, the first space of the whole
// text is stripped): generated text is what it adds to the prompt's, so its first space stays,
// whole, streamed and in the logprobs' tokens and offsets, and a stop string holding it matches.
TEST(ServingSentencePiece, GeneratedTextKeepsTheSpaceItsFirstTokenStandsFor) {
  const tokenizer::Tokenizer tok = tokenizer::hf_from_json_text(R"({
    "added_tokens": [{"id": 7, "content": "</s>", "special": true}],
    "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                      "split": true},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "byte_fallback": true, "merges": [], "vocab": {
      "a": 0, "b": 1, "\u2581": 2, "\u2581a": 3, "\u2581b": 4, "a\u2581b": 5, "\u2581\u2581a": 6,
      "</s>": 7}}})",
                                                                "sp.json");
  const model::Llama model = testing::tiny_model(tok.vocab_size());
  serve::ServerOptions o;
  o.port = 0;
  o.model = {"sp", 256, {}, {}, {}, {}};
  serve::Server server(model, tok, o);
  server.start();
  const std::vector<uint32_t> prompt = tok.encode("a b");
  model::SamplingOptions greedy;
  greedy.max_tokens = 6;
  greedy.temperature = 0;
  const std::vector<uint32_t> gen = model::generate(model, {prompt}, greedy)[0].tokens;
  std::vector<uint32_t> all = prompt;
  all.insert(all.end(), gen.begin(), gen.end());
  const std::string whole = tok.decode(all), prompt_text = tok.decode(prompt);
  ASSERT_EQ(whole.substr(0, prompt_text.size()), prompt_text);
  const std::string expected = whole.substr(prompt_text.size());
  ASSERT_NE(expected, tok.decode(gen)) << "the first generated token stands for no space";

  httplib::Client c("127.0.0.1", server.port());
  const json body = {{"prompt", "a b"}, {"max_tokens", 6}, {"temperature", 0}, {"logprobs", 0}};
  auto r = c.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json choice = json::parse(r->body)["choices"][0];
  EXPECT_EQ(choice["text"], expected);
  std::string joined;
  const json& lp = choice["logprobs"];
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    EXPECT_EQ(lp["text_offset"][i], prompt_text.size() + joined.size()) << i;
    joined += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(joined, expected);
  json streamed = body;
  streamed.erase("logprobs");
  streamed["stream"] = true;
  r = c.Post("/v1/completions", streamed.dump(), "application/json");
  ASSERT_TRUE(r);
  std::string text;
  for (size_t at = 0; (at = r->body.find("data: {", at)) != std::string::npos; ++at)
    text +=
        json::parse(r->body.substr(at + 6, r->body.find("\n\n", at) - at - 6))["choices"][0]["text"]
            .get<std::string>();
  EXPECT_EQ(text, expected) << r->body;
  // A stop string that begins with the first token's space ends the text before it.
  json stopped = streamed;
  stopped.erase("stream");
  stopped["stop"] = expected.substr(0, 2);
  r = c.Post("/v1/completions", stopped.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body)["choices"][0]["text"], "");
  EXPECT_EQ(json::parse(r->body)["choices"][0]["finish_reason"], "stop");
  server.stop();
}

}  // namespace
}  // namespace pollen
