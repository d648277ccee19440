// Recipe YAML in and out, driven by the key table of trainer/recipe/recipe_schema.cpp: every value
// is read, checked, resolved and printed by the row that names its key.
#include "trainer/recipe/recipe.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <type_traits>

#include "kernels/error.h"
#include "trainer/formats/hf_hub_cache.h"
#include "trainer/recipe/recipe_schema.h"

namespace qtrain::trainer {

const std::vector<BaseQuantizationName>& base_quantization_names() {
  static const std::vector<BaseQuantizationName> names = {
      // kind, name, qlora.quant_type, qat.base
      {BaseQuantization::kNone, "none", false, true},
      {BaseQuantization::kNf4, "nf4", true, true},
      {BaseQuantization::kFp4, "fp4", true, true},
      {BaseQuantization::kInt8, "int8", true, true},
      {BaseQuantization::kFp8, "fp8", true, false},
  };
  return names;
}

const char* base_quantization_name(BaseQuantization kind) {
  for (const auto& row : base_quantization_names()) {
    if (row.kind == kind) return row.name;
  }
  throw Error(ErrorCode::kInternal, "base quantization kind " + std::to_string(static_cast<int>(kind)) + " has no name");
}
namespace {

namespace fs = std::filesystem;

// Where values come from: a recipe file (errors name file:line), a --set argument or a
// default (errors name it), and the directory its relative paths start from.
struct Source {
  std::string name;
  bool has_lines = false;
  fs::path base_dir;
};

// Where each key was last set, for errors about keys that disagree.
using KeyLocations = std::map<std::string, std::string>;

std::string location(const Source& source, int zero_based_line) {
  if (source.has_lines && zero_based_line >= 0) {
    return source.name + ":" + std::to_string(zero_based_line + 1);
  }
  return source.name;
}

[[noreturn]] void fail(const std::string& where, const std::string& message) {
  throw Error(ErrorCode::kRecipe, where + ": " + message);
}

// ---- "did you mean" -------------------------------------------------------------------

// Optimal string alignment distance: edits, with a swap of neighbours counted as one.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t substitution = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + substitution});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The candidates nearest to `word`, if near enough to be a typo of it.
std::vector<std::string> nearest(const std::string& word,
                                 const std::vector<std::string>& candidates) {
  const std::size_t allowed = std::max<std::size_t>(1, std::min<std::size_t>(3, word.size() / 3));
  std::size_t best = allowed + 1;
  std::vector<std::string> found;
  for (const auto& candidate : candidates) {
    const std::size_t distance = edit_distance(word, candidate);
    if (distance > allowed) continue;
    if (distance < best) {
      best = distance;
      found.clear();
    }
    if (distance == best) found.push_back(candidate);
  }
  return found;
}

std::string did_you_mean(const std::vector<std::string>& suggestions) {
  if (suggestions.empty()) return "";
  std::string text = " (did you mean ";
  const std::size_t shown = std::min<std::size_t>(suggestions.size(), 3);
  for (std::size_t i = 0; i < shown; ++i) {
    if (i > 0) text += i + 1 == shown ? " or " : ", ";
    text += "'" + suggestions[i] + "'";
  }
  return text + "?)";
}

std::string last_component(const std::string& dotted) {
  const auto dot = dotted.rfind('.');
  return dot == std::string::npos ? dotted : dotted.substr(dot + 1);
}

bool is_section(const std::string& dotted) {
  if (dotted.empty()) return true;
  for (const auto& entry : recipe_keys()) {
    if (entry.name.compare(0, dotted.size() + 1, dotted + ".") == 0) return true;
  }
  return false;
}

// Keys and sections a mistyped key may have meant: the key another tool calls by that name
// (`learning_rate`), a typo of one (`lora.rnak`), or the same name in another section
// (`train.lr`).
std::vector<std::string> suggest_keys(const std::string& unknown) {
  const std::string name = last_component(unknown);
  for (const auto& [familiar, ours] : familiar_key_names()) {
    if (familiar == name) return {ours};
  }
  // Keys and sections as deep as the unknown key: `lroa` may be `lora`, `lora.rnak` `lora.rank`.
  const auto depth = [](const std::string& dotted) {
    return std::count(dotted.begin(), dotted.end(), '.');
  };
  std::vector<std::string> names;
  for (const auto& entry : recipe_keys()) {
    for (auto end = entry.name.find('.');; end = entry.name.find('.', end + 1)) {
      const std::string name = entry.name.substr(0, end);
      if (depth(name) == depth(unknown) &&
          std::find(names.begin(), names.end(), name) == names.end()) {
        names.push_back(name);
      }
      if (end == std::string::npos) break;
    }
  }
  if (auto typo_of = nearest(unknown, names); !typo_of.empty()) return typo_of;
  std::vector<std::string> same_name;
  for (const auto& entry : recipe_keys()) {
    if (last_component(entry.name) == name) same_name.push_back(entry.name);
  }
  return same_name;
}

const RecipeKey* find_key(const std::string& dotted) {
  for (const auto& entry : recipe_keys()) {
    if (entry.name == dotted) return &entry;
  }
  return nullptr;
}

// ---- values -----------------------------------------------------------------------------

// A value as an error message shows it: 'fast', a list, a map, nothing.
std::string describe(const YAML::Node& node) {
  constexpr std::size_t kShown = 60;
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      if (node.Scalar().size() > kShown) return "'" + node.Scalar().substr(0, kShown) + "...'";
      return "'" + node.Scalar() + "'";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    default:
      return "nothing";
  }
}

int line_of(const YAML::Node& node, int fallback) {
  if (!node.IsDefined() || node.IsNull()) return fallback;
  const int line = node.Mark().line;
  return line >= 0 ? line : fallback;
}

// The shortest text that reads back as the same double, exponents as people write them:
// 0.05, 2e-4, 1e-8, 32.
std::string number_text(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  std::string text(buffer, result.ptr);
  const auto exponent = text.find("e");
  if (exponent != std::string::npos) {
    std::size_t digits = exponent + 1;
    if (digits < text.size() && (text[digits] == '-' || text[digits] == '+')) {
      if (text[digits] == '+')
        text.erase(digits, 1);
      else
        ++digits;
    }
    while (digits + 1 < text.size() && text[digits] == '0') text.erase(digits, 1);
  }
  return text;
}

std::optional<int64_t> parse_integer(std::string text) {
  if (!text.empty() && text[0] == '+') text.erase(0, 1);
  int64_t value = 0;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || result.ec != std::errc() || result.ptr != text.data() + text.size()) {
    return std::nullopt;
  }
  return value;
}

