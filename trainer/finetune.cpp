#include "trainer/finetune.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>

#include "kernels/error.h"
#include "qat/four_bit_linear.h"
#include "optim/grad_clip.h"
#include "trainer/batch_inputs.h"
#include "trainer/causal_lm_loss.h"
#include "trainer/device.h"
#include "trainer/evaluate.h"
#include "trainer/file_system.h"
#include "trainer/memory_stats.h"
#include "trainer/recipe_data.h"

namespace qtrain::trainer {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string format_duration(double seconds) {
  char text[32];
  const auto whole = static_cast<int64_t>(seconds);
  if (whole >= 3600) {
    std::snprintf(text, sizeof text, "%lldh%02lldm", static_cast<long long>(whole / 3600),
                  static_cast<long long>(whole % 3600 / 60));
  } else {
    std::snprintf(text, sizeof text, "%lldm%02llds", static_cast<long long>(whole / 60),
                  static_cast<long long>(whole % 60));
  }
  return text;
}

bool is_lora_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

}  // namespace

Finetune::Finetune(Recipe recipe) : recipe_(std::move(recipe)) {}

void Finetune::setup() {
  if (recipe_.model.path.empty()) throw Error("model.path is not set: point it at a Hugging Face model directory");
  if (recipe_.data.train.empty()) {
    throw Error("data.train is not set: point it at a data file or a directory of shards (data.format " +
                recipe_.data.format + ")");
  }
  if (recipe_.quant == "qat") throw Error("quant: qat is not available yet (it arrives with QAT 6/11); use qlora or none");
  if (recipe_.train.gradient_checkpointing) {
    std::printf("note: train.gradient_checkpointing arrives with Precision and memory 4/11; this run keeps "
                "activations (same results, more memory)\n");
  }
  if (recipe_.checkpoint.every > 0) {
    std::printf("note: checkpoint.every is set, but training-state checkpoints arrive with Checkpoints 5/11; "
                "this run writes its adapter at the end only\n");
  }
  device_ = resolve_device(recipe_.train.device);
  compute_dtype_ = parse_dtype_name(recipe_.train.dtype, "train.dtype");
  if (compute_dtype_ == torch::kFloat16 && device_.is_cpu()) {
    throw Error("train.dtype fp16 is not supported on the CPU; use bf16 or fp32");
  }
  torch::manual_seed(static_cast<uint64_t>(recipe_.train.seed));
  run_dir_ = recipe_.train.output_dir;
  std::filesystem::create_directories(run_dir_);
  write_file_atomically(run_dir_ + "/recipe.yaml", recipe_to_yaml(recipe_));
  std::ofstream(run_dir_ + "/metrics.jsonl", std::ios::trunc);
  setup_model();
  setup_adapters();
  setup_optimizer();
  setup_data();
}

void Finetune::setup_model() {
  ModelLoadOptions options;
  options.dtype = compute_dtype_;
  loaded_ = load_llama(recipe_.model.path, options);
  if (recipe_.quant == "qlora") {
    qat::FourBitOptions four_bit;
    four_bit.quant_type = recipe_.qlora.quant_type;
    four_bit.blocksize = recipe_.qlora.blocksize;
    four_bit.double_quant = recipe_.qlora.double_quant;
    four_bit.compute_dtype = compute_dtype_;
    qat::quantize_linear_layers(*loaded_.model, four_bit, recipe_.qlora.skip_modules);
  }
  loaded_.model->to(device_);
}

