// The folders are the architecture: includes point one way between them. Each source file's
// `#include "FOLDER/..."` lines are read and checked against what its folder may include.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>

#include "support.h"

namespace qtrain {
namespace {

// What a folder's sources may include besides their own folder. Folders further down the list
// build on the ones above; nothing points back up.
const std::map<std::string, std::set<std::string>>& allowed_includes() {
  static const std::map<std::string, std::set<std::string>> allowed = {
      {"kernels", {}},
      // qat/lora_linear.cpp matches peft's target_modules regexes with data/unicode_regex (PCRE2,
      // Python re's syntax); the only qat -> data include.
      {"qat", {"kernels", "data"}},
      {"optim", {"kernels"}},
      {"data", {"kernels"}},
      {"trainer/base", {"kernels"}},
      {"trainer/dist", {"kernels", "trainer/base"}},
      // What a run reports: metrics.jsonl, TensorBoard, the curves picture, the progress line.
      {"trainer/logging", {"kernels", "trainer/base"}},
      {"trainer/model", {"kernels", "qat", "data", "trainer/base"}},
      // One file per decoder family, on the decoder's layer.
      {"trainer/model/families", {"kernels", "qat", "data", "trainer/base", "trainer/model"}},
      // What a run minimises besides the next-token loss: the preference objectives.
      {"trainer/objectives", {"kernels", "qat", "data", "trainer/base", "trainer/model"}},
      {"trainer/formats", {"kernels", "qat", "data", "optim", "trainer/base", "trainer/model"}},
      {"trainer/recipe", {"kernels", "qat", "data", "optim", "trainer/base", "trainer/model", "trainer/formats", "trainer/dist",
                          "trainer/objectives"}},
      {"trainer", {"kernels", "qat", "data", "optim", "trainer/base", "trainer/dist", "trainer/logging", "trainer/model",
                   "trainer/formats", "trainer/recipe", "trainer/objectives"}},
  };
  return allowed;
}

// "trainer/model" for "trainer/model/llama.h", "qat" for "qat/linear.h".
std::string folder_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

TEST(Layout, IncludesPointOneWayBetweenFolders) {
  const std::filesystem::path root = testing::source_dir();
  const std::regex include_line(R"re(^\s*#\s*include\s+"([a-z_]+(/[a-z_]+)*/[a-z_0-9]+\.(h|cuh|inc))")re");
  int files = 0;
  for (const auto& [folder, allowed] : allowed_includes()) {
    for (const auto& entry : std::filesystem::directory_iterator(root / folder)) {
      const auto extension = entry.path().extension().string();
      if (!entry.is_regular_file() || (extension != ".h" && extension != ".cpp" && extension != ".cu" && extension != ".cuh")) {
        continue;
      }
      ++files;
      const std::string file = folder + "/" + entry.path().filename().string();
      std::ifstream input(entry.path());
      std::string line;
      for (int number = 1; std::getline(input, line); ++number) {
        std::smatch match;
        if (!std::regex_search(line, match, include_line)) continue;
        const std::string included = folder_of(match[1].str());
        if (included == folder || allowed.count(included)) continue;
        ADD_FAILURE() << file << ":" << number << " includes " << match[1].str() << ": " << folder
                      << " may include only its own folder and " << ::testing::PrintToString(allowed);
      }
    }
  }
  EXPECT_GT(files, 150);  // every folder was read
}

// Errors below the recipe layer describe the value; the recipe layer names the key.
TEST(Layout, QatErrorsNameNoRecipeKeys) {
  const std::filesystem::path root = testing::source_dir();
  const std::regex recipe_key(R"re("[^"]*\b(qlora|lora|qat|train|optim|data)\.[a-z_]+)re");
  for (const auto& entry : std::filesystem::directory_iterator(root / "qat")) {
    if (entry.path().extension() != ".cpp") continue;
    std::ifstream input(entry.path());
    std::string line;
    for (int number = 1; std::getline(input, line); ++number) {
      if (line.find("//") != std::string::npos && line.find("//") < line.find('"')) continue;
      if (std::regex_search(line, recipe_key)) {
        ADD_FAILURE() << "qat/" << entry.path().filename().string() << ":" << number << " names a recipe key: " << line;
      }
    }
  }
}

}  // namespace
}  // namespace qtrain
