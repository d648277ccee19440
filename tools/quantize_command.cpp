// qtrain quantize: post-training quantization (PTQ) with the quantizers of a QAT recipe, so that
// QAT's gain over PTQ is measured with identical numerics. The model's qat.target_modules get the
// recipe's qat.weights (rounded to nearest from the weights as they are) and qat.activations;
// static activation ranges (observer minmax / moving_average) are calibrated on
// qat.calibration_batches batches of data.train first. The result is written in the recipe's
// export.formats (gguf, safetensors-int, merged) into --out; with data.eval set, the eval loss
// before and after quantization is printed. The model is a Hugging Face directory (--model or the
// recipe's model.path) or what a run trained (--run: a fine-tune without fake quantization, then
// PTQ, is the fair baseline of a QAT run).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "data/batching.h"
#include "kernels/error.h"
#include "tools/commands.h"
#include "trainer/formats/hf_hub_cache.h"
#include "trainer/model/batch_inputs.h"
#include "trainer/base/device.h"
#include "trainer/model/evaluate.h"
#include "trainer/base/file_system.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/model_exports.h"
#include "trainer/recipe/recipe.h"
#include "trainer/recipe/recipe_data.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/trained_run.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

bool needs_calibration(const qat::QatLinearOptions& options) {
  const auto is_static = [](const qat::FakeQuantizerOptions& quantizer) {
    return quantizer.observer != qat::ObserverKind::kDynamic;
  };
  return is_static(options.weights) || (options.activations && is_static(*options.activations));
}

// Observers watch `batches` forwards with fake quantization off; then one forward with it on
// and the observers frozen sets learned scales from the ranges observed.
void calibrate(trainer::LlamaForCausalLMImpl& model, data::BatchStream& stream, int64_t batches,
               const torch::Device& device) {
  torch::NoGradGuard no_grad;
  qat::set_fake_quant_enabled(model, false);
  qat::set_observer_enabled(model, true);
  for (int64_t index = 0; index < batches; ++index) model.hidden_states(trainer::model_inputs(stream.next(), device));
  qat::set_observer_enabled(model, false);
  qat::set_fake_quant_enabled(model, true);
  model.hidden_states(trainer::model_inputs(stream.next(), device));
}

}  // namespace

