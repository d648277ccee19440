#include "data/prompt_template.h"

#include "kernels/error.h"

namespace qtrain::data {

namespace {

struct NamedTemplate {
  const char* name;
  const char* with_input;
  const char* without_input;
};

// Stanford Alpaca's prompts (also axolotl's and torchtune's "alpaca").
const NamedTemplate kTemplates[] = {
    {"alpaca",
     "Below is an instruction that describes a task, paired with an input that provides further context. "
     "Write a response that appropriately completes the request.\n\n"
     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
     "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
     "### Instruction:\n{instruction}\n\n### Response:\n"},
};

// One pass over the template, so that braces inside the values are never taken for placeholders.
std::string fill(const std::string& text, const std::string& instruction, const std::string& input) {
  std::string out;
  for (size_t at = 0; at < text.size();) {
    if (text.compare(at, 13, "{instruction}") == 0) {
      out += instruction;
      at += 13;
    } else if (text.compare(at, 7, "{input}") == 0) {
      out += input;
      at += 7;
    } else {
      out += text[at++];
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> PromptTemplate::names() {
  std::vector<std::string> names;
  for (const auto& entry : kTemplates) names.emplace_back(entry.name);
  return names;
}

PromptTemplate PromptTemplate::named_or_custom(const std::string& name_or_text) {
  for (const auto& entry : kTemplates) {
    if (name_or_text == entry.name) return PromptTemplate(entry.with_input, entry.without_input);
  }
  if (name_or_text.find("{instruction}") == std::string::npos) {
    std::string known;
    for (const auto& name : names()) known += (known.empty() ? "" : ", ") + name;
    throw Error(ErrorCode::kData, "data.prompt_template: '" + name_or_text + "' is neither a named template (" + known +
                ") nor a template text with an {instruction} placeholder");
  }
  // One custom text serves both kinds of record: without an input, "{input}" renders empty.
  return PromptTemplate(name_or_text, name_or_text);
}

std::string PromptTemplate::render(const std::string& instruction, const std::string& input) const {
  return fill(input.empty() ? without_input_ : with_input_, instruction, input);
}

}  // namespace qtrain::data
