// qtrain bench: training throughput and peak memory of a Llama-, Qwen-, Mistral-, Gemma- or Phi-3-shaped model with random
// weights, built directly on the device (no checkpoint on disk): QLoRA (NF4 double-quant base),
// LoRA on an LLM.int8 base (--quant int8) or LoRA (16-bit base), LoRA on all 7 projections, AdamW
// (or --optim adamw8bit), random tokens. The step is a run's (trainer/training_step.h), with
// the trained parameters, optimizer and loss chunk a recipe of these settings gives.
//
// Model FLOPs per token (what MFU counts; recomputation under checkpointing is not counted):
//   matmuls: forward 2 N, backward 2 N (gradients to the inputs only: the base is frozen and
//   the LoRA weights' gradients are negligible), N = projection and lm_head parameters;
//   attention: 4 L S d forward (QK^T and PV over the full S x S square, PaLM's convention,
//   d = heads x head_dim) and twice that backward.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#ifdef QTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "kernels/error.h"
#include "data/batching.h"
#include "qat/four_bit_linear.h"
#include "qat/int8_linear.h"
#include "qat/lora_linear.h"
#include "qat/qat_lora_matmul.h"
#include "tools/commands.h"
#include "tools/kernel_profile.h"
#include "trainer/base/device.h"
#include "trainer/base/memory_stats.h"
#include "trainer/formats/training_checkpoint.h"
#include "trainer/model/llama.h"
#include "trainer/model/llama_shapes.h"
#include "trainer/recipe/base_quantization.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/training_step.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

// The bf16 dense peak of the GPU, for MFU; 0 when unknown.
double peak_flops(const torch::Device& device) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const std::string name = at::cuda::getDeviceProperties(device.index())->name;
    if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) return 989e12;
    if (name.find("A100") != std::string::npos) return 312e12;
  }
#endif
  (void)device;
  return 0;
}

// A random NF4 double-quantized weight [out, in] made directly on the device, with the code
// tables of a real quantization (`tables`). Quantizing 8B random weights would run bnb's exact
// codec on the CPU for minutes and measure nothing a training step does.
qat::FourBitTensor random_four_bit(int64_t out, int64_t in, const qat::FourBitTensor& tables,
                                   const torch::Device& device, torch::ScalarType dtype) {
  qat::FourBitTensor weight;
  weight.state = tables.state;
  weight.state.shape = {out, in};
  weight.state.dtype = dtype;
  const auto bytes = torch::TensorOptions().dtype(torch::kUInt8).device(device);
  weight.packed = torch::randint(256, {(out * in + 1) / 2, 1}, bytes);
  const int64_t blocks = weight.state.blocks();
  weight.state.absmax = torch::randint(256, {blocks}, bytes);
  weight.state.nested_absmax = torch::full({(blocks + qat::kNestedBlocksize - 1) / qat::kNestedBlocksize}, 0.01,
                                           torch::TensorOptions().dtype(torch::kFloat32).device(device));
  weight.state.code = tables.state.code.to(device);
  weight.state.nested_code = tables.state.nested_code.to(device);
  return weight;
}

// A random LLM.int8 weight [out, in] on the device: int8 codes and a row absmax of about what a
// 0.02-scaled weight has. Outlier columns come from the activations, not from here.
std::shared_ptr<qat::Int8Linear> random_int8(int64_t out, int64_t in, const torch::Tensor& bias,
                                             const torch::Device& device, torch::ScalarType dtype) {
  const auto codes = torch::randint(-127, 128, {out, in}, torch::TensorOptions().dtype(torch::kChar).device(device));
  const auto absmax = torch::full({out}, 0.08, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  return std::make_shared<qat::Int8Linear>(codes, absmax, bias, /*threshold=*/6.0, dtype);
}

void synchronize(const torch::Device& device) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) at::cuda::getCurrentCUDAStream(device.index()).synchronize();
#endif
  (void)device;
}

