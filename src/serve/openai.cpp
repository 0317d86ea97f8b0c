#include "serve/openai.h"
#include "base/json_depth.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "base/utf8.h"
#include "eval/multiple_choice.h"

namespace pollen::serve {
namespace {

using json = nlohmann::json;

std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// Fields a request may carry: those read, and those accepted only at their neutral value.
void refuse_unknown_fields(const json& body, const std::set<std::string>& known) {
  for (const auto& [key, value] : body.items())
    if (!known.contains(key))
      bad_request(key, "Unrecognized request argument supplied: " + key, "unknown_field");
}

double number_in(const json& body, const std::string& key, double lo, double hi, double fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  const json& v = body[key];
  if (!v.is_number() || v.get<double>() < lo || v.get<double>() > hi)
    bad_request(key, cat("'", key, "' must be a number from ", lo, " to ", hi, ", got ", shown(v)));
  return v.get<double>();
}

int64_t integer_in(const json& body, const std::string& key, int64_t lo, int64_t hi,
                   int64_t fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  const json& v = body[key];
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
    bad_request(key,
                cat("'", key, "' must be an integer from ", lo, " to ", hi, ", got ", shown(v)));
  return v.get<int64_t>();
}

bool boolean(const json& body, const std::string& key) {
  if (!body.contains(key) || body[key].is_null()) return false;
  if (!body[key].is_boolean())
    bad_request(key, cat("'", key, "' must be true or false, got ", shown(body[key])));
  return body[key].get<bool>();
}

// Fields accepted only at the value that changes nothing.
void neutral_only(const json& body) {
  if (body.contains("best_of") && !body["best_of"].is_null() && body["best_of"] != json(1))
    bad_request("best_of", "'best_of' must be 1: every sampled choice is returned",
                "unsupported_value");
  for (const char* key : {"presence_penalty", "frequency_penalty"})
    if (body.contains(key) && !body[key].is_null() &&
        !(body[key].is_number() && body[key].get<double>() == 0))
      bad_request(key, cat("'", key, "' is not supported (must be 0)"), "unsupported_value");
  if (body.contains("logit_bias") && !body["logit_bias"].is_null() &&
      !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
    bad_request("logit_bias", "'logit_bias' is not supported", "unsupported_value");
  if (body.contains("user") && !body["user"].is_null() && !body["user"].is_string())
    bad_request("user", "'user' must be a string");
  if (body.contains("model") && !body["model"].is_null() && !body["model"].is_string())
    bad_request("model", "'model' must be a string");
  // Accepted and ignored (nothing is stored), when of their type.
  const auto given = [&](const char* key) { return body.contains(key) && !body[key].is_null(); };
  if (given("store") && !body["store"].is_boolean())
    bad_request("store", "'store' must be true or false");
  if (given("metadata") && !body["metadata"].is_object())
    bad_request("metadata", "'metadata' must be an object");
  if (given("service_tier") && !body["service_tier"].is_string())
    bad_request("service_tier", "'service_tier' must be a string");
}

// Chat fields that clients and frameworks send at values that ask for nothing this server lacks:
// accepted there, refused otherwise as unsupported.
void neutral_chat_only(const json& body) {
  const auto given = [&](const char* key) { return body.contains(key) && !body[key].is_null(); };
  if (given("response_format") &&
      !(body["response_format"].is_object() && body["response_format"].size() == 1 &&
        body["response_format"].contains("type") &&
        body["response_format"]["type"] == json("text")))
    bad_request("response_format",
                "'response_format' must be {\"type\": \"text\"}: structured outputs are not "
                "supported",
                "unsupported_value");
  if (given("tools") && !(body["tools"].is_array() && body["tools"].empty()))
    bad_request("tools", "'tools' is not supported (tool calls are not)", "unsupported_value");
  if (given("tool_choice") && body["tool_choice"] != json("none") &&
      body["tool_choice"] != json("auto"))
    bad_request("tool_choice", "'tool_choice' must be \"none\" or \"auto\": there are no tools",
                "unsupported_value");
  if (given("parallel_tool_calls") && !body["parallel_tool_calls"].is_boolean())
    bad_request("parallel_tool_calls", "'parallel_tool_calls' must be true or false");
}

// stream_options ({"include_usage": bool}), which only a streamed request may carry: whether a
// last chunk brings the request's usage.
bool include_usage(const json& body, bool stream) {
  if (!body.contains("stream_options") || body["stream_options"].is_null()) return false;
  const json& o = body["stream_options"];
  if (!o.is_object())
    bad_request("stream_options", "'stream_options' must be an object, got " + shown(o));
  if (!stream)
    bad_request("stream_options", "'stream_options' is only allowed when 'stream' is true");
  for (const auto& [key, value] : o.items())
    if (key != "include_usage")
      bad_request("stream_options", "Unrecognized stream option: " + key, "unknown_field");
  if (!o.contains("include_usage") || o["include_usage"].is_null()) return false;
  if (!o["include_usage"].is_boolean())
    bad_request("stream_options", "'stream_options.include_usage' must be true or false, got " +
                                      shown(o["include_usage"]));
  return o["include_usage"].get<bool>();
}

// n: choices per prompt, each sampled on its own (at most --max-prompts in a request).
int64_t choices_per_prompt(const json& body, const Limits& limits) {
  return integer_in(body, "n", 1, limits.max_prompts, 1);
}

std::vector<std::string> stop_strings(const json& body) {
  if (!body.contains("stop") || body["stop"].is_null()) return {};
  const json& v = body["stop"];
  if (v.is_string()) return {v.get<std::string>()};
  // OpenAI takes 4; evaluation harnesses send more (lm-evaluation-harness: a task's stops and the
  // EOS), so up to 64.
  if (v.is_array() && v.size() <= 64 &&
      std::all_of(v.begin(), v.end(), [](const json& s) { return s.is_string(); }))
    return v.get<std::vector<std::string>>();
  bad_request("stop", "'stop' must be a string or a list of at most 64 strings, got " + shown(v));
}

// temperature, top_p, seed, stop and the token budget, shared by both endpoints; *asked gets the
// budget as the body gave it (before --max-tokens caps it), when it gave one.
model::SamplingOptions sampling(const json& body, const ServedModel& model, const Limits& limits,
                                int64_t max_tokens_default, const std::string& max_tokens_key,
                                int64_t min_tokens, int64_t* asked) {
  model::SamplingOptions o;
  o.max_tokens = max_tokens_default;
  if (body.contains(max_tokens_key) && !body[max_tokens_key].is_null()) {
    const json& v = body[max_tokens_key];
    if (!v.is_number_integer() || v.get<int64_t>() < min_tokens)
      bad_request(max_tokens_key, cat("'", max_tokens_key, "' must be an integer of at least ",
                                      min_tokens, ", got ", shown(v)));
    o.max_tokens = v.get<int64_t>();
    *asked = o.max_tokens;
  }
  // More than --max-tokens asked (many clients send 2048 or 4096 by default): as many as the
  // server generates, the choice then ending with finish_reason "length".
  o.max_tokens = std::min(o.max_tokens, limits.max_tokens);
  o.temperature = number_in(body, "temperature", 0, 2, 1.0);
  o.top_p = number_in(body, "top_p", 0, 1, 1.0);
  if (o.top_p == 0) {  // OpenAI takes 0: the most likely token alone, which is greedy decoding
    o.top_p = 1;
    o.temperature = 0;
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer())
      bad_request("seed", "'seed' must be an integer, got " + shown(body["seed"]));
    o.seed = body["seed"].is_number_unsigned() ? body["seed"].get<uint64_t>()
                                               : static_cast<uint64_t>(body["seed"].get<int64_t>());
  } else {
    static thread_local std::random_device device;
    o.seed = (static_cast<uint64_t>(device()) << 32) | device();
  }
  o.stop_strings = stop_strings(body);
  o.stop_tokens = model.stop_tokens;
  return o;
}

bool is_token_list(const json& v) {
  return v.is_array() && !v.empty() &&
         std::all_of(v.begin(), v.end(), [](const json& t) { return t.is_number_integer(); });
}

std::vector<uint32_t> token_list(const json& v, const tokenizer::Tokenizer& tok,
                                 const std::string& param = "prompt") {
  std::vector<uint32_t> ids;
  for (const json& t : v) {
    if (!t.is_number_unsigned() || t.get<uint64_t>() >= tok.vocab_size())
      bad_request(param, cat("'", param, "' token id ", shown(t), " is outside the vocabulary of ",
                             tok.vocab_size()));
    ids.push_back(t.get<uint32_t>());
  }
  return ids;
}

std::vector<uint32_t> encode_prompt(const std::string& text, const tokenizer::Tokenizer& tok) {
  tokenizer::EncodeOptions eo;
  eo.special = tokenizer::SpecialPolicy::allow_all();
  eo.add_bos_eos = true;
  auto ids = tok.encode(text, eo);
  // The post-processor's suffix (an EOS) would end the prompt; a completion continues the text.
  const auto& suffix = tok.bos_eos().suffix;
  if (!suffix.empty() && ids.size() >= suffix.size()) ids.resize(ids.size() - suffix.size());
  if (ids.empty()) bad_request("prompt", "'prompt' holds no tokens");
  return ids;
}

// A token as completions' logprobs name it: its text (where it follows others, with the space a
// SentencePiece marker stands for), or for one that is not whole UTF-8 (a part of a character)
// "bytes:\xe4\xb8", as OpenAI writes such tokens, so that no two tokens share a name and none
// reads as U+FFFD.
std::string token_name(const tokenizer::Tokenizer& tok, uint32_t id, bool first) {
  const std::vector<uint32_t> ids{id};
  const std::string text = first ? tok.decode(ids) : tok.decode_continuation(ids);
  if (utf8_valid(text)) return text;
  std::string name = "bytes:";
  char hex[8];
  for (const char c : text) {
    std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned>(static_cast<unsigned char>(c)));
    name += hex;
  }
  return name;
}

// {token: logprob} of the most likely tokens, and of the chosen one (`chosen`) when it is not
// among them: OpenAI returns up to logprobs + 1 entries (logprobs 0: the chosen one alone).
json top_json(const tokenizer::Tokenizer& tok, const eval::TokenScore& s, uint32_t chosen,
              bool first) {
  json top = json::object();
  for (const auto& [id, lp] : s.top) {
    const std::string name = token_name(tok, id, first);
    if (!top.contains(name)) top[name] = lp;
  }
  const std::string name = token_name(tok, chosen, first);
  if (!top.contains(name)) top[name] = s.logprob;
  return top;
}

}  // namespace

