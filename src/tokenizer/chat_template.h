#pragma once
// Chat templates: a conversation rendered as the text a chat model was trained on, exactly as
// HF's apply_chat_template renders the Jinja templates of ChatML (Qwen2, SmolLM2) and Llama 3.
// pollen does not run Jinja: a model's template (tokenizer_config.json's chat_template) is
// recognised as one of these and refused with a clear error otherwise.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pollen::tokenizer {

class Tokenizer;

struct ChatMessage {
  std::string role;  // system, user, assistant (any role is rendered as given)
  std::string content;
};

enum class ChatTemplate { chatml, llama3 };

// ChatML: "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message.
// Llama 3: "<|begin_of_text|>" then "<|start_header_id|>ROLE<|end_header_id|>\n\n" +
// CONTENT with surrounding whitespace stripped + "<|eot_id|>" per message.
// With `add_generation_prompt`, the header of an assistant turn follows.
std::string render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt);

// A template as a model's config names it. ChatML templates such as Qwen2's insert a system
// message when the conversation does not start with one; `default_system` is its content.
struct ChatFormat {
  ChatTemplate kind = ChatTemplate::chatml;
  std::optional<std::string> default_system;
  bool operator==(const ChatFormat&) const = default;
};

std::string render_chat(const ChatFormat& format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt);

// The special token that ends a turn: "<|im_end|>" (ChatML) or "<|eot_id|>" (Llama 3).
std::string_view end_of_turn(ChatTemplate t);

// Every special token the template writes (its markup), the end of turn among them.
std::vector<std::string_view> chat_markup_tokens(ChatTemplate t);

// The id `tok` gives `content` as an added token; nothing when it has no such token (then the
// text would be encoded as plain bytes).
std::optional<uint32_t> added_token_id(const Tokenizer& tok, std::string_view content);

// The template's markup tokens that `tok` lacks (none: the template can be used with it).
std::vector<std::string> missing_chat_markup(const Tokenizer& tok, ChatTemplate t);

// The id of the token that ends a turn; an error when the tokenizer lacks it or any other of the
// template's markup tokens (they would be encoded as plain bytes: a prompt the model was never
// trained on, and without the end of turn no reply could ever end). `what_to_do` ends the error:
// how the caller's user chooses another template.
uint32_t end_of_turn_id(const Tokenizer& tok, ChatTemplate t, std::string_view what_to_do);

// The template's Jinja text as HF models carry it (what tokenizer_config.json's chat_template
// holds for it).
std::string_view chat_template_jinja(ChatTemplate t);

// "chatml" or "llama3"; anything else is refused naming the choices.
ChatTemplate chat_template_named(std::string_view name);
std::string_view chat_template_name(ChatTemplate t);

// Recognises a Jinja chat template's text (whitespace outside string literals and the way
// string literals are escaped do not matter); `source` names it in errors.
ChatFormat recognise_chat_template(std::string_view jinja, std::string_view source);

// chat_template.jinja beside tokenizer_config.json, where transformers' save_pretrained writes
// the template (and from where it reads it first).
std::filesystem::path chat_template_file(const std::filesystem::path& tokenizer_config);
// The Jinja text of chat_template.jinja beside tokenizer_config.json, else of the config's
// "chat_template" (a string, or a list of {name, template} of which "default" is taken);
// nothing when neither holds one (or neither file exists).
std::optional<std::string> chat_template_text(const std::filesystem::path& tokenizer_config);
// The template chat_template.jinja or tokenizer_config.json holds, recognised.
ChatFormat chat_format_from_config(const std::filesystem::path& tokenizer_config);

// The format for a model directory: `explicit_name` ("chatml" or "llama3") when given, otherwise
// the one the directory's tokenizer_config.json names; an error says why there is none (the
// caller adds how its user chooses one: a command-line option, a config key).
ChatFormat choose_chat_format(const std::filesystem::path& model_dir,
                              std::string_view explicit_name);

}  // namespace pollen::tokenizer
