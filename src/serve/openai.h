#pragma once
// The OpenAI HTTP API's requests and responses as JSON: parsing with every field checked
// (a wrong type, an out-of-range value or an unknown field is a 400 naming the field), and the
// bodies of /v1/completions, /v1/chat/completions (whole and as stream chunks) and errors.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "model/generate.h"
#include "serve/engine.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace pollen::serve {

// An error answered to the client: HTTP status and OpenAI's {"error": {message, type, param,
// code}}.
class ApiError : public Error {
 public:
  ApiError(int http_status, std::string error_type, std::string error_code, std::string error_param,
           const std::string& message)
      : Error(message),
        status(http_status),
        type(std::move(error_type)),
        code(std::move(error_code)),
        param(std::move(error_param)) {}
  int status;
  std::string type, code, param;  // param: the request field at fault, or empty
};

// 400 invalid_request_error naming `param`.
[[noreturn]] void bad_request(const std::string& param, const std::string& message,
                              const std::string& code = "invalid_value");

nlohmann::json error_body(const ApiError& e);

struct Limits {
  size_t max_body_bytes = 4 << 20;  // request body
  int64_t max_prompt_tokens = 0;    // per prompt; 0: the model's context
  int64_t max_tokens = 1024;        // generated per sequence
  int64_t max_prompts = 64;         // choices in one request (prompts times n)
  int64_t max_concurrent = 32;      // requests in flight (queued, running or streaming)
};

// What requests are checked against.
struct ServedModel {
  std::string name;                   // the "model" requests may name
  int64_t context = 0;                // prompt + generated tokens at most
  std::vector<uint32_t> stop_tokens;  // end a generation (EOS)
  // Also ends a chat reply: the chat template's end of turn, which a tokenizer need not list
  // among its special tokens (then it is not in stop_tokens).
  std::optional<uint32_t> end_of_turn;
  // The model's BOS and EOS as transformers reports them (/tokenizer_info says them, and
  // lm-evaluation-harness's remote tokenizer conditions on them): no BOS is null; no EOS, the
  // first of stop_tokens.
  std::optional<uint32_t> bos, eos;
};

// The body as a JSON object, or a 400.
nlohmann::json parse_body(const std::string& body);

struct CompletionRequest {
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::string> prompt_texts;  // as given, or the token ids decoded (for echo)
  model::SamplingOptions sampling;
  int64_t max_tokens_asked = 0;  // what the body asked for, before --max-tokens (0: not given)
  bool echo = false;
  std::optional<int64_t> logprobs;  // top alternatives per token, when logprobs are asked for
  int64_t n = 1;  // choices per prompt: choice i * n + j from Rng(seed).fork(i * n + j)
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
};

// Prompts: a string, a list of strings, a list of token ids or a list of such lists. Text is
// encoded as the tokenizer's post-processor says (BOS when it adds one; no EOS); token ids go to
// the model as given.
CompletionRequest parse_completion_request(const nlohmann::json& body,
                                           const tokenizer::Tokenizer& tok,
                                           const ServedModel& model, const Limits& limits);

struct ChatRequest {
  std::vector<tokenizer::ChatMessage> messages;
  model::SamplingOptions sampling;
  std::optional<int64_t> logprobs;  // top_logprobs, when logprobs are asked for
  int64_t n = 1;                    // choices: choice j from Rng(seed).fork(j)
  bool stream = false;
  bool include_usage = false;    // stream_options.include_usage: a last chunk with the usage
  bool budget_given = false;     // max_tokens or max_completion_tokens was sent
  int64_t max_tokens_asked = 0;  // that budget as sent, before --max-tokens (0: not given)
};

ChatRequest parse_chat_request(const nlohmann::json& body, const ServedModel& model,
                               const Limits& limits);

// vLLM's /tokenize ({"prompt", "add_special_tokens" (default true)}) and /detokenize
// ({"tokens"}).
struct TokenizeRequest {
  std::string prompt;
  bool add_special_tokens = true;
};
TokenizeRequest parse_tokenize_request(const nlohmann::json& body);
std::vector<uint32_t> parse_detokenize_request(const nlohmann::json& body,
                                               const tokenizer::Tokenizer& tok);

// A 404 model_not_found unless the body's "model" (when given) is the served model's name.
void check_model(const nlohmann::json& body, const ServedModel& model);

// The prompt's tokens within the limits (a 400 context_length_exceeded otherwise, naming
// `prompt_field`): max_prompt_tokens, and the context holding prompt + max(max_tokens,
// min_completion). The error names the budget as the client asked for it (`asked`, when more
// than max_tokens, which --max-tokens capped).
void check_prompt_length(size_t tokens, int64_t max_tokens, const ServedModel& model,
                         const Limits& limits, const std::string& prompt_field = "prompt",
                         int64_t min_completion = 0, int64_t asked = 0);

// OpenAI's logprobs object of a completion choice: tokens, token_logprobs (null for a first
// prompt token), top_logprobs ({token: logprob}) and text_offset (characters of the prompt and
// completion tokens before each, as decoded). With echo, the prompt's tokens come first.
nlohmann::json completion_logprobs(const tokenizer::Tokenizer& tok,
                                   const std::vector<uint32_t>& prompt, const SequenceResult& r,
                                   bool echo);

// OpenAI's logprobs object of a chat choice: {"content": one {token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}]} per generated token, "refusal": null}.
nlohmann::json chat_logprobs(const tokenizer::Tokenizer& tok, const SequenceResult& r);

// Text deltas for streaming: what can be sent after each token without ever sending text that a
// stop string or an unfinished UTF-8 character would take back.
class TextStream {
 public:
  TextStream(const tokenizer::Tokenizer& tok, std::vector<std::string> stops)
      : tok_(&tok), stops_(std::move(stops)) {}
  std::string on_token(uint32_t token);
  std::string finish(const std::string& final_text);  // the rest of the final text

 private:
  const tokenizer::Tokenizer* tok_;
  std::vector<std::string> stops_;
  std::vector<uint32_t> tokens_;
  size_t sent_ = 0;
};

}  // namespace pollen::serve
