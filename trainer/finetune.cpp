#include "trainer/finetune.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

#include "kernels/error.h"
#include "trainer/formats/hf_config.h"
#include "trainer/formats/hf_hub_cache.h"
#include "trainer/model/model_families.h"
#include "optim/grad_clip.h"
#include "trainer/model/activation_offload.h"
#include "trainer/model/batch_inputs.h"
#include "trainer/model/causal_lm_loss.h"
#include "trainer/base/device.h"
#include "trainer/model/evaluate.h"
#include "trainer/base/file_system.h"
#include "trainer/loss_scaler.h"
#include "trainer/base/memory_stats.h"
#include "trainer/formats/gguf_export.h"
#include "trainer/formats/model_exports.h"
#include "trainer/base/random_state.h"
#include "trainer/recipe/memory_plan.h"
#include "trainer/recipe/recipe_data.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/base/cpu_threads.h"
#include "trainer/stop_signal.h"
#include "trainer/formats/training_checkpoint.h"
#include "trainer/objectives/preference_eval.h"

namespace qtrain::trainer {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

Finetune::Finetune(Recipe recipe, std::string resume)
    : recipe_(std::move(recipe)), launch_(read_launch_environment()), resume_(std::move(resume)) {
  // torchrun restarts a failed run with the same command: it must continue, not start over.
  if (resume_.empty() && launch_.restart_count > 0) resume_ = "auto";
}

void Finetune::setup() {
  if (recipe_.model.path.empty()) throw Error(ErrorCode::kRecipe, "model.path is not set: point it at a Hugging Face model directory or ORG/NAME");
  const std::string named_model = recipe_.model.path;
  recipe_.model.path = resolve_model_path(named_model, "model.path");
  if (recipe_.model.path != named_model) {
    std::printf("model: %s is %s (the Hugging Face cache)\n", named_model.c_str(), recipe_.model.path.c_str());
  }
  require_training_data(recipe_);
  if (recipe_.quant == QuantMethod::kQat) qat_linear_options(recipe_);  // the scheme, checked before minutes of loading
  device_ = resolve_device(recipe_.train.device, launch_.local_rank);
  compute_dtype_ = parse_dtype_name(recipe_.train.dtype, "train.dtype");
  const auto config = read_hf_config(recipe_.model.path);
  if (launch_.distributed()) {
    // Joined first: a rank started wrongly fails here, before minutes of model loading.
    ProcessGroupOptions options;
    options.backend = recipe_.dist.backend;
    options.timeout = std::chrono::seconds(recipe_.dist.timeout_s);
    group_ = std::make_unique<ProcessGroup>(launch_, device_, options);
    std::printf("dist: rank %lld of %lld (%s, %s on %s)\n", static_cast<long long>(launch_.rank),
                static_cast<long long>(launch_.world_size), launch_.launcher.c_str(), group_->backend_name().c_str(),
                device_.str().c_str());
  }
  // train.memory: auto turns on the switches that cost no speed (and, where the run would not fit
  // the GPU's free memory, those that do), before the recipe is written. Ranks plan alike, from the
  // least free memory among them: a rank with other switches would run at another speed.
  double free_bytes = device_free_bytes(device_);
  if (group_) {
    const auto every = group_->every_rank(free_bytes, "the free device memory of each rank");
    free_bytes = *std::min_element(every.begin(), every.end());
  }
  const auto memory_plan = plan_memory(recipe_, config.llama, device_.is_cuda(), free_bytes);
  for (const auto& line : describe_memory_plan(recipe_, memory_plan, device_.is_cuda())) std::printf("%s\n", line.c_str());
  if (compute_dtype_ == torch::kFloat16) {
    const auto* family = config.family;
    if (family->fp16_overflows) {
      throw Error(ErrorCode::kRecipe, "train.dtype: fp16 with " + family->architecture + " (" + recipe_.model.path +
                  "): its activations pass fp16's largest value (65,504) and the run would go to inf / NaN; "
                  "train in bf16, or fp32 on GPUs without bf16");
    }
  }
  if (compute_dtype_ == torch::kFloat16 && device_.is_cpu()) {
    throw Error(ErrorCode::kRecipe, "train.dtype fp16 is not supported on the CPU; use bf16 or fp32");
  }
  scaler_ = LossScaler(/*enabled=*/compute_dtype_ == torch::kFloat16);
  // Every rank seeds alike (as HF Trainer does): the same LoRA initialisation, the same data order.
  torch::manual_seed(static_cast<uint64_t>(recipe_.train.seed));
  run_dir_ = recipe_.train.output_dir;
  if (writes_files()) {
    std::filesystem::create_directories(run_dir_);
    write_file_atomically(run_dir_ + "/recipe.yaml", recipe_to_yaml(recipe_));
  }
  preference_ = preference_options(recipe_);
  setup_model();
  setup_adapters();
  setup_optimizer();
  setup_data();
  // A resumed run continues the metrics of the steps up to its checkpoint.
  const bool resumed = resume_if_asked();
  if (writes_files()) {
    run_log_ = std::make_unique<RunLog>(RunLogOptions{run_dir_, recipe_.log.tensorboard},
                                        resumed ? std::optional<int64_t>(first_step_) : std::nullopt);
    run_log_->text("recipe", "```yaml\n" + recipe_to_yaml(recipe_) + "```\n", first_step_);
  }
  if (group_) {
    // Rank 0's weights everywhere, whatever each rank initialised or read.
    group_->broadcast(trainable_, 0, "the broadcast of the initial weights");
    gradient_buckets_ = std::make_unique<GradientBuckets>(
        trainable_, *group_, recipe_.dist.bucket_mb << 20,
        recipe_.dist.reduce == "ordered" ? GradientReduction::kOrdered : GradientReduction::kAllReduce);
    step_->set_ranks(group_.get(), gradient_buckets_.get());
  }
}

void Finetune::setup_model() {
  loaded_ = load_base_model(recipe_, compute_dtype_, device_);
  if (!recipe_.export_.formats.empty()) {
    export_base_ = BaseDirectory::read(recipe_.model.path, loaded_.config);
    check_model_exports(export_base_, recipe_.export_.formats);  // before the run, not after it
  }
  loaded_.model->to(device_);
  apply_recipe_memory_settings(*loaded_.model, recipe_);
}

void Finetune::setup_adapters() {
  auto& model = *loaded_.model;
  adapter_config_ = lora_adapter_config(recipe_);
  if (!recipe_.lora.init_from.empty()) {
    apply_peft_adapter(model, recipe_.lora.init_from);
    std::printf("lora: continuing from the adapter in %s (its r, alpha and targets apply)\n",
                recipe_.lora.init_from.c_str());
  } else if (!trains_full_weights(recipe_)) {
    require_model_projections(model.options(), recipe_.lora.target_modules, "lora.target_modules");
    require_lora_on_experts_supported(model.options(), recipe_);
    qat::apply_lora(model, adapter_config_.targets, adapter_config_.lora);
  }
  if (recipe_.quant == QuantMethod::kQat) require_model_projections(model.options(), recipe_.qat.target_modules, "qat.target_modules");
  // After LoRA, so that QAT fake-quantizes the merged weight a merged export writes.
  const auto quantized = apply_recipe_qat(model, recipe_, &loaded_.config);
  if (!quantized.empty()) {
    const auto options = qat_linear_options(recipe_);
    std::string weights = options.weights.spec.describe();
    if (options.weights.spec.is_gguf_block()) {  // "gguf Q4_K_M's mix: 24 Q4_K, 4 Q6_K"
      std::map<std::string, int> types;
      for (const auto& [name, layer] : qat::find_qat_layers(model)) ++types[layer->weight_fake_quant().spec().describe()];
      weights = "gguf " + recipe_.qat.weights.gguf_type + "'s mix:";
      for (const auto& [type, count] : types) weights += " " + std::to_string(count) + " " + type.substr(5) + ",";
      weights.pop_back();
    }
    std::printf("qat: %zu layers, weights %s, inputs %s; fake quantization from step %lld\n", quantized.size(),
                weights.c_str(),
                options.activations ? options.activations->spec.describe().c_str() : "unquantized",
                static_cast<long long>(recipe_.qat.start_step));
  }
  // Adapters (or every weight) and learned QAT scales train; the rest stays frozen.
  auto trained = mark_trained_parameters(model, recipe_);
  trainable_ = std::move(trained.tensors);
  trainable_names_ = std::move(trained.names);
  const std::string what_trains = trains_full_weights(recipe_)
                                      ? std::string("full weights")
                                      : "LoRA r=" + std::to_string(adapter_config_.lora.rank);
  std::printf("model: %s, quant %s, compute %s on %s; trainable %.3fM parameters (%s)\n",
              recipe_.model.path.c_str(), quant_method_name(recipe_.quant), dtype_short_name(compute_dtype_).c_str(),
              device_.str().c_str(), trained.count / 1e6, what_trains.c_str());
  model.train();
}

void Finetune::setup_optimizer() {
  optimizer_ = recipe_optimizer(recipe_, trainable_);
  step_options_ = training_step_options(recipe_, loaded_.config.llama.vocab_size, device_);
  step_ = std::make_unique<TrainingStep>(*loaded_.model, trainable_, *optimizer_, scaler_, step_options_);
}

void Finetune::setup_data() {
  const auto tokenizer = data::Tokenizer::from_model_dir(recipe_.model.path);
  pad_id_ = batch_stream_options(recipe_, tokenizer).pad_id;
  auto train = load_training_examples(recipe_, tokenizer);
  std::printf("data: train %s\n", data::describe(train.stats).c_str());
  for (const auto& message : train.stats.bad_record_messages) std::printf("  skipped: %s\n", message.c_str());
  auto eval = load_eval_examples(recipe_, tokenizer);
  if (!eval.examples.empty()) std::printf("data: eval %s\n", data::describe(eval.stats).c_str());
  // Each rank evaluates every world_size-th example; the sums are reduced.
  for (size_t index = static_cast<size_t>(launch_.rank); index < eval.examples.size();
       index += static_cast<size_t>(launch_.world_size)) {
    eval_examples_.push_back(std::move(eval.examples[index]));
  }
  has_eval_data_ = !eval.examples.empty();
  if (preference_ && objective_row(preference_->objective).reference) {
    // A full-weight run's reference is the model as loaded: no adapters to switch off, so its
    // log-probabilities are taken now, before the first step (and before a resume loads weights).
    const bool full_weights = trains_full_weights(recipe_);
    if (full_weights || recipe_.dpo.precompute_reference) {
      if (full_weights && !recipe_.dpo.precompute_reference) {
        std::printf("dpo: the run trains the full weights, so the reference's log-probabilities are computed before "
                    "training (dpo.precompute_reference)\n");
      }
      precompute_reference(train.examples, "train");
      precompute_reference(eval_examples_, "eval");
    }
  }
  data::BatchStream stream(std::move(train.examples),
                           batch_stream_options(recipe_, tokenizer, launch_.rank, launch_.world_size));
  const int64_t rows_per_batch = stream.rows_per_batch();
  train_batches_ = std::make_unique<data::DataLoader>(std::move(stream), recipe_.data.prefetch_batches);
  total_steps_ = recipe_.train.steps > 0
                     ? recipe_.train.steps
                     : std::max<int64_t>(1, recipe_.train.epochs * train_batches_->batches_per_epoch() /
                                                recipe_.train.grad_accum_steps);
  schedule_.name = recipe_.schedule.name;
  schedule_.peak_lr = recipe_.optim.lr;
  schedule_.warmup_steps = recipe_.schedule.warmup_steps;
  schedule_.total_steps = total_steps_;
  schedule_.min_lr_ratio = recipe_.schedule.min_lr_ratio;
  std::printf("data: %lld batches of %lld per epoch; %lld steps, %lld micro-batches each\n",
              static_cast<long long>(train_batches_->batches_per_epoch()), static_cast<long long>(rows_per_batch),
              static_cast<long long>(total_steps_), static_cast<long long>(recipe_.train.grad_accum_steps));
  if (rows_per_batch < recipe_.train.micro_batch_size) {
    std::printf("data: note: fewer examples than one micro-batch of %lld%s: each batch holds the %lld there are\n",
                static_cast<long long>(recipe_.train.micro_batch_size),
                launch_.world_size > 1 ? " on every rank" : "", static_cast<long long>(rows_per_batch));
  }
}

StepResult Finetune::train_step(int64_t step) {
  const auto position = train_batches_->state();
  // QAT: observers may run before qat.start_step; the rounding starts there (train() sets the
  // state the run starts or resumes in).
  if (recipe_.quant == QuantMethod::kQat && step == recipe_.qat.start_step) qat::set_fake_quant_enabled(*loaded_.model, true);
  // The schedule follows optimizer steps taken: a skipped step does not advance it.
  optimizer_->set_learning_rate(optim::learning_rate_at(schedule_, optimizer_steps_));
  std::vector<data::Batch> micro_batches;
  for (int64_t index = 0; index < recipe_.train.grad_accum_steps; ++index) micro_batches.push_back(train_batches_->next());
  StepResult result = step_->run(micro_batches, step, after_backward_);
  result.epoch = position.epoch;
  result.batch_in_epoch = position.batch_in_epoch;
  if (result.skipped) {
    handle_skipped_step(step, result, /*scale_overflow=*/std::isfinite(result.loss) && scaler_.enabled());
    return result;
  }
  consecutive_skips_ = 0;
  ++optimizer_steps_;
  return result;
}

void Finetune::handle_skipped_step(int64_t step, const StepResult& result, bool scale_overflow) {
  ++skipped_steps_;
  // fp16 overflow is how the scaler finds its scale: it only counts once the scale is below 1,
  // where no overflow explains it any more.
  if (!scale_overflow || scaler_.scale() < 1.0) ++consecutive_skips_;
  const std::string where = "step " + std::to_string(step + 1) + " (data epoch " + std::to_string(result.epoch) +
                            ", batch " + std::to_string(result.batch_in_epoch) + ")";
  print_line(where + ": skipped, " + result.skip_reason +
             (scaler_.enabled() ? "; loss scale now " + std::to_string(scaler_.scale()) : ""));
  log_metrics({{"step", step + 1},
               {"skipped", true},
               {"skipped_steps", skipped_steps_},
               {"reason", result.skip_reason},
               {"loss_scale", scaler_.scale()},
               {"epoch", result.epoch},
               {"batch_in_epoch", result.batch_in_epoch}});
  const std::string advice = "lower optim.lr, use train.dtype bf16 or fp32, or check the data there";
  if (recipe_.train.nonfinite == "abort") {
    throw Error(ErrorCode::kNumerics, where + ": " + result.skip_reason + " and train.nonfinite is abort; " + advice);
  }
  if (consecutive_skips_ >= recipe_.train.max_skipped_steps) {
    throw Error(ErrorCode::kNumerics, where + ": " + std::to_string(consecutive_skips_) +
                " steps in a row skipped for non-finite losses or gradients (train.max_skipped_steps); " + advice +
                ". The weights were never updated with a non-finite value.");
  }
}

PairPassOptions Finetune::pair_pass_options() const {
  PairPassOptions options;
  options.device = device_;
  options.batch_size = recipe_.train.micro_batch_size;
  options.loss = step_options_.loss_options();
  options.packed_attention = step_options_.packed_attention;
  options.pad_id = pad_id_;
  return options;
}

void Finetune::precompute_reference(std::vector<data::Example>& examples, const std::string& what) {
  if (examples.empty()) return;
  const auto start = Clock::now();
  compute_reference_log_probs(*loaded_.model, examples, pair_pass_options());
  std::printf("dpo: reference log-probabilities of %zu %s pairs (%.1f s)\n", examples.size(), what.c_str(),
              seconds_since(start));
}

double Finetune::evaluate_pairs_and_log(int64_t step) {
  auto options = pair_pass_options();
  // The ranks share the batches: max_batches bounds their total.
  options.max_batches = (recipe_.eval.max_batches + launch_.world_size - 1) / launch_.world_size;
  const auto result = evaluate_preference(*loaded_.model, eval_examples_, *preference_, options);
  std::vector<double> sums = {result.loss_sum, static_cast<double>(result.batches)};
  for (const auto& metric : result.metric_sums) sums.push_back(metric.second);
  if (group_) sums = group_->sum(sums, "the evaluation");
  const double batches = std::max(sums[1], 1.0);
  const double loss = sums[0] / batches;
  nlohmann::json line = {{"step", step}, {"eval_loss", loss}};
  std::string text = "eval  step " + std::to_string(step) + "/" + std::to_string(total_steps_);
  char value[64];
  std::snprintf(value, sizeof value, " | eval_loss %.4f", loss);
  text += value;
  for (size_t index = 0; index < result.metric_sums.size(); ++index) {
    const auto& name = result.metric_sums[index].first;
    const double mean = sums[index + 2] / batches;
    line["eval_" + name] = mean;
    if (shown_in_progress_line(name)) {
      std::snprintf(value, sizeof value, " | %s %.4f", name.c_str(), mean);
      text += value;
    }
  }
  print_line(text + " | " + std::to_string(static_cast<int64_t>(sums[1])) + " batches");
  log_metrics(line);
  return loss;
}

double Finetune::evaluate_and_log(int64_t step) {
  if (!has_eval_data_) return std::numeric_limits<double>::quiet_NaN();
  if (preference_) return evaluate_pairs_and_log(step);
  EvalOptions options;
  options.batch_size = recipe_.train.micro_batch_size;
  // The ranks share the batches: max_batches bounds their total.
  options.max_batches = (recipe_.eval.max_batches + launch_.world_size - 1) / launch_.world_size;
  options.fused_loss = recipe_.train.fused_loss;
  double loss_sum = 0;
  double tokens = 0;
  if (!eval_examples_.empty()) {
    // The held-out data must not move a QAT run's calibrated ranges; before the first step has
    // observed them, the evaluation is of the float model.
    auto& model = *loaded_.model;
    const bool qat_run = recipe_.quant == QuantMethod::kQat;
    bool was_quantizing = false;
    if (qat_run) {
      const auto quantized_layers = qat::find_qat_layers(model);
      was_quantizing = !quantized_layers.empty() && quantized_layers.front().second->fake_quant_enabled();
      qat::set_observer_enabled(model, false);
      if (!qat::quantizers_have_scales(model)) qat::set_fake_quant_enabled(model, false);
    }
    const auto result = evaluate(model, eval_examples_, options);
    if (qat_run) {
      qat::set_observer_enabled(model, true);
      qat::set_fake_quant_enabled(model, was_quantizing);
    }
    tokens = static_cast<double>(result.tokens);
    loss_sum = result.loss * tokens;
  }
  if (group_) {
    const auto totals = group_->sum({loss_sum, tokens}, "the evaluation");
    loss_sum = totals[0];
    tokens = totals[1];
  }
  const double loss = loss_sum / std::max(tokens, 1.0);
  const double perplexity = std::exp(loss);
  char text[160];
  std::snprintf(text, sizeof text, "eval  step %lld/%lld | eval_loss %.4f | perplexity %.2f | %lld tokens",
                static_cast<long long>(step), static_cast<long long>(total_steps_), loss, perplexity,
                static_cast<long long>(tokens));
  print_line(text);
  log_metrics({{"step", step}, {"eval_loss", loss}, {"eval_perplexity", perplexity},
               {"eval_tokens", static_cast<int64_t>(tokens)}});
  return loss;
}

void Finetune::log_metrics(const nlohmann::json& line) {
  if (run_log_) run_log_->record(line);
}

void Finetune::print_line(const std::string& line) {
  progress_.print(line);
}

std::string Finetune::save_adapter() {
  const std::string target = run_dir_ + "/adapter";
  if (writes_files()) {
    const std::string staged = run_dir_ + "/.adapter.staging";
    remove_tree(staged);
    write_peft_adapter(*loaded_.model, adapter_config_, staged, recipe_.model.path);
    replace_directory(staged, target);
  }
  wait_for_all_ranks("the adapter written by rank 0");
  return target;
}

std::vector<std::string> Finetune::write_exports() {
  const std::string out = recipe_.export_.out.empty() ? run_dir_ + "/export" : recipe_.export_.out;
  std::vector<std::string> written;
  const auto& formats = recipe_.export_.formats;
  const bool asks_for_adapter = std::any_of(formats.begin(), formats.end(), [](const std::string& name) {
    return find_export_format(name, "export.formats").format == ExportFormat::kPeft;
  });
  if (writes_files() && trains_full_weights(recipe_) && asks_for_adapter) {
    std::printf("export: no PEFT adapter, the run trained the full weights; for a Hugging Face model add merged to "
                "export.formats, or run qtrain export --run %s --format merged\n", run_dir_.c_str());
  }
  if (writes_files()) {
    ModelExportOptions options;
    options.gguf_file_type = parse_gguf_type(gguf_export_type(recipe_), "export.gguf_type");
    options.compressed_tensors_scheme = &compressed_tensors_export_scheme(recipe_);
    written = write_model_exports(*loaded_.model, export_base_, formats, out, options);
    for (const auto& path : written) std::printf("export: %s\n", path.c_str());
  }
  wait_for_all_ranks("the exports written by rank 0");
  return written;
}

bool Finetune::any_rank_stopping() {
  const double stopping = stop_requested() ? 1.0 : 0.0;
  if (!group_) return stopping > 0;
  return group_->sum({stopping}, "the stop check")[0] > 0;
}

void Finetune::wait_for_all_ranks(const std::string& what) {
  if (group_) group_->barrier(what);
}

std::string Finetune::save_checkpoint(int64_t steps_done) {
  const auto start = Clock::now();
  TrainingCheckpoint checkpoint;
  for (size_t index = 0; index < trainable_.size(); ++index) {
    checkpoint.trainable.emplace_back(trainable_names_[index], trainable_[index]);
  }
  for (auto& buffer : qat_state_buffers(*loaded_.model)) checkpoint.trainable.push_back(std::move(buffer));
  step_->settle_optimizer_state();
  checkpoint.optimizer = optimizer_->state();
  checkpoint.random_states = RandomState::capture(device_).named();
  checkpoint.state = {{"step", steps_done},
                      {"optimizer_steps", optimizer_steps_},
                      {"skipped_steps", skipped_steps_},
                      {"consecutive_skips", consecutive_skips_},
                      {"loader", train_batches_->state().to_json()},
                      {"loss_scaler", scaler_.state()}};
  checkpoint.recipe_yaml = recipe_to_yaml(recipe_);
  // Every rank holds the same weights, optimizer state and data position: rank 0's is the run's.
  std::string path = run_dir_ + "/checkpoints/" + checkpoint_name(steps_done);
  if (writes_files()) {
    path = write_training_checkpoint(run_dir_, steps_done, checkpoint);
    prune_training_checkpoints(run_dir_, recipe_.checkpoint.keep_last);
  }
  wait_for_all_ranks("the checkpoint written by rank 0");
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, " (%.2f s)", seconds_since(start));
  print_line("checkpoint: " + path + seconds);
  return path;
}

