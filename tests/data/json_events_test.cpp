// read_json_events against nlohmann::json::sax_parse, its reference: the same events for valid
// JSON, the same verdict on broken JSON (real tokenizer files, hand-made edge cases, and random
// corruptions of them).
#include "data/json_events.h"

#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support.h"

namespace qtrain::data {
namespace {

using Json = nlohmann::json;

// Every event as a line of text; parse_error ends the record.
class EventRecorder final : public nlohmann::json_sax<Json> {
 public:
  std::vector<std::string> events;
  bool null() override { return add("null"); }
  bool boolean(bool value) override { return add(value ? "true" : "false"); }
  bool number_integer(number_integer_t value) override { return add("integer " + std::to_string(value)); }
  bool number_unsigned(number_unsigned_t value) override { return add("unsigned " + std::to_string(value)); }
  bool number_float(number_float_t value, const string_t&) override {
    std::ostringstream text;
    text.precision(17);
    text << "float " << value;
    return add(text.str());
  }
  bool string(string_t& value) override { return add("string " + value); }
  bool binary(binary_t&) override { return add("binary"); }
  bool start_object(std::size_t) override { return add("{"); }
  bool key(string_t& value) override { return add("key " + value); }
  bool end_object() override { return add("}"); }
  bool start_array(std::size_t) override { return add("["); }
  bool end_array() override { return add("]"); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  bool add(std::string event) {
    events.push_back(std::move(event));
    return true;
  }
};

void expect_same_as_nlohmann(const std::string& text) {
  EventRecorder expected, actual;
  const bool expected_valid = Json::sax_parse(text, &expected);
  const bool actual_valid = read_json_events(text, actual);
  ASSERT_EQ(actual_valid, expected_valid) << "'" << text.substr(0, 200) << "'";
  if (expected_valid) ASSERT_EQ(actual.events, expected.events) << "'" << text.substr(0, 200) << "'";
}

std::string read_file(const std::string& path) {
  std::ifstream input(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(input), {});
}

const std::vector<std::string> kEdgeCases = {
    "", " ", "{}", "[]", "[1,]", "{,}", "{\"a\":1,}", "[1 2]", "{\"a\" 1}", "{1: 2}", "nul", "truex", "[true, false, null]",
    "0", "-0", "01", "-", "1.", ".5", "1e", "1e+", "1E-7", "-12.5e3", "123456789012345678901234567890",
    "18446744073709551615", "18446744073709551616", "-9223372036854775808", "-9223372036854775809", "1e999", "-1e999",
    R"("plain")", R"("esc \" \\ \/ \b \f \n \r \t")", R"("\u0041\u00e9\u20ac")", R"("\ud83d\ude00")", R"("\ud83d")",
    R"("\ude00")", R"("\ud83dx")", R"("\u12")", R"("\x")", "\"raw\ttab\"", "\"caf\xC3\xA9 \xE2\x96\x81\"",
    "\"bad \xC3\"", "\"overlong \xC0\xAF\"", "\"surrogate \xED\xA0\x80\"", "\"unterminated", "\xEF\xBB\xBF{\"bom\": 1}",
    "{\"a\": {\"b\": [1, {\"c\": \"d\"}]}}  ", "[1] [2]", "{\"a\":1}x", "\t\r\n[\t1\r\n]\n",
    "999999999999999999", "1234567890123456789", "[0, 7, 128255, 262143]", "\"mixed a\xC3\xA9" "b\xE2\x96\x81" "c\\n\"",
    "\"invalid mid-run ab\xFF" "cd\"", "\"truncated \xE2\x96\"",
};

TEST(JsonEvents, TokenizerFilesGiveTheEventsOfNlohmann) {
  expect_same_as_nlohmann(read_file(qtrain::testing::fixture("tiny-llama/tokenizer.json")));
  expect_same_as_nlohmann(read_file(qtrain::testing::source_dir() + "/tests/data/gemma/tokenizer.json"));
  expect_same_as_nlohmann(read_file(qtrain::testing::source_dir() + "/tests/data/pipeline/reference.json"));
}

TEST(JsonEvents, EdgeCasesGiveTheVerdictAndEventsOfNlohmann) {
  for (const std::string& text : kEdgeCases) expect_same_as_nlohmann(text);
}

TEST(JsonEvents, CorruptedTextGivesTheVerdictOfNlohmann) {
  std::mt19937 random(11);
  const std::string sample = read_file(qtrain::testing::source_dir() + "/tests/data/pipeline/reference.json").substr(0, 3000) + "]}";
  const std::string alphabet = "{}[]\":,\\ -+.eE0123456789tfnu\xC3\xA9\xFF\x01";
  std::vector<std::string> seeds = kEdgeCases;
  seeds.push_back(sample);
  for (int round = 0; round < 3000; ++round) {
    std::string text = seeds[random() % seeds.size()];
    const int edits = 1 + static_cast<int>(random() % 3);
    for (int edit = 0; edit < edits && !text.empty(); ++edit) {
      const size_t position = random() % text.size();
      switch (random() % 3) {
        case 0: text[position] = alphabet[random() % alphabet.size()]; break;
        case 1: text.erase(position, 1 + random() % 3); break;
        default: text.insert(position, 1, alphabet[random() % alphabet.size()]); break;
      }
    }
    expect_same_as_nlohmann(text);
  }
}

}  // namespace
}  // namespace qtrain::data