// The run a bench measures, as a recipe: what Finetune would build from it decides what trains,
// the optimizer and the step (trainer/training_step.h).
trainer::Recipe bench_recipe(const trainer::BaseQuantizationRow& base, bool fake_quant, int64_t lora_rank,
                             const std::string& optimizer_name, bool checkpointing, int64_t loss_chunk) {
  auto recipe = trainer::default_recipe();
  recipe.quant = fake_quant ? "qat" : base.kind == trainer::BaseQuantization::kNone ? "none" : "qlora";
  if (base.kind != trainer::BaseQuantization::kNone) recipe.qlora.quant_type = base.name;
  recipe.qat.base = base.name;  // QAT-LoRA on this base (read only with quant: qat)
  recipe.qat.weights.scale_dtype = "fp16";  // GGUF Q4_0's grid: int4, groups of 32, fp16 scales
  recipe.lora.rank = lora_rank;
  recipe.lora.alpha = 2.0 * static_cast<double>(lora_rank);
  recipe.lora.dropout = 0.0;
  recipe.optim.name = optimizer_name;
  recipe.train.gradient_checkpointing = checkpointing;
  recipe.train.loss_chunk_tokens = std::max<int64_t>(loss_chunk, 0);
  return recipe;
}

// One micro-batch of random tokens, on the CPU as the data loader hands them out.
data::Batch random_batch(int64_t micro_batch, int64_t sequence, int64_t vocab_size) {
  data::Batch batch;
  batch.input_ids = torch::randint(vocab_size, {micro_batch, sequence}, torch::kInt64);
  batch.labels = batch.input_ids.clone();
  batch.input_tokens = micro_batch * sequence;
  batch.predicted_tokens = micro_batch * (sequence - 1);
  return batch;
}

}  // namespace

