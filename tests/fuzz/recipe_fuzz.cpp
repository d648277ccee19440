// A recipe: YAML, then --set overrides (trainer/recipe/recipe.h). The input is the YAML text; after a
// line "%%", each further line is one `key=value` override. An accepted recipe must print
// (--print-recipe) as YAML that loads back to the same recipe.
#include "fuzz_support.h"
#include "trainer/recipe/recipe.h"

#include <sstream>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text = qtrain::fuzz::bytes_text(data, size);
  std::vector<std::string> overrides;
  const auto separator = text.find("\n%%\n");
  if (separator != std::string::npos) {
    std::istringstream lines(text.substr(separator + 4));
    for (std::string line; std::getline(lines, line);) overrides.push_back(line);
    text.resize(separator + 1);
  }
  const std::string path = qtrain::fuzz::write_scratch_file("recipe.yaml", text);
  qtrain::fuzz::expect_only_qtrain_errors([&] {
    const auto recipe = qtrain::trainer::load_recipe(path, overrides);
    const std::string printed = qtrain::fuzz::write_scratch_file("printed.yaml", qtrain::trainer::recipe_to_yaml(recipe));
    if (qtrain::trainer::load_recipe(printed, {}) != recipe) std::abort();
  });
  return 0;
}
