// qtrain::Error's codes: stable names a user looks up in docs/ERRORS.md.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/error.h"

namespace qtrain {
namespace {

constexpr ErrorCode kEveryCode[] = {
    ErrorCode::kUsage,      ErrorCode::kRecipe,   ErrorCode::kModelConfig, ErrorCode::kTokenizer,
    ErrorCode::kData,       ErrorCode::kWeights,  ErrorCode::kAdapter,     ErrorCode::kCheckpoint,
    ErrorCode::kFileSystem, ErrorCode::kDistributed, ErrorCode::kNumerics, ErrorCode::kOutOfMemory,
    ErrorCode::kInternal,
};

TEST(ErrorCodes, EveryCodeHasItsOwnNameAndAnEntryInTheErrorsDocument) {
  std::ifstream file(std::string(QTRAIN_SOURCE_DIR) + "/docs/ERRORS.md");
  ASSERT_TRUE(file) << "docs/ERRORS.md";
  std::stringstream document;
  document << file.rdbuf();
  std::set<std::string> names;
  for (const ErrorCode code : kEveryCode) {
    const std::string name = error_code_name(code);
    EXPECT_EQ(name.rfind("QT-", 0), 0u) << name;
    EXPECT_TRUE(names.insert(name).second) << name << " names two codes";
    EXPECT_NE(document.str().find("## " + name + "\n"), std::string::npos) << name << " has no section";
  }
}

// A throw site cannot leave its code out: the message alone does not make an Error.
static_assert(!std::is_constructible_v<Error, std::string>, "every Error names its ErrorCode");
static_assert(!std::is_constructible_v<Error, const char*>, "every Error names its ErrorCode");

TEST(ErrorCodes, AnErrorKeepsItsCodeAndMessage) {
  EXPECT_EQ(Error(ErrorCode::kWeights, "x").code(), ErrorCode::kWeights);
  EXPECT_STREQ(Error(ErrorCode::kWeights, "model.safetensors: damaged").what(), "model.safetensors: damaged");
}

TEST(ShapeText, WritesAShapeAsLibTorchPrintsSizes) {
  EXPECT_EQ(shape_text({8192, 256}), "[8192, 256]");
  EXPECT_EQ(shape_text(std::vector<int64_t>{}), "[]");
  EXPECT_EQ(shape_text(std::vector<int64_t>{3}), "[3]");
}

}  // namespace
}  // namespace qtrain
