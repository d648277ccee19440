// Writes that a crash must never leave half done: whole files and whole directories.
#include "trainer/base/file_system.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "support.h"

namespace qtrain::trainer {
namespace {

std::string contents(const std::string& path) {
  std::ifstream input(path);
  return std::string(std::istreambuf_iterator<char>(input), std::istreambuf_iterator<char>());
}

TEST(ReplaceDirectory, SwapsInTheNewVersionAndRemovesTheOld) {
  testing::TempDir dir;
  dir.write("adapter/weights", "old");
  dir.write("adapter/only-in-old", "x");
  dir.write(".adapter.staging/weights", "new");
  replace_directory(dir.file(".adapter.staging"), dir.file("adapter"));
  EXPECT_EQ(contents(dir.file("adapter/weights")), "new");
  EXPECT_FALSE(std::filesystem::exists(dir.file("adapter/only-in-old")));
  EXPECT_FALSE(std::filesystem::exists(dir.file(".adapter.staging")));
}

TEST(ReplaceDirectory, MovesIntoPlaceWhenThereIsNoOldVersion) {
  testing::TempDir dir;
  dir.write("staged/weights", "first");
  replace_directory(dir.file("staged"), dir.file("target"));
  EXPECT_EQ(contents(dir.file("target/weights")), "first");
  EXPECT_FALSE(std::filesystem::exists(dir.file("staged")));
}

TEST(WriteFileAtomically, ReplacesTheWholeFile) {
  testing::TempDir dir;
  const auto path = dir.write("state.json", "a much longer old text");
  write_file_atomically(path, "new");
  EXPECT_EQ(contents(path), "new");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

}  // namespace
}  // namespace qtrain::trainer