int run_bench(const Arguments& arguments) {
  std::string shape, quant, dtype_name, device_name, checkpoint_run, optimizer_name, trace_path, lora_gradient;
  int64_t micro_batch = 0, sequence = 0, steps = 0, warmup = 0, lora_rank = 0, loss_chunk = 0, profile_steps = 0;
  po::options_description options("bench options");
  options.add_options()
      ("shape", po::value(&shape)->default_value("llama3-8b"),
       "llama3-8b, llama3-1b, qwen3-8b, qwen2.5-7b, mistral-7b, gemma2-9b, gemma3-12b, phi4-mini or tiny (random weights)")
      ("quant", po::value(&quant)->default_value("qlora"),
       "the frozen base: qlora (= nf4, double-quant), nf4, fp4, int8 (LLM.int8, threshold 6) or none (16-bit)")
      ("optim", po::value(&optimizer_name)->default_value("adamw"), "adamw or adamw8bit")
      ("micro-batch", po::value(&micro_batch)->default_value(1), "sequences per step")
      ("seq", po::value(&sequence)->default_value(2048), "tokens per sequence")
      ("checkpointing", po::bool_switch(), "recompute every decoder layer in backward")
      ("dora", po::bool_switch(), "DoRA adapters (lora.use_dora) instead of LoRA")
      ("qat", po::bool_switch(), "fake-quantize the merged weights (int4, groups of 32, fp16 scales) over the --quant base, "
       "as quant: qat with qat.base")
      ("lora-gradient", po::value(&lora_gradient)->default_value("identity"),
       "with --qat: the adapters' gradient, identity or masked (qat.lora_gradient)")
      ("loss-chunk", po::value(&loss_chunk)->default_value(0), "loss chunk tokens; 0 automatic, -1 unchunked")
      ("dtype", po::value(&dtype_name)->default_value("bf16"), "compute dtype: bf16, fp16 or fp32")
      ("device", po::value(&device_name)->default_value("auto"), "cuda, cpu or auto")
      ("lora-rank", po::value(&lora_rank)->default_value(16), "LoRA rank (alpha = 2 rank)")
      ("steps", po::value(&steps)->default_value(5), "timed steps (the median is reported)")
      ("warmup", po::value(&warmup)->default_value(2), "untimed steps first")
      ("save-checkpoint", po::value(&checkpoint_run), "after the steps, time writing the training state into RUN/checkpoints")
      ("profile", po::value(&profile_steps)->default_value(0),
       "after the timed steps, profile this many more and print where the GPU spent its time")
      ("trace", po::value(&trace_path), "with --profile: also write a Chrome trace to this file")
      ("json", po::bool_switch(), "end with one JSON object");
  po::variables_map values;
  if (!parse_command_line("usage: qtrain bench [--shape S] [--quant Q] [--micro-batch B] [--seq T] [--checkpointing]",
                          options, arguments, values)) {
    return 0;
  }
  const auto& base = trainer::base_quantization_named(quant == "qlora" ? "nf4" : quant, "--quant");
  if (steps < 1 || micro_batch < 1 || sequence < 2) throw Error(ErrorCode::kUsage, "--steps, --micro-batch must be >= 1 and --seq >= 2");
  const bool fake_quant = values["qat"].as<bool>();
  qat::parse_lora_gradient(lora_gradient, "--lora-gradient");
  const auto device = trainer::resolve_device(device_name);
  const auto dtype = trainer::parse_dtype_name(dtype_name, "--dtype");
  const bool checkpointing = values["checkpointing"].as<bool>();
  const auto llama = trainer::llama_shape(shape);
  auto recipe = bench_recipe(base, fake_quant, lora_rank, optimizer_name, checkpointing, loss_chunk);
  // Every projection of the shape's block: Phi-3's fused ones by their own names.
  recipe.lora.target_modules = recipe.qat.target_modules = llama.projection_names();
  recipe.lora.use_dora = values["dora"].as<bool>();
  recipe.qat.lora_gradient = lora_gradient;

  torch::manual_seed(0);
  const auto tables = qat::quantize_4bit(
      torch::randn({4096}) * 0.02, base.kind == trainer::BaseQuantization::kFp4 ? qat::FourBitType::kFp4 : qat::FourBitType::kNf4,
      recipe.qlora.blocksize, recipe.qlora.double_quant);
  const auto build_start = std::chrono::steady_clock::now();
  // Quantized projections are made on the device, one at a time: the 16-bit model never exists.
  const trainer::LinearFactory make_linear = [&](const std::string& name, const qat::DenseLinearOptions& linear)
      -> std::shared_ptr<qat::LinearLayer> {
    // Qwen2.5's q/k/v biases stay 16-bit beside the quantized weight, as bitsandbytes keeps them.
    const auto on_device = torch::TensorOptions().dtype(dtype).device(device);
    const auto bias = linear.bias ? torch::randn({linear.out_features}, on_device) * 0.02 : torch::Tensor();
    if (qat::module_name_matches(name, recipe.qlora.skip_modules)) return std::make_shared<qat::DenseLinear>(linear);
    switch (base.kind) {
      case trainer::BaseQuantization::kNf4:
      case trainer::BaseQuantization::kFp4:
        return std::make_shared<qat::FourBitLinear>(
            random_four_bit(linear.out_features, linear.in_features, tables, device, dtype), bias, dtype);
      case trainer::BaseQuantization::kInt8:
        return random_int8(linear.out_features, linear.in_features, bias, device, dtype);
      case trainer::BaseQuantization::kNone:
        break;
    }
    return std::make_shared<qat::DenseLinear>(linear);
  };
  trainer::LlamaForCausalLM model(llama, dtype, make_linear);
  model->to(device);
  const auto adapters = trainer::lora_adapter_config(recipe);
  qat::apply_lora(*model, adapters.targets, adapters.lora);
  trainer::apply_recipe_qat(*model, recipe);
  auto trained = trainer::mark_trained_parameters(*model, recipe);
  model->train();
  model->model->set_gradient_checkpointing(checkpointing ? 1 : 0);
  auto optimizer = trainer::recipe_optimizer(recipe, trained.tensors);
  trainer::LossScaler scaler(/*enabled=*/dtype == torch::kFloat16);
  auto step_options = trainer::training_step_options(recipe, llama.vocab_size, device);
  if (loss_chunk < 0) step_options.loss_chunk_tokens = -1;
  const int64_t chunk = step_options.loss_chunk_tokens;
  trainer::TrainingStep train_step(*model, trained.tensors, *optimizer, scaler, step_options);
  synchronize(device);
  std::printf("bench: model built in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - build_start).count());
  std::fflush(stdout);

  const std::vector<data::Batch> batches = {random_batch(micro_batch, sequence, llama.vocab_size)};
  std::vector<double> step_seconds;
  trainer::reset_peak_memory(device);
  for (int64_t step = 0; step < warmup + steps; ++step) {
    if (step == warmup) trainer::reset_peak_memory(device);
    synchronize(device);
    const auto start = std::chrono::steady_clock::now();
    train_step.run(batches, step);
    synchronize(device);
    if (step >= warmup) {
      step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  const auto memory = trainer::memory_usage(device);
  if (profile_steps > 0) {
    KernelProfile profile(device.is_cuda());
    for (int64_t step = 0; step < profile_steps; ++step) train_step.run(batches, warmup + steps + step);
    synchronize(device);
    profile.finish(trace_path, profile_steps, 25, std::cout);
  }
  double checkpoint_seconds = 0.0;
  if (!checkpoint_run.empty()) {
    // What a run's checkpoint holds for this model: LoRA weights and AdamW moments (the random,
    // loader and recipe parts are a few kilobytes).
    trainer::TrainingCheckpoint checkpoint;
    for (size_t index = 0; index < trained.names.size(); ++index) {
      checkpoint.trainable.emplace_back(trained.names[index], trained.tensors[index]);
    }
    checkpoint.optimizer = optimizer->state();
    checkpoint.state = {{"step", warmup + steps}};
    const auto start = std::chrono::steady_clock::now();
    const auto path = trainer::write_training_checkpoint(checkpoint_run, warmup + steps, checkpoint);
    checkpoint_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("bench: training checkpoint %s written in %.2f s\n", path.c_str(), checkpoint_seconds);
  }
  std::sort(step_seconds.begin(), step_seconds.end());
  const double median = step_seconds[step_seconds.size() / 2];
  const double tokens_per_second = static_cast<double>(micro_batch * sequence) / median;

  const double matmul_parameters =
      static_cast<double>(llama.num_hidden_layers) *
          (2.0 * llama.hidden_size * llama.num_attention_heads * llama.head_dim +
           2.0 * llama.hidden_size * llama.num_key_value_heads * llama.head_dim +
           3.0 * llama.hidden_size * llama.intermediate_size) +
      static_cast<double>(llama.hidden_size) * llama.vocab_size;
  const double attention = 4.0 * llama.num_hidden_layers * sequence * llama.num_attention_heads * llama.head_dim;
  const double flops_per_token = 4.0 * matmul_parameters + 3.0 * attention;
  const double peak = peak_flops(device);
  const double mfu = peak > 0 ? tokens_per_second * flops_per_token / peak : 0.0;

  quant = base.kind == trainer::BaseQuantization::kNf4 ? "qlora" : base.name;  // as tools/bench.sh names rows
  if (fake_quant) quant += lora_gradient == "identity" ? "+qat" : "+qat(" + lora_gradient + ")";
  if (recipe.lora.use_dora) quant += "+dora";
  std::printf("bench: %s %s + %s, %s compute on %s, micro-batch %lld x %lld, checkpointing %s, loss chunk %lld\n",
              shape.c_str(), quant.c_str(), optimizer_name.c_str(), dtype_name.c_str(), device.str().c_str(), static_cast<long long>(micro_batch),
              static_cast<long long>(sequence), checkpointing ? "on" : "off", static_cast<long long>(chunk));
  std::printf("  %.0f tokens/s (median of %lld steps, %.3f s each), MFU %.1f%%, peak memory %s\n", tokens_per_second,
              static_cast<long long>(steps), median, 100.0 * mfu, trainer::format_bytes(memory.peak_bytes).c_str());
  if (values["json"].as<bool>()) {
    std::cout << nlohmann::json{{"shape", shape},
                                {"quant", quant},
                                {"optim", optimizer_name},
                                {"dtype", dtype_name},
                                {"micro_batch", micro_batch},
                                {"seq", sequence},
                                {"checkpointing", checkpointing},
                                {"dora", recipe.lora.use_dora},
                                {"loss_chunk_tokens", chunk},
                                {"tokens_per_second", tokens_per_second},
                                {"mfu", mfu},
                                {"peak_memory_bytes", memory.peak_bytes},
                                {"step_seconds", median},
                                {"checkpoint_seconds", checkpoint_seconds}}
                     .dump()
              << std::endl;
  }
  return 0;
}

}  // namespace qtrain::tools