void Finetune::setup_adapters() {
  auto& model = *loaded_.model;
  if (!recipe_.lora.init_from.empty()) {
    apply_peft_adapter(model, recipe_.lora.init_from);
    adapter_config_ = read_peft_adapter_config(recipe_.lora.init_from);
    std::printf("lora: continuing from the adapter in %s (its r, alpha and targets apply)\n",
                recipe_.lora.init_from.c_str());
  } else {
    adapter_config_.lora.rank = recipe_.lora.rank;
    adapter_config_.lora.alpha = recipe_.lora.alpha;
    adapter_config_.lora.dropout = recipe_.lora.dropout;
    adapter_config_.lora.rslora = recipe_.lora.rslora;
    adapter_config_.targets.include.names = recipe_.lora.target_modules;
    qat::apply_lora(model, adapter_config_.targets, adapter_config_.lora);
  }
  // Only the adapters train: the base (quantized or not), embeddings, norms and lm_head stay frozen.
  int64_t trainable_count = 0;
  for (auto& item : model.named_parameters()) {
    const bool trains = is_lora_parameter(item.key());
    item.value().set_requires_grad(trains);
    if (trains) {
      trainable_.push_back(item.value());
      trainable_count += item.value().numel();
    }
  }
  std::printf("model: %s, quant %s, compute %s on %s; trainable %.3fM parameters (LoRA r=%lld)\n",
              recipe_.model.path.c_str(), recipe_.quant.c_str(), dtype_short_name(compute_dtype_).c_str(),
              device_.str().c_str(), trainable_count / 1e6, static_cast<long long>(adapter_config_.lora.rank));
  model.train();
}

void Finetune::setup_optimizer() {
  optimizer_ = optim::make_optimizer(recipe_.optim.name, trainable_, recipe_.optim.lr, recipe_.optim.weight_decay,
                                     recipe_.optim.betas, recipe_.optim.eps);
}

void Finetune::setup_data() {
  const auto tokenizer = data::Tokenizer::from_model_dir(recipe_.model.path);
  auto train = load_training_examples(recipe_, tokenizer);
  std::printf("data: train %s\n", data::describe(train.stats).c_str());
  for (const auto& message : train.stats.bad_record_messages) std::printf("  skipped: %s\n", message.c_str());
  auto eval = load_eval_examples(recipe_, tokenizer);
  eval_examples_ = std::move(eval.examples);
  if (!eval_examples_.empty()) std::printf("data: eval %s\n", data::describe(eval.stats).c_str());
  data::BatchStream stream(std::move(train.examples), batch_stream_options(recipe_, tokenizer));
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
              static_cast<long long>(train_batches_->batches_per_epoch()),
              static_cast<long long>(recipe_.train.micro_batch_size), static_cast<long long>(total_steps_),
              static_cast<long long>(recipe_.train.grad_accum_steps));
}

double Finetune::train_step(int64_t step, double& grad_norm, int64_t& tokens) {
  auto& model = *loaded_.model;
  optimizer_->set_learning_rate(optim::learning_rate_at(schedule_, step));
  std::vector<data::Batch> micro_batches;
  int64_t predicted_tokens = 0;
  for (int64_t index = 0; index < recipe_.train.grad_accum_steps; ++index) {
    micro_batches.push_back(train_batches_->next());
    predicted_tokens += micro_batches.back().predicted_tokens;
    tokens += micro_batches.back().input_tokens;
  }
  // The loss is token-weighted over the whole accumulation window, as if it were one batch.
  double loss_sum = 0;
  for (auto& batch : micro_batches) {
    auto labels = batch.labels.to(device_);
    auto hidden = model.hidden_states(model_inputs(batch, device_));
    auto loss = causal_lm_loss(model, hidden, labels, /*chunk_tokens=*/0);
    (loss.loss_sum / static_cast<double>(std::max<int64_t>(predicted_tokens, 1))).backward();
    loss_sum += loss.loss_sum.item<double>();
  }
  const double mean_loss = loss_sum / static_cast<double>(std::max<int64_t>(predicted_tokens, 1));
  if (!std::isfinite(mean_loss)) {
    throw Error("step " + std::to_string(step + 1) + ": the loss is " + std::to_string(mean_loss) +
                "; lower optim.lr, check the data, or use train.dtype fp32 (the run directory keeps its metrics)");
  }
  grad_norm = optim::clip_grad_norm(trainable_, recipe_.train.max_grad_norm);
  optimizer_->step();
  optimizer_->zero_grad();
  return mean_loss;
}