std::optional<double> parse_number(std::string text) {
  if (!text.empty() && text[0] == '+') text.erase(0, 1);
  double value = 0;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || result.ec != std::errc() || result.ptr != text.data() + text.size() ||
      !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string text;
  for (std::size_t i = 0; i < items.size(); ++i) text += (i ? separator : "") + items[i];
  return text;
}

std::string range_text(const RecipeKey& spec) {
  const bool has_min = std::isfinite(spec.min);
  const bool has_max = std::isfinite(spec.max);
  if (has_min && has_max) {
    return std::string("in ") + (spec.min_open ? "(" : "[") + number_text(spec.min) + ", " +
           number_text(spec.max) + (spec.max_open ? ")" : "]");
  }
  if (has_min) return (spec.min_open ? "> " : ">= ") + number_text(spec.min);
  return (spec.max_open ? "< " : "<= ") + number_text(spec.max);
}

void check_range(const RecipeKey& spec, double value, const std::string& shown,
                 const std::string& where) {
  const bool low = spec.min_open ? value <= spec.min : value < spec.min;
  const bool high = spec.max_open ? value >= spec.max : value > spec.max;
  if (low || high)
    fail(where, "'" + spec.name + "' must be " + range_text(spec) + ", got " + shown);
}

void check_choice(const RecipeKey& spec, const std::string& value, const std::string& where,
                  const std::string& what = "") {
  if (spec.choices.empty()) return;
  if (std::find(spec.choices.begin(), spec.choices.end(), value) != spec.choices.end()) return;
  fail(where, "'" + spec.name + "'" + what + " must be one of " + join(spec.choices, ", ") +
                  ", got '" + value + "'" +
                  (parse_integer(value) ? "" : did_you_mean(nearest(value, spec.choices))));
}