void check_model(const json& body, const ServedModel& model) {
  if (body.contains("model") && body["model"].is_string() &&
      body["model"].get<std::string>() != model.name)
    throw ApiError(404, "invalid_request_error", "model_not_found", "model",
                   cat("The model '", body["model"].get<std::string>(),
                       "' does not exist; this server serves '", model.name, "'"));
}

void bad_request(const std::string& param, const std::string& message, const std::string& code) {
  throw ApiError(400, "invalid_request_error", code, param, message);
}

json error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

json parse_body(const std::string& body) {
  if (!json_depth_within(body))
    throw ApiError(400, "invalid_request_error", "invalid_json", "",
                   cat("The request body nests JSON more than ", kMaxJsonDepth, " levels deep"));
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 5: ..." without its tag
    const std::string what = e.what();
    const size_t tag = what.find("] ");
    throw ApiError(400, "invalid_request_error", "invalid_json", "",
                   cat("The request body is not valid JSON: ",
                       tag == std::string::npos ? what : what.substr(tag + 2)));
  }
  if (!j.is_object())
    throw ApiError(400, "invalid_request_error", "invalid_json", "",
                   "The request body must be a JSON object");
  return j;
}

void check_prompt_length(size_t tokens, int64_t max_tokens, const ServedModel& model,
                         const Limits& limits, const std::string& prompt_field,
                         int64_t min_completion, int64_t asked_in_body) {
  const int64_t n = static_cast<int64_t>(tokens);
  // Over the context: worded as OpenAI's, which some frameworks look for; a chat reply needs
  // one token at least.
  // The check takes the budget as --max-tokens capped it; the message names it as the client
  // sent it, when that was more.
  const int64_t needed = std::max(max_tokens, min_completion);
  const int64_t asked = std::max(needed, asked_in_body);
  const auto over_context = [&] {
    bad_request(
        prompt_field,
        cat("This model's maximum context length is ", model.context,
            " tokens. However, you requested ",
            static_cast<uint64_t>(n) + static_cast<uint64_t>(asked), " tokens (", n, " in the ",
            prompt_field, ", ", asked, " in the completion). Please reduce the length of the ",
            prompt_field, " or completion."),
        "context_length_exceeded");
  };
  if (n > model.context) over_context();
  if (limits.max_prompt_tokens > 0 && n > limits.max_prompt_tokens)
    bad_request(prompt_field,
                cat("The prompt has ", n, " tokens; this server takes at most ",
                    limits.max_prompt_tokens, " (--max-prompt-tokens)"),
                "context_length_exceeded");
  if (needed > model.context - n) over_context();
}