int run_quantize(const Arguments& arguments) {
  std::string recipe_path, model_dir, run_dir, out_dir;
  std::vector<std::string> overrides;
  po::options_description options("quantize options");
  options.add_options()
      ("recipe", po::value(&recipe_path)->required(), "a QAT recipe: its qat section is the scheme, export.formats what is written")
      ("model", po::value(&model_dir)->default_value(""), "Hugging Face model directory or ORG/NAME[@REVISION] in the HF cache (default: the recipe's model.path)")
      ("run", po::value(&run_dir)->default_value(""), "instead of --model: the model a run trained (its final weights)")
      ("set", po::value(&overrides)->composing(), "override a recipe key: --set qat.weights.bits=8 (repeatable)")
      ("out", po::value(&out_dir)->required(), "directory to write the exports into; must not exist unless --force")
      ("force", po::bool_switch(), "replace an existing --out directory");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain quantize --recipe FILE [--model DIR | --run DIR] [--set key=value ...] --out DIR [--force]",
                          options, arguments, values)) {
    return 0;
  }
  model_dir = trainer::resolve_model_path(model_dir, "--model");  // a folder, or ORG/NAME in the HF cache
  if (!model_dir.empty() && !run_dir.empty()) throw Error(ErrorCode::kUsage, "give --model DIR or --run DIR, not both");
  std::optional<trainer::TrainedRun> run;
  if (!run_dir.empty()) {
    // The float model: a 16-bit base that trained on FP8 tensor cores (qlora.fp8_compute) loads as
    // its 16-bit weights, not as the e4m3 rows it multiplied by.
    run = trainer::load_trained_run(run_dir, "", /*quantize_base=*/false);
    if (run->recipe.quant != trainer::QuantMethod::kNone) {
      throw Error(ErrorCode::kUsage, run_dir + ": the run trained with quant: " + trainer::quant_method_name(run->recipe.quant) +
                  "; PTQ starts from a float model (a run with quant: none, or a Hugging Face directory)");
    }
    model_dir = run->recipe.model.path;  // its config and tokenizer
  }
  if (!model_dir.empty()) overrides.push_back("model.path=" + model_dir);
  const auto recipe = trainer::load_recipe(recipe_path, overrides);
  if (recipe.quant != trainer::QuantMethod::kQat) {
    throw Error(ErrorCode::kRecipe, recipe_path + ": quant is '" + trainer::quant_method_name(recipe.quant) + "'; qtrain quantize applies the qat section, so the recipe "
                "needs quant: qat (recipes/qat_llama.yaml, recipes/qat_llama_q4_0.yaml)");
  }
  if (recipe.model.path.empty()) throw Error(ErrorCode::kUsage, "no model: pass --model DIR or set model.path in the recipe");
  const auto qat_options = trainer::qat_linear_options(recipe);
  if (std::filesystem::exists(out_dir) && !values["force"].as<bool>()) {
    throw Error(ErrorCode::kUsage, out_dir + ": already exists; choose another --out or pass --force to replace it");
  }
  // fp32: the weights are rounded from exactly their stored values, and the calibration and eval
  // forwards see no other rounding than the quantizers'.
  const auto device = trainer::resolve_device(recipe.train.device);
  auto loaded = run ? std::move(run->loaded) : trainer::load_base_model(recipe, torch::kFloat32);
  auto& model = *loaded.model;
  model.to(device, torch::kFloat32);
  model.eval();
  const auto base = trainer::BaseDirectory::read(recipe.model.path, loaded.config);
  const auto& tokenizer = base.tokenizer();
  const auto eval = trainer::load_eval_examples(recipe, tokenizer);
  trainer::EvalOptions eval_options;
  eval_options.batch_size = recipe.train.micro_batch_size;
  eval_options.max_batches = recipe.eval.max_batches;
  const auto report = [&](const char* what) {
    if (eval.examples.empty()) return;
    const auto result = trainer::evaluate(model, eval.examples, eval_options);
    std::printf("eval %-9s loss %.6f  perplexity %.4f  (%lld tokens)\n", what, result.loss, result.perplexity,
                static_cast<long long>(result.tokens));
  };
  report("float:");

  const auto quantized = trainer::apply_recipe_qat(model, recipe, &loaded.config);
  // GGUF block types round as llama-quantize does: this is its post-training quantization.
  for (const auto& [name, layer] : qat::find_qat_layers(model)) layer->weight_fake_quant().set_llama_cpp_rounding(true);
  const std::string mix =
      qat_options.weights.spec.is_gguf_block() ? " (" + recipe.qat.weights.gguf_type + "'s mix, llama.cpp's rounding)" : "";
  std::printf("quantize: %zu layers, weights %s%s, inputs %s\n", quantized.size(), qat_options.weights.spec.describe().c_str(),
              mix.c_str(), qat_options.activations ? qat_options.activations->spec.describe().c_str() : "unquantized");
  if (needs_calibration(qat_options)) {
    if (recipe.qat.calibration_batches == 0) {
      throw Error(ErrorCode::kRecipe, "qat.calibration_batches is 0, but a quantizer has a static range (observer minmax or "
                  "moving_average) to calibrate: set it to at least 1, or use observer dynamic");
    }
    trainer::require_training_data(recipe);
    data::BatchStream stream(trainer::load_training_examples(recipe, tokenizer).examples,
                             trainer::batch_stream_options(recipe, tokenizer, 0, 1));
    calibrate(model, stream, recipe.qat.calibration_batches, device);
    std::printf("quantize: calibrated on %lld batches of data.train\n", static_cast<long long>(recipe.qat.calibration_batches));
  }
  qat::set_observer_enabled(model, false);
  qat::set_fake_quant_enabled(model, true);
  report("quantized:");

  const std::string staged = out_dir + ".staging";
  trainer::remove_tree(staged);
  trainer::ModelExportOptions export_options;
  export_options.gguf_file_type = trainer::parse_gguf_type(trainer::gguf_export_type(recipe), "export.gguf_type");
  export_options.compressed_tensors_scheme = &trainer::compressed_tensors_export_scheme(recipe);
  const auto written = trainer::write_model_exports(model, base, recipe.export_.formats, staged, export_options);
  trainer::replace_directory(staged, out_dir);
  for (const auto& path : written) {
    std::printf("export: %s\n", (out_dir + path.substr(staged.size())).c_str());
  }
  return 0;
}

}  // namespace qtrain::tools