fs::path current_directory() {
  try {
    return fs::current_path();
  } catch (const fs::filesystem_error& error) {
    throw Error(ErrorCode::kFileSystem, std::string("cannot read the current directory: ") + error.what());
  }
}

// A path as written, made absolute against `base_dir` and lexically normal.
std::string resolve_path(const std::string& written, const fs::path& base_dir) {
  if (written.empty()) return written;
  fs::path path = written;
  if (written == "~" || written.rfind("~/", 0) == 0) {
    if (const char* home = std::getenv("HOME"))
      path = fs::path(home) / written.substr(std::min<std::size_t>(2, written.size()));
  }
  if (path.is_relative()) path = base_dir / path;
  std::string normal = path.lexically_normal().string();
  while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  return normal;
}

// A path key's value as resolve_path makes it. A model's that names no existing path but a
// repository in the Hugging Face cache is that snapshot; one in neither stays as written, a
// repository id that trainer::resolve_model_path refuses where the model is loaded (naming the
// cache and the `hf download` command), so that a recipe still loads and prints without it.
std::string resolve_written_path(const RecipeKey& spec, const std::string& written, const fs::path& base_dir) {
  const std::string path = resolve_path(written, base_dir);
  std::error_code error;
  if (!spec.names_model || written.empty() || fs::exists(path, error)) return path;
  const auto at = written.find('@');
  if (!is_hf_repo_id(written.substr(0, at))) return path;
  const auto snapshot =
      find_cached_snapshot(written.substr(0, at), at == std::string::npos ? "main" : written.substr(at + 1));
  return snapshot ? *snapshot : written;
}

// An example of a key's list for messages: its default when short, else its first entries.
std::string list_example(const RecipeKey& spec) {
  if (spec.default_yaml.size() <= 24) return spec.default_yaml;
  const YAML::Node defaults = YAML::Load(spec.default_yaml);
  return "[" + defaults[0].Scalar() + ", " + defaults[1].Scalar() + "]";
}

std::vector<YAML::Node> list_entries(const RecipeKey& spec, const YAML::Node& value,
                                     const std::string& expected, const std::string& where) {
  if (value.IsNull()) return {};
  if (!value.IsSequence()) {
    fail(where, "'" + spec.name + "' expects " + expected + ", e.g. " + list_example(spec) +
                    ", got " + describe(value));
  }
  return std::vector<YAML::Node>(value.begin(), value.end());
}

// An enum key's value by its name, which check_choice has found among the key's choices (every
// choice is a name of the table behind the key).
template <typename Enum>
Enum enum_value(const std::string& name) {
  for (const auto& [value, value_name] : enum_names(Enum{})) {
    if (value_name == name) return value;
  }
  throw Error(ErrorCode::kInternal, "'" + name + "' is a key's choice but names no value of its table (internal error)");
}

template <typename Enum>
const std::string& enum_name(Enum value) {
  for (const auto& [named, name] : enum_names(value)) {
    if (named == value) return name;
  }
  throw Error(ErrorCode::kInternal, "enum value " + std::to_string(static_cast<int>(value)) + " has no name (internal error)");
}

[[noreturn]] void fail_expecting(const RecipeKey& spec, const std::string& expected,
                                 const YAML::Node& value, const std::string& where) {
  fail(where, "'" + spec.name + "' expects " + expected + ", got " + describe(value));
}