CompletionRequest parse_completion_request(const json& body, const tokenizer::Tokenizer& tok,
                                           const ServedModel& model, const Limits& limits) {
  refuse_unknown_fields(body, {"model",
                               "prompt",
                               "max_tokens",
                               "temperature",
                               "top_p",
                               "stop",
                               "seed",
                               "logprobs",
                               "echo",
                               "stream",
                               "stream_options",
                               "n",
                               "best_of",
                               "presence_penalty",
                               "frequency_penalty",
                               "logit_bias",
                               "user",
                               "store",
                               "metadata",
                               "service_tier",
                               "suffix"});
  neutral_only(body);
  check_model(body, model);
  if (body.contains("suffix") && !body["suffix"].is_null())
    bad_request("suffix", "'suffix' is not supported", "unsupported_value");
  CompletionRequest r;
  r.sampling = sampling(body, model, limits, 16, "max_tokens", 0, &r.max_tokens_asked);
  r.echo = boolean(body, "echo");
  r.stream = boolean(body, "stream");
  r.include_usage = include_usage(body, r.stream);
  if (body.contains("logprobs") && !body["logprobs"].is_null())
    r.logprobs = integer_in(body, "logprobs", 0, 20, 0);
  if (!body.contains("prompt")) bad_request("prompt", "'prompt' is required", "missing_field");
  const json& p = body["prompt"];
  const auto add_text = [&](const json& text) {
    r.prompts.push_back(encode_prompt(text.get<std::string>(), tok));
    r.prompt_texts.push_back(text.get<std::string>());
  };
  const auto add_ids = [&](const json& ids) {
    r.prompts.push_back(token_list(ids, tok));
    r.prompt_texts.push_back(tok.decode(r.prompts.back()));
  };
  if (p.is_string()) {
    add_text(p);
  } else if (is_token_list(p)) {
    add_ids(p);
  } else if (p.is_array() && !p.empty()) {
    for (const json& one : p) {
      if (one.is_string())
        add_text(one);
      else if (is_token_list(one))
        add_ids(one);
      else
        bad_request("prompt",
                    "'prompt' must be a string, a list of strings, a list of token ids "
                    "or a list of such lists; an element is " +
                        shown(one));
    }
  } else {
    bad_request("prompt",
                "'prompt' must be a string, a list of strings, a list of token ids or a "
                "list of such lists, got " +
                    shown(p));
  }
  r.n = choices_per_prompt(body, limits);
  if (static_cast<int64_t>(r.prompts.size()) * r.n > limits.max_prompts)
    bad_request(r.n > 1 ? "n" : "prompt",
                cat("'prompt' holds ", r.prompts.size(), " prompts",
                    r.n > 1 ? cat(" of n = ", r.n, " choices each") : "",
                    "; this server takes at most ", limits.max_prompts, " choices per request"));
  for (const auto& ids : r.prompts)
    check_prompt_length(ids.size(), r.sampling.max_tokens, model, limits, "prompt", 0,
                        r.max_tokens_asked);
  if (r.stream && r.echo)
    bad_request("echo", "'echo' cannot be combined with 'stream'", "unsupported_value");
  if (r.stream && r.logprobs)
    bad_request("logprobs", "'logprobs' cannot be combined with 'stream'", "unsupported_value");
  return r;
}