bool Finetune::resume_if_asked() {
  if (resume_.empty()) return false;
  std::string path = resume_;
  if (resume_ == "auto") {
    const auto newest = newest_valid_checkpoint(run_dir_);
    if (!newest) {
      std::printf("resume: no checkpoint in %s/checkpoints; starting fresh\n", run_dir_.c_str());
      return false;
    }
    path = *newest;
  }
  const auto checkpoint = read_training_checkpoint(path);
  const Recipe saved = load_recipe(path + "/recipe.yaml", {});
  const auto differences = recipe_differences(saved, recipe_);
  for (const auto& difference : differences) {
    if (difference.shapes_model) {
      throw Error(ErrorCode::kCheckpoint, path + ": the checkpoint was trained with another model (" + difference.text +
                  "); resume with the recipe it was written with");
    }
  }
  for (const auto& difference : differences) {
    std::printf("resume: recipe changed since the checkpoint: %s\n", difference.text.c_str());
  }
  load_trainable_tensors(*loaded_.model, checkpoint.trainable,
                         trainable_.size() + qat_state_buffers(*loaded_.model).size(), path);
  optimizer_->load_state(checkpoint.optimizer);
  const auto& state = checkpoint.state;
  scaler_.load_state(state.at("loss_scaler"), path + "/state.json");
  train_batches_->restore(data::LoaderState::from_json(state.at("loader"), path + "/state.json"));
  RandomState::from_named(checkpoint.random_states, device_).restore();
  first_step_ = state.at("step").get<int64_t>();
  optimizer_steps_ = state.at("optimizer_steps").get<int64_t>();
  skipped_steps_ = state.at("skipped_steps").get<int64_t>();
  consecutive_skips_ = state.at("consecutive_skips").get<int64_t>();
  if (first_step_ > total_steps_) {
    throw Error(ErrorCode::kCheckpoint, path + ": the checkpoint is at step " + std::to_string(first_step_) + ", past this run's " +
                std::to_string(total_steps_) + " steps (raise train.steps to continue)");
  }
  std::printf("resume: continuing from %s at step %lld of %lld\n", path.c_str(), static_cast<long long>(first_step_),
              static_cast<long long>(total_steps_));
  return true;
}