double Finetune::evaluate_and_log(int64_t step) {
  if (eval_examples_.empty()) return std::numeric_limits<double>::quiet_NaN();
  EvalOptions options;
  options.batch_size = recipe_.train.micro_batch_size;
  options.max_batches = recipe_.eval.max_batches;
  const auto result = evaluate(*loaded_.model, eval_examples_, options);
  std::printf("eval  step %lld/%lld | eval_loss %.4f | perplexity %.2f | %lld tokens\n", static_cast<long long>(step),
              static_cast<long long>(total_steps_), result.loss, result.perplexity,
              static_cast<long long>(result.tokens));
  log_metrics({{"step", step}, {"eval_loss", result.loss}, {"eval_perplexity", result.perplexity},
               {"eval_tokens", result.tokens}});
  return result.loss;
}

void Finetune::log_metrics(const nlohmann::json& line) {
  std::ofstream metrics(run_dir_ + "/metrics.jsonl", std::ios::app);
  metrics << line.dump() << "\n";
  if (!metrics) throw Error(run_dir_ + "/metrics.jsonl: cannot write (is the disk full?)");
}

std::string Finetune::save_adapter() const {
  const std::string target = run_dir_ + "/adapter";
  const std::string staged = run_dir_ + "/.adapter.staging";
  remove_tree(staged);
  write_peft_adapter(*loaded_.model, adapter_config_, staged, recipe_.model.path);
  replace_directory(staged, target);
  return target;
}

TrainSummary Finetune::train() {
  TrainSummary summary;
  const auto start = Clock::now();
  summary.first_eval_loss = evaluate_and_log(0);
  summary.last_eval_loss = summary.first_eval_loss;
  reset_peak_memory(device_);
  auto window_start = Clock::now();
  int64_t window_tokens = 0;
  double train_seconds = 0;
  for (int64_t step = 0; step < total_steps_; ++step) {
    double grad_norm = 0;
    int64_t tokens = 0;
    const double loss = train_step(step, grad_norm, tokens);
    window_tokens += tokens;
    const int64_t done = step + 1;
    if (done % recipe_.log.every == 0 || done == total_steps_) {
      const double window_seconds = seconds_since(window_start);
      train_seconds += window_seconds;
      const double tokens_per_second = window_tokens / std::max(window_seconds, 1e-9);
      const auto memory = memory_usage(device_);
      const double eta = train_seconds / static_cast<double>(done) * static_cast<double>(total_steps_ - done);
      std::printf("step %lld/%lld | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tokens/s | memory %s (peak %s) | eta %s\n",
                  static_cast<long long>(done), static_cast<long long>(total_steps_), loss,
                  optimizer_->learning_rate(), grad_norm, tokens_per_second, format_bytes(memory.current_bytes).c_str(),
                  format_bytes(memory.peak_bytes).c_str(), format_duration(eta).c_str());
      std::fflush(stdout);
      log_metrics({{"step", done},
                   {"loss", loss},
                   {"lr", optimizer_->learning_rate()},
                   {"grad_norm", grad_norm},
                   {"tokens_per_second", tokens_per_second},
                   {"memory", memory.current_bytes},
                   {"peak_memory", memory.peak_bytes},
                   {"epoch", train_batches_->epoch()}});
      window_start = Clock::now();
      window_tokens = 0;
    }
    if (recipe_.eval.every > 0 && done % recipe_.eval.every == 0 && done != total_steps_) {
      summary.last_eval_loss = evaluate_and_log(done);
      window_start = Clock::now();
    }
  }
  summary.steps = total_steps_;
  summary.last_eval_loss = evaluate_and_log(total_steps_);
  summary.adapter_dir = save_adapter();
  summary.seconds = seconds_since(start);
  return summary;
}

}  // namespace qtrain::trainer