TokenizeRequest parse_tokenize_request(const json& body) {
  refuse_unknown_fields(body, {"model", "prompt", "add_special_tokens"});
  if (!body.contains("prompt") || !body["prompt"].is_string())
    bad_request("prompt", "'prompt' must be a string");
  TokenizeRequest r;
  r.prompt = body["prompt"].get<std::string>();
  if (body.contains("add_special_tokens") && !body["add_special_tokens"].is_null())
    r.add_special_tokens = boolean(body, "add_special_tokens");
  return r;
}

std::vector<uint32_t> parse_detokenize_request(const json& body, const tokenizer::Tokenizer& tok) {
  refuse_unknown_fields(body, {"model", "tokens"});
  if (!body.contains("tokens") || !body["tokens"].is_array())
    bad_request("tokens", "'tokens' must be a list of token ids");
  if (body["tokens"].empty()) return {};
  if (!is_token_list(body["tokens"])) bad_request("tokens", "'tokens' must be a list of token ids");
  return token_list(body["tokens"], tok, "tokens");
}

ChatRequest parse_chat_request(const json& body, const ServedModel& model, const Limits& limits) {
  refuse_unknown_fields(body, {"model",
                               "messages",
                               "max_tokens",
                               "max_completion_tokens",
                               "temperature",
                               "top_p",
                               "stop",
                               "seed",
                               "stream",
                               "stream_options",
                               "n",
                               "presence_penalty",
                               "frequency_penalty",
                               "logit_bias",
                               "user",
                               "logprobs",
                               "top_logprobs",
                               "response_format",
                               "tools",
                               "tool_choice",
                               "parallel_tool_calls",
                               "store",
                               "metadata",
                               "service_tier"});
  neutral_only(body);
  neutral_chat_only(body);
  check_model(body, model);
  ChatRequest r;
  const bool logprobs = boolean(body, "logprobs");
  if (body.contains("top_logprobs") && !body["top_logprobs"].is_null() && !logprobs)
    bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  if (logprobs) r.logprobs = integer_in(body, "top_logprobs", 0, 20, 0);
  // max_completion_tokens replaces max_tokens; a null one is as if absent.
  const std::string budget_key =
      body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null()
          ? "max_completion_tokens"
          : "max_tokens";
  r.sampling = sampling(body, model, limits, limits.max_tokens, budget_key, 1, &r.max_tokens_asked);
  if (model.end_of_turn) r.sampling.stop_tokens.push_back(*model.end_of_turn);
  r.budget_given = body.contains(budget_key) && !body[budget_key].is_null();
  r.stream = boolean(body, "stream");
  r.include_usage = include_usage(body, r.stream);
  r.n = choices_per_prompt(body, limits);
  if (r.stream && r.logprobs)
    bad_request("logprobs", "'logprobs' cannot be combined with 'stream'", "unsupported_value");
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    bad_request("messages", "'messages' must be a non-empty list of {role, content} objects");
  for (size_t i = 0; i < body["messages"].size(); ++i) {
    const json& m = body["messages"][i];
    const std::string where = cat("messages[", i, "]");
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      bad_request(where, cat("'", where, "' must be an object with a string 'role'"));
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "developer")
      bad_request(where + ".role",
                  cat("'", where, ".role' must be system, user, assistant or developer (taken ",
                      "as system), got '", role, "'"));
    std::string content;
    const json c = m.contains("content") ? m["content"] : json(nullptr);
    if (c.is_string()) {
      content = c.get<std::string>();
    } else if (c.is_array()) {  // [{"type": "text", "text": ...}, ...], joined by newlines
      for (const json& part : c) {
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
            !part.contains("text") || !part["text"].is_string())
          bad_request(where + ".content", cat("'", where,
                                              ".content' parts must be {\"type\": \"text\", "
                                              "\"text\": string}"));
        if (&part != &c.front()) content += '\n';
        content += part["text"].get<std::string>();
      }
    } else {
      bad_request(where + ".content", cat("'", where,
                                          ".content' must be a string or a list of "
                                          "text parts, got ",
                                          shown(c)));
    }
    r.messages.push_back({role == "developer" ? "system" : role, std::move(content)});
  }
  return r;
}

