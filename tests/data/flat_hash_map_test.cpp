// FlatHashMap against std::unordered_map on random keys, repeats and misses included.
#include "data/flat_hash_map.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <string_view>
#include <unordered_map>

namespace qtrain::data {
namespace {

TEST(FlatHashMap, FindsWhatAnUnorderedMapFinds) {
  std::mt19937 random(7);
  FlatHashMap<std::string, int32_t, std::hash<std::string_view>> strings;
  FlatHashMap<uint64_t, int32_t> numbers;
  std::unordered_map<std::string, int32_t> expected_strings;
  std::unordered_map<uint64_t, int32_t> expected_numbers;
  // Small key spaces so that keys repeat (a repeat overwrites the value).
  auto random_string = [&] { return std::to_string(random() % 20000) + std::string(random() % 24, 'x'); };
  auto random_number = [&] { return (uint64_t{random() % 300} << 32) | (random() % 300); };
  for (int32_t value = 0; value < 50000; ++value) {
    const std::string text = random_string();
    strings.insert_or_assign(text, value);
    expected_strings[text] = value;
    const uint64_t number = random_number();
    numbers.insert_or_assign(number, value);
    expected_numbers[number] = value;
  }
  ASSERT_EQ(strings.size(), expected_strings.size());
  ASSERT_EQ(numbers.size(), expected_numbers.size());
  for (int i = 0; i < 50000; ++i) {
    const std::string text = random_string();
    const int32_t* found = strings.find(std::string_view(text));
    const auto expected = expected_strings.find(text);
    ASSERT_EQ(found != nullptr, expected != expected_strings.end()) << text;
    if (found != nullptr) EXPECT_EQ(*found, expected->second) << text;
    const uint64_t number = random_number();
    const int32_t* found_number = numbers.find(number);
    const auto expected_number = expected_numbers.find(number);
    ASSERT_EQ(found_number != nullptr, expected_number != expected_numbers.end()) << number;
    if (found_number != nullptr) EXPECT_EQ(*found_number, expected_number->second) << number;
  }
}

TEST(FlatHashMap, EntriesKeepTheOrderOfFirstInsertion) {
  FlatHashMap<std::string, int32_t, std::hash<std::string_view>> map;
  map.insert_or_assign("b", 1);
  map.insert_or_assign("a", 2);
  map.insert_or_assign("b", 3);
  ASSERT_EQ(map.entries().size(), 2u);
  EXPECT_EQ(map.entries()[0], std::make_pair(std::string("b"), 3));
  EXPECT_EQ(map.entries()[1], std::make_pair(std::string("a"), 2));
  EXPECT_EQ(map.find(std::string_view("c")), nullptr);
}

}  // namespace
}  // namespace qtrain::data