// Reads `value` into the field of `spec`, checked against the row.
void assign(const RecipeKey& spec, const YAML::Node& value, const Source& source, int key_line,
            Recipe& recipe) {
  const std::string where = location(source, line_of(value, key_line));
  // The scalar's text, where the key takes one.
  const auto scalar = [&](const std::string& expected) -> std::string {
    if (!value.IsScalar()) fail_expecting(spec, expected, value, where);
    return value.Scalar();
  };
  std::visit(
      [&](auto* field) {
        using Field = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<Field, int64_t>) {
          const auto parsed = parse_integer(scalar("an integer"));
          if (!parsed) fail_expecting(spec, "an integer", value, where);
          check_choice(spec, std::to_string(*parsed), where);
          check_range(spec, static_cast<double>(*parsed), std::to_string(*parsed), where);
          *field = *parsed;
        } else if constexpr (std::is_same_v<Field, double>) {
          const auto parsed = parse_number(scalar("a number"));
          if (!parsed) fail_expecting(spec, "a number", value, where);
          check_range(spec, *parsed, value.Scalar(), where);
          *field = *parsed;
        } else if constexpr (std::is_same_v<Field, bool>) {
          const std::string text = scalar("true or false");
          if (text == "true" || text == "True" || text == "TRUE") {
            *field = true;
          } else if (text == "false" || text == "False" || text == "FALSE") {
            *field = false;
          } else {
            fail_expecting(spec, "true or false", value, where);
          }
        } else if constexpr (std::is_enum_v<Field>) {
          const std::string text = scalar("one of " + join(spec.choices, ", "));
          check_choice(spec, text, where);
          *field = enum_value<Field>(text);
        } else if constexpr (std::is_same_v<Field, std::string>) {
          if (value.IsNull() && spec.choices.empty()) {
            *field = "";
            return;
          }
          const std::string text =
              scalar(spec.choices.empty() ? "text" : "one of " + join(spec.choices, ", "));
          check_choice(spec, text, where);
          *field = spec.is_path ? resolve_written_path(spec, text, source.base_dir) : text;
        } else if constexpr (std::is_same_v<Field, std::vector<std::string>>) {
          if (spec.is_path && (value.IsNull() || value.IsScalar())) {  // `data.train: file.jsonl`: a list of one
            *field = {};
            if (value.IsScalar() && !value.Scalar().empty()) field->push_back(resolve_path(value.Scalar(), source.base_dir));
            return;
          }
          std::vector<std::string> names;
          for (const auto& entry : list_entries(spec, value, spec.is_path ? "a path or a list of paths" : "a list of names", where)) {
            const std::string entry_where = location(source, line_of(entry, key_line));
            if (!entry.IsScalar() || entry.Scalar().empty()) {
              fail(entry_where, "'" + spec.name + "' entries are names, got " + describe(entry));
            }
            check_choice(spec, entry.Scalar(), entry_where, " entries");
            names.push_back(spec.is_path ? resolve_path(entry.Scalar(), source.base_dir) : entry.Scalar());
          }
          *field = std::move(names);
        } else {
          static_assert(std::is_same_v<Field, std::vector<double>>);
          std::vector<double> numbers;
          for (const auto& entry : list_entries(spec, value, "a list of numbers", where)) {
            const std::string entry_where = location(source, line_of(entry, key_line));
            const auto parsed = entry.IsScalar() ? parse_number(entry.Scalar()) : std::nullopt;
            if (!parsed)
              fail(entry_where, "'" + spec.name + "' entries are numbers, got " + describe(entry));
            check_range(spec, *parsed, entry.Scalar(), entry_where);
            numbers.push_back(*parsed);
          }
          if (spec.list_length != 0 && numbers.size() != spec.list_length) {
            fail(where, "'" + spec.name + "' expects " + std::to_string(spec.list_length) +
                            " numbers, e.g. " + spec.default_yaml + ", got " +
                            std::to_string(numbers.size()));
          }
          *field = std::move(numbers);
        }
      },
      spec.field(recipe));
}