namespace {

// The characters `text` has in a reply: a JSON string holds UTF-8, and invalid bytes (a token
// that is part of a character, or bytes of no character) are written as one U+FFFD per maximal
// invalid run, as the reply's encoder (nlohmann's error_handler_t::replace, Hoehrmann's decoder)
// writes them; an incomplete character at the end counts once. text_offset must count the text
// so, or offsets after an invalid byte run behind it.
int64_t rendered_chars(std::string_view text) {
  int64_t chars = 0;
  size_t i = 0;
  const auto byte = [&](size_t at) { return static_cast<uint8_t>(text[at]); };
  while (i < text.size()) {
    const uint8_t lead = byte(i);
    ++chars;
    size_t need = lead < 0x80                    ? 0
                  : lead >= 0xC2 && lead <= 0xDF ? 1
                  : lead >= 0xE0 && lead <= 0xEF ? 2
                  : lead >= 0xF0 && lead <= 0xF4 ? 3
                                                 : 0;
    if (lead >= 0x80 && need == 0) {  // a stray continuation byte, or no lead byte at all
      ++i;
      continue;
    }
    // The second byte's range depends on the lead (no overlongs, surrogates or past U+10FFFF).
    const uint8_t low = lead == 0xE0 ? 0xA0 : lead == 0xF0 ? 0x90 : 0x80;
    const uint8_t high = lead == 0xED ? 0x9F : lead == 0xF4 ? 0x8F : 0xBF;
    size_t j = i + 1;
    for (size_t k = 0; k < need && j < text.size(); ++k, ++j) {
      const uint8_t b = byte(j);
      if (b < (k == 0 ? low : 0x80) || b > (k == 0 ? high : 0xBF)) break;
    }
    i = j;  // a whole character, or the invalid run up to the byte that broke it (read again)
  }
  return chars;
}

}  // namespace