TrainSummary Finetune::train() {
  TrainSummary summary;
  const auto start = Clock::now();
  if (recipe_.quant == QuantMethod::kQat) qat::set_fake_quant_enabled(*loaded_.model, first_step_ >= recipe_.qat.start_step);
  summary.first_eval_loss =
      first_step_ == 0 ? evaluate_and_log(0) : std::numeric_limits<double>::quiet_NaN();
  summary.last_eval_loss = summary.first_eval_loss;
  reset_peak_memory(device_);
  auto window_start = Clock::now();
  int64_t window_tokens = 0;
  double train_seconds = 0;
  double step_seconds = 0, recent_tokens_per_second = 0;  // for the progress line
  CpuThreadGovernor cpu_threads(device_.is_cpu());
  for (int64_t step = first_step_; step < total_steps_; ++step) {
    cpu_threads.between_work();
    const auto step_start = Clock::now();
    const StepResult result = train_step(step);
    window_tokens += result.tokens;
    const int64_t done = step + 1;
    if (progress_.enabled()) {
      const double seconds = seconds_since(step_start);
      step_seconds += seconds;
      const double rate = result.tokens / std::max(seconds, 1e-9);
      recent_tokens_per_second = step == first_step_ ? rate : 0.8 * recent_tokens_per_second + 0.2 * rate;
      progress_.update(done, total_steps_, result.loss, recent_tokens_per_second,
                       step_seconds / static_cast<double>(done - first_step_) * static_cast<double>(total_steps_ - done));
    }
    if (recipe_.train.empty_cache_steps > 0 && done % recipe_.train.empty_cache_steps == 0) {
      release_cached_memory(device_);
    }
    if (done % recipe_.log.every == 0 || done == total_steps_) {
      const double window_seconds = seconds_since(window_start);
      train_seconds += window_seconds;
      const double tokens_per_second = window_tokens / std::max(window_seconds, 1e-9);
      const auto memory = memory_usage(device_);
      const double eta = train_seconds / static_cast<double>(done - first_step_) * static_cast<double>(total_steps_ - done);
      std::string extras;
      if (memory.reserved_bytes > 0) extras += ", reserved " + format_bytes(memory.reserved_bytes);
      std::string precision, extras_metrics;  // extras_metrics: a preference objective's reward accuracy and margin
      if (scaler_.enabled()) precision += " | scale " + std::to_string(static_cast<int64_t>(scaler_.scale()));
      if (skipped_steps_ > 0) precision += " | skipped " + std::to_string(skipped_steps_);
      for (const auto& [name, value] : result.metrics) {
        if (!shown_in_progress_line(name)) continue;
        char metric[64];
        std::snprintf(metric, sizeof metric, " | %s %.3f", name.substr(8).c_str(), value);
        extras_metrics += metric;
      }
      if (group_) extras += " on rank 0";
      char text[400];
      std::snprintf(text, sizeof text,
                    "step %lld/%lld | loss %.4f%s | lr %.2e | grad_norm %.3f | %.0f tokens/s | memory %s (peak %s%s)%s | eta %s",
                    static_cast<long long>(done), static_cast<long long>(total_steps_), result.loss,
                    extras_metrics.c_str(), optimizer_->learning_rate(), result.grad_norm, tokens_per_second,
                    format_bytes(memory.current_bytes).c_str(), format_bytes(memory.peak_bytes).c_str(), extras.c_str(),
                    precision.c_str(), format_duration(eta).c_str());
      print_line(text);
      nlohmann::json line = {{"step", done},
                             {"loss", result.loss},
                             {"lr", optimizer_->learning_rate()},
                             {"grad_norm", result.grad_norm},
                             {"tokens_per_second", tokens_per_second},
                             {"memory", memory.current_bytes},
                             {"peak_memory", memory.peak_bytes},
                             {"epoch", result.epoch},
                             {"skipped_steps", skipped_steps_}};
      if (memory.reserved_bytes > 0) line["reserved_memory"] = memory.reserved_bytes;
      for (const auto& [name, value] : result.metrics) line[name] = value;
      if (scaler_.enabled()) line["loss_scale"] = scaler_.scale();
      if (group_) {
        line["world_size"] = launch_.world_size;
        line["tokens_per_second_per_rank"] = tokens_per_second / static_cast<double>(launch_.world_size);
      }
      log_metrics(line);
      reset_peak_memory(device_);  // the next line's peak is that of its own window
      window_start = Clock::now();
      window_tokens = 0;
    }
    if (any_rank_stopping() && done != total_steps_) {
      summary.stopped = true;
      summary.steps = done;
      summary.checkpoint_dir = save_checkpoint(done);
      write_curves();
      summary.seconds = seconds_since(start);
      return summary;
    }
    if (recipe_.checkpoint.every > 0 && done % recipe_.checkpoint.every == 0 && done != total_steps_) {
      summary.checkpoint_dir = save_checkpoint(done);
      window_start = Clock::now();
    }
    if (recipe_.eval.every > 0 && done % recipe_.eval.every == 0 && done != total_steps_) {
      summary.last_eval_loss = evaluate_and_log(done);
      window_start = Clock::now();
    }
  }
  progress_.finish();
  step_->settle_optimizer_state();  // the last update, where it waits for a next forward
  summary.steps = total_steps_;
  // Evaluation and the exports offload nothing: the pinned buffers of the steps go back to the host.
  ActivationOffload::release_unused_host_buffers();
  if (first_step_ < total_steps_) summary.checkpoint_dir = save_checkpoint(total_steps_);
  // What is evaluated and exported is the quantized model, even when qat.start_step was never reached.
  if (recipe_.quant == QuantMethod::kQat) qat::set_fake_quant_enabled(*loaded_.model, true);
  summary.last_eval_loss = evaluate_and_log(total_steps_);
  if (!trains_full_weights(recipe_)) summary.adapter_dir = save_adapter();
  summary.exports = write_exports();
  write_curves();
  summary.seconds = seconds_since(start);
  return summary;
}

void Finetune::write_curves() {
  progress_.finish();
  if (run_log_) print_line("curves: " + run_log_->write_curves());
}

}  // namespace qtrain::trainer