// The names directly under a section, for messages: "model, quant, qlora, ...".
std::string section_contents(const std::string& section) {
  std::vector<std::string> names;
  const std::string prefix = section.empty() ? "" : section + ".";
  for (const auto& entry : recipe_keys()) {
    if (entry.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = entry.name.substr(prefix.size());
    const std::string name = rest.substr(0, rest.find('.'));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return join(names, ", ");
}

// Applies `value` at the dotted key `dotted`: a key's value, or a section's map of keys.
// `seen` (for files) catches a key written twice.
void apply_node(const std::string& dotted, const YAML::Node& value, const Source& source,
                int key_line, Recipe& recipe, KeyLocations& locations,
                std::map<std::string, int>* seen) {
  if (const RecipeKey* spec = find_key(dotted)) {
    if (seen) {
      const auto [previous, inserted] = seen->emplace(dotted, key_line);
      if (!inserted) {
        fail(location(source, key_line), "'" + dotted + "' is set twice (first on line " +
                                             std::to_string(previous->second + 1) + ")");
      }
    }
    assign(*spec, value, source, key_line, recipe);
    locations[dotted] = location(source, key_line);
    return;
  }
  if (!is_section(dotted)) {
    fail(location(source, key_line),
         "unknown key '" + dotted + "'" + did_you_mean(suggest_keys(dotted)));
  }
  if (value.IsNull()) return;  // `lora:` with nothing under it
  if (!value.IsMap()) {
    const std::string what = dotted.empty() ? "a recipe" : "'" + dotted + "'";
    fail(location(source, line_of(value, key_line)),
         what + " is a map of keys (" + section_contents(dotted) + "), got " + describe(value));
  }
  for (const auto& item : value) {
    const int line = line_of(item.first, key_line);
    if (!item.first.IsScalar() || item.first.Scalar().empty()) {
      fail(location(source, line), "keys are names, got " + describe(item.first));
    }
    const std::string name =
        dotted.empty() ? item.first.Scalar() : dotted + "." + item.first.Scalar();
    apply_node(name, item.second, source, line, recipe, locations, seen);
  }
}

// The YAML documents of a text: where each starts and whether it holds anything. yaml-cpp's
// parser stalls on some malformed input, returning the same empty document forever
// (YAML::LoadAll never returns); documents are counted here, and one that starts where the
// previous one started means the text is not YAML.
class DocumentStarts : public YAML::EventHandler {
 public:
  struct Document {
    YAML::Mark start;
    bool empty = true;
  };
  std::vector<Document> documents;

  void OnDocumentStart(const YAML::Mark& mark) override { documents.push_back({mark, true}); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override { documents.back().empty = false; }
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {
    documents.back().empty = false;
  }
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    documents.back().empty = false;
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    documents.back().empty = false;
  }
  void OnMapEnd() override {}
};

// The one YAML document of `text` (a null node when there is none; empty documents after it,
// as a trailing `---` makes, are fine).
YAML::Node parse_yaml(const std::string& text, const Source& source) {
  try {
    std::istringstream stream(text);
    YAML::Parser parser(stream);
    DocumentStarts starts;
    while (parser.HandleNextDocument(starts)) {
      const auto& documents = starts.documents;
      const auto& latest = documents.back();
      if (documents.size() < 2) continue;
      if (latest.start.pos <= documents[documents.size() - 2].start.pos) {
        fail(location(source, latest.start.line), "not valid YAML");
      }
      if (!latest.empty) {
        fail(location(source, latest.start.line),
             "a recipe is one YAML document, this is a second one (after '---')");
      }
    }
    return YAML::Load(text);
  } catch (const YAML::Exception& error) {
    fail(location(source, error.mark.line), error.msg);
  }
}

void apply_override_to(Recipe& recipe, const std::string& key_equals_value,
                       KeyLocations& locations) {
  const Source source{"--set " + key_equals_value, false, current_directory()};
  const auto equals = key_equals_value.find('=');
  std::string key = equals == std::string::npos ? "" : key_equals_value.substr(0, equals);
  key.erase(0, key.find_first_not_of(" \t"));
  key.erase(key.find_last_not_of(" \t") + 1);
  if (key.empty()) fail(source.name, "expected key=value, e.g. --set optim.lr=1e-4");
  const YAML::Node value = parse_yaml(key_equals_value.substr(equals + 1), source);
  apply_node(key, value, source, -1, recipe, locations, nullptr);
}

// ---- printing ---------------------------------------------------------------------------

bool is_plain_scalar(const std::string& text) {
  if (text.empty() || parse_number(text) || parse_integer(text)) return false;
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  for (const char* special : {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~",
                              ".inf", "-.inf", "+.inf", ".nan"}) {
    if (lower == special) return false;
  }
  const auto plain_character = [](unsigned char c) {
    return std::isalnum(c) || c == '_' || c == '.' || c == '/' || c == '-';
  };
  if (!std::all_of(text.begin(), text.end(), plain_character)) return false;
  return text[0] != '-' && text[0] != '.';
}

std::string yaml_scalar(const std::string& text) {
  if (is_plain_scalar(text)) return text;
  std::string out = "\"";
  for (const unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// A float key's value as a recipe shows it: whole numbers keep a ".0" (32.0, not 32).
std::string float_yaml(double value) {
  std::string text = number_text(value);
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

std::string value_yaml(RecipeField field) {
  return std::visit(
      [](auto* value) -> std::string {
        using Field = std::remove_pointer_t<decltype(value)>;
        if constexpr (std::is_same_v<Field, int64_t>) {
          return std::to_string(*value);
        } else if constexpr (std::is_same_v<Field, double>) {
          return float_yaml(*value);
        } else if constexpr (std::is_same_v<Field, bool>) {
          return *value ? "true" : "false";
        } else if constexpr (std::is_enum_v<Field>) {
          return yaml_scalar(enum_name(*value));
        } else if constexpr (std::is_same_v<Field, std::string>) {
          return yaml_scalar(*value);
        } else {
          std::vector<std::string> entries;
          for (const auto& entry : *value) {
            if constexpr (std::is_same_v<Field, std::vector<double>>) {
              entries.push_back(float_yaml(entry));
            } else {
              entries.push_back(yaml_scalar(entry));
            }
          }
          return "[" + join(entries, ", ") + "]";
        }
      },
      field);
}

std::vector<std::string> split_dotted(const std::string& dotted) {
  std::vector<std::string> parts;
  std::stringstream stream(dotted);
  for (std::string part; std::getline(stream, part, '.');) parts.push_back(part);
  return parts;
}

}  // namespace

Recipe default_recipe() {
  // Read from the table once; only the paths depend on the current directory.
  static const Recipe defaults = [] {
    Recipe recipe;
    for (const auto& spec : recipe_keys()) {
      const Source source{"default of '" + spec.name + "'", false, fs::path()};
      assign(spec, YAML::Load(spec.default_yaml), source, -1, recipe);
    }
    return recipe;
  }();
  Recipe recipe = defaults;
  const fs::path here = current_directory();
  for (const auto& spec : recipe_keys()) {
    if (!spec.is_path) continue;
    const RecipeField field = spec.field(recipe);
    if (auto* paths = std::get_if<std::vector<std::string>*>(&field)) {
      for (auto& path : **paths) path = resolve_path(path, here);
    } else {
      std::string& path = *std::get<std::string*>(field);
      path = resolve_path(path, here);
    }
  }
  return recipe;
}

Recipe apply_override(Recipe recipe, const std::string& key_equals_value) {
  KeyLocations locations;
  apply_override_to(recipe, key_equals_value, locations);
  return recipe;
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& set_overrides) {
  Recipe recipe = default_recipe();
  KeyLocations locations;
  if (!path.empty()) {
    std::error_code error;
    if (!fs::exists(path, error)) throw Error(ErrorCode::kRecipe, "recipe '" + path + "' not found");
    if (fs::is_directory(path, error))
      throw Error(ErrorCode::kRecipe, "recipe '" + path + "' is a directory, not a YAML file");
    std::ifstream file(path, std::ios::binary);
    std::stringstream text;
    text << file.rdbuf();
    if (!file) throw Error(ErrorCode::kFileSystem, "cannot read recipe '" + path + "'");
    const Source source{path, true, fs::absolute(path).parent_path()};
    const YAML::Node root = parse_yaml(text.str(), source);
    std::map<std::string, int> seen;
    apply_node("", root, source, 0, recipe, locations, &seen);
  }
  for (const auto& assignment : set_overrides) apply_override_to(recipe, assignment, locations);
  if (const auto conflict = find_conflict(recipe)) {
    const auto where = locations.find(conflict->key);
    throw Error(ErrorCode::kRecipe, (where == locations.end() ? "" : where->second + ": ") + conflict->message);
  }
  return recipe;
}

std::string recipe_to_yaml(const Recipe& recipe) {
  // Docs line up in one column where the values are short enough.
  constexpr std::size_t kDocColumn = 44;
  Recipe copy = recipe;
  std::string out = "# qtrain recipe: every key, resolved (`qtrain --print-recipe`).\n";
  std::vector<std::string> open_sections;
  for (const auto& spec : recipe_keys()) {
    const std::vector<std::string> parts = split_dotted(spec.name);
    std::size_t shared = 0;
    while (shared < open_sections.size() && shared + 1 < parts.size() &&
           open_sections[shared] == parts[shared]) {
      ++shared;
    }
    open_sections.resize(shared);
    if (shared == 0) out += "\n";
    for (std::size_t depth = shared; depth + 1 < parts.size(); ++depth) {
      out += std::string(2 * depth, ' ') + parts[depth] + ":\n";
      open_sections.push_back(parts[depth]);
    }
    std::string line = std::string(2 * (parts.size() - 1), ' ') + parts.back() + ": " +
                       value_yaml(spec.field(copy));
    line += std::string(line.size() < kDocColumn ? kDocColumn - line.size() : 2, ' ');
    line += "# " + spec.doc;
    if (!spec.choices.empty()) line += " [" + join(spec.choices, " | ") + "]";
    out += line + "\n";
  }
  return out;
}

std::vector<RecipeDifference> recipe_differences(const Recipe& before, const Recipe& after) {
  Recipe left = before;
  Recipe right = after;
  std::vector<RecipeDifference> differences;
  for (const auto& spec : recipe_keys()) {
    const std::string was = value_yaml(spec.field(left));
    const std::string now = value_yaml(spec.field(right));
    if (was != now) differences.push_back({spec.name + ": " + was + " -> " + now, spec.model_shaping});
  }
  return differences;
}

bool operator==(const Recipe& a, const Recipe& b) {
  Recipe left = a;
  Recipe right = b;
  for (const auto& spec : recipe_keys()) {
    const bool same = std::visit(
        [&](auto* left_value) {
          using Field = std::remove_pointer_t<decltype(left_value)>;
          return *left_value == *std::get<Field*>(spec.field(right));
        },
        spec.field(left));
    if (!same) return false;
  }
  return true;
}

const std::vector<QuantMethod>& quant_methods() {
  static const std::vector<QuantMethod> methods = {QuantMethod::kQlora, QuantMethod::kQat, QuantMethod::kNone};
  return methods;
}

const char* quant_method_name(QuantMethod method) {
  switch (method) {
    case QuantMethod::kQlora:
      return "qlora";
    case QuantMethod::kQat:
      return "qat";
    case QuantMethod::kNone:
      return "none";
  }
  throw Error(ErrorCode::kInternal, "quant method " + std::to_string(static_cast<int>(method)) + " has no name");
}

bool trains_full_weights(const Recipe& recipe) {
  return recipe.lora.rank == 0 && recipe.lora.init_from.empty();
}

}  // namespace qtrain::trainer
