#pragma once
// Instruction prompts for `data.format: instruct` (alpaca records: instruction, input, output).
// A template is a pair of texts with {instruction} and {input} placeholders: one for records
// with an input, one for records without. Named templates are a table (prompt_template.cpp);
// any other text given as data.prompt_template is used as the template itself.
#include <string>
#include <vector>

namespace qtrain::data {

class PromptTemplate {
 public:
  // A name from the table ("alpaca"), or a template text holding {instruction} (and {input}
  // for records with an input). Error naming data.prompt_template otherwise.
  static PromptTemplate named_or_custom(const std::string& name_or_text);
  static std::vector<std::string> names();

  // The prompt before the response. An empty `input` selects the template without input.
  std::string render(const std::string& instruction, const std::string& input) const;
  bool takes_input() const { return with_input_.find("{input}") != std::string::npos; }

 private:
  PromptTemplate(std::string with_input, std::string without_input)
      : with_input_(std::move(with_input)), without_input_(std::move(without_input)) {}
  std::string with_input_;
  std::string without_input_;
};

}  // namespace qtrain::data
