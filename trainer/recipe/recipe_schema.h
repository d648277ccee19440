#pragma once
// The recipe keys as data (internal to trainer/recipe*.cpp and its test). One row per key:
// its dotted name, its default written as in a recipe, a line of doc, the Recipe field it
// reads and writes, and the values it allows. Parsing, --set, checking, printing and
// "did you mean" all walk this one table.
#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "trainer/recipe/recipe.h"

namespace qtrain::trainer {

// The field behind a key; the alternative held is the key's type. An enum key is written and
// shown by its values' names (enum_names).
using RecipeField = std::variant<int64_t*, double*, bool*, std::string*, std::vector<std::string>*,
                                 std::vector<double>*, QuantMethod*, BaseQuantization*, qat::QuantFormat*>;

// The name of every value of an enum key's type, from the table that names it (quant_methods(),
// base_quantizations(), qat::quant_formats()), in its order; enum_names(Enum{}) picks by type.
template <typename Enum>
using EnumNames = std::vector<std::pair<Enum, std::string>>;
const EnumNames<QuantMethod>& enum_names(QuantMethod);
const EnumNames<BaseQuantization>& enum_names(BaseQuantization);
const EnumNames<qat::QuantFormat>& enum_names(qat::QuantFormat);

struct RecipeKey {
  std::string name;          // dotted: "lora.rank"
  std::string default_yaml;  // the default as a recipe writes it: "16", "[0.9, 0.999]"
  std::string doc;
  RecipeField (*field)(Recipe&) = nullptr;

  // What the value may be. Numbers (and each entry of a number list) lie between min and
  // max; names and integers (as decimal text), and each entry of a name list, are among
  // `choices` when it is not empty.
  std::vector<std::string> choices;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;  // min itself is not allowed
  bool max_open = false;
  std::size_t list_length = 0;  // number lists: exactly this many entries (0: any)
  bool is_path = false;         // resolved against the recipe's directory at load time
  // A path, or a Hugging Face repository id ORG/NAME[@REVISION] found in the Hugging Face cache
  // (trainer/formats/hf_hub_cache.h) where no such path exists.
  bool names_model = false;
  // The value decides the model a checkpoint holds (its base, quantization, adapter shapes):
  // resuming a checkpoint under another value is an error, not a recipe change.
  bool model_shaping = false;

  RecipeKey&& one_of(std::vector<std::string> allowed) && {
    choices = std::move(allowed);
    return std::move(*this);
  }
  RecipeKey&& at_least(double bound) && {
    min = bound;
    return std::move(*this);
  }
  RecipeKey&& above(double bound) && {
    min = bound;
    min_open = true;
    return std::move(*this);
  }
  RecipeKey&& at_most(double bound) && {
    max = bound;
    return std::move(*this);
  }
  RecipeKey&& below(double bound) && {
    max = bound;
    max_open = true;
    return std::move(*this);
  }
  RecipeKey&& of_length(std::size_t length) && {
    list_length = length;
    return std::move(*this);
  }
  RecipeKey&& path() && {
    is_path = true;
    return std::move(*this);
  }
  RecipeKey&& model_path() && {
    is_path = true;
    names_model = true;
    return std::move(*this);
  }
  RecipeKey&& shapes_model() && {
    model_shaping = true;
    return std::move(*this);
  }
};

// Every key, section by section, in the order --print-recipe shows them.
const std::vector<RecipeKey>& recipe_keys();

// A rule between keys that a recipe breaks: the key to point the user at, and why.
struct RecipeConflict {
  std::string key;
  std::string message;
};
std::optional<RecipeConflict> find_conflict(const Recipe& recipe);

// Names other tools (axolotl, torchtune, peft, transformers) give our keys, by their last
// component, so that "did you mean" can point a user who brings their habits.
const std::vector<std::pair<std::string, std::string>>& familiar_key_names();

}  // namespace qtrain::trainer