json completion_logprobs(const tokenizer::Tokenizer& tok, const std::vector<uint32_t>& prompt,
                         const SequenceResult& r, bool echo) {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  std::vector<uint32_t> all = prompt;
  const std::vector<uint32_t>& gen = r.generation.tokens;
  all.insert(all.end(), gen.begin(), gen.end());
  const size_t first = echo ? 0 : prompt.size();
  const std::string prompt_text = tok.decode(prompt);
  for (size_t i = first; i < all.size(); ++i) {
    tokens.push_back(token_name(tok, all[i], i == 0));
    // Characters of the text before the token, as the choice's text has it: generated special
    // tokens add none there.
    const std::span<const uint32_t> before(all.data(), i);
    offsets.push_back(rendered_chars(
        i <= prompt.size() ? tok.decode(before)
                           : prompt_text + tok.generated_text(before.subspan(prompt.size()))));
    const bool in_prompt = i < prompt.size();
    const std::optional<eval::TokenScore>* ps =
        in_prompt && i < r.prompt_scores.size() ? &r.prompt_scores[i] : nullptr;
    if (in_prompt && (!ps || !ps->has_value())) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
    } else {
      const eval::TokenScore& s = in_prompt ? **ps : r.token_scores[i - prompt.size()];
      lps.push_back(s.logprob);
      tops.push_back(top_json(tok, s, all[i], i == 0));
    }
  }
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

namespace {

// One token of a chat choice's logprobs: its text (after the prompt: with the space a
// SentencePiece marker stands for), log-probability and UTF-8 bytes.
json chat_token(const tokenizer::Tokenizer& tok, uint32_t id, double logprob) {
  const std::string text = tok.decode_continuation(std::vector<uint32_t>{id});
  json bytes = json::array();
  for (const char c : text) bytes.push_back(static_cast<unsigned char>(c));
  return {{"token", text}, {"logprob", logprob}, {"bytes", bytes}};
}

}  // namespace

json chat_logprobs(const tokenizer::Tokenizer& tok, const SequenceResult& r) {
  json content = json::array();
  for (size_t i = 0; i < r.generation.tokens.size(); ++i) {
    const eval::TokenScore& s = r.token_scores[i];
    json entry = chat_token(tok, r.generation.tokens[i], s.logprob);
    entry["top_logprobs"] = json::array();
    for (const auto& [id, lp] : s.top) entry["top_logprobs"].push_back(chat_token(tok, id, lp));
    content.push_back(std::move(entry));
  }
  return {{"content", content}, {"refusal", nullptr}};
}

std::string TextStream::on_token(uint32_t token) {
  tokens_.push_back(token);
  const std::string text = tok_->generated_text(tokens_);
  size_t safe = text.size();
  // An unfinished UTF-8 character at the end waits for its other bytes.
  for (size_t back = 1; back <= std::min<size_t>(3, text.size()); ++back) {
    const auto c = static_cast<uint8_t>(text[text.size() - back]);
    if ((c & 0xc0) == 0x80) continue;
    const size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    if (need > back) safe = text.size() - back;
    break;
  }
  const size_t limit = safe;
  for (const std::string& s : stops_) {
    if (s.empty()) continue;
    const size_t at = text.find(s);
    if (at != std::string::npos) safe = std::min(safe, at);
    // A tail that may yet become a stop string waits too.
    for (size_t len = std::min(s.size() - 1, limit); len > 0; --len) {
      if (text.compare(limit - len, len, s, 0, len) == 0) {
        safe = std::min(safe, limit - len);
        break;
      }
    }
  }
  if (safe <= sent_) return {};
  std::string delta = text.substr(sent_, safe - sent_);
  sent_ = safe;
  return delta;
}

std::string TextStream::finish(const std::string& final_text) {
  if (final_text.size() <= sent_) return {};
  std::string rest = final_text.substr(sent_);
  sent_ = final_text.size();
  return rest;
}

}  // namespace pollen::serve
