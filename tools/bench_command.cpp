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

#include <fstream>
#include <functional>
#include <limits>

#ifdef QTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "kernels/error.h"
#include "data/batching.h"
#include "qat/float8_linear.h"
#include "qat/float8_matmul.h"
#include "qat/four_bit_linear.h"
#include "qat/int8_linear.h"
#include "qat/lora_linear.h"
#include "qat/qat_lora_matmul.h"
#include "tools/commands.h"
#include "tools/kernel_profile.h"
#include "trainer/base/device.h"
#include "trainer/base/memory_stats.h"
#include "trainer/formats/training_checkpoint.h"
#include "trainer/model/activation_offload.h"
#include "trainer/model/llama.h"
#include "trainer/model/llama_shapes.h"
#include "trainer/recipe/base_quantization.h"
#include "trainer/recipe/recipe_training.h"
#include "trainer/training_step.h"

namespace po = boost::program_options;

namespace qtrain::tools {

namespace {

constexpr double kGiB = double(1 << 30);

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

// One micro-batch of random tokens, on the CPU as the data loader hands them out. samples > 0:
// each row packs that many samples of equal length (the last takes the remainder), as
// data::collate marks packed rows: positions restart at each sample, whose first token is no label.
data::Batch random_batch(int64_t micro_batch, int64_t sequence, int64_t vocab_size, int64_t samples = 0) {
  data::Batch batch;
  batch.input_ids = torch::randint(vocab_size, {micro_batch, sequence}, torch::kInt64);
  batch.labels = batch.input_ids.clone();
  batch.input_tokens = micro_batch * sequence;
  batch.predicted_tokens = micro_batch * (sequence - 1);
  if (samples > 0) {
    const int64_t length = sequence / samples;
    const auto sample = torch::clamp_max(torch::div(torch::arange(sequence, torch::kInt64), length, "floor"), samples - 1);
    const auto position = torch::arange(sequence, torch::kInt64) - sample * length;
    batch.sample_ids = sample.unsqueeze(0).expand({micro_batch, -1}).contiguous();
    batch.position_ids = position.unsqueeze(0).expand({micro_batch, -1}).contiguous();
    batch.labels.masked_fill_((position == 0).unsqueeze(0).expand({micro_batch, -1}), data::kIgnoreLabel);
    batch.predicted_tokens = micro_batch * (sequence - samples);
  }
  return batch;
}

// The caching allocator may use `gib` GiB of the device at most: an 80 GB card on a larger one.
void limit_device_memory(const torch::Device& device, double gib) {
#ifdef QTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const double total = static_cast<double>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
    torch::empty({1}, torch::TensorOptions().device(device));  // the allocator starts with the first tensor
    c10::cuda::CUDACachingAllocator::setMemoryFraction(std::min(1.0, gib * kGiB / total), device.index());
    return;
  }
#endif
  throw Error(ErrorCode::kUsage, "--memory-limit-gib caps a GPU's memory; the device is " + device.str());
}

// Bytes the caching allocator can hand out on `device`: what the driver has free plus what the
// allocator holds already, within --memory-limit-gib.
double device_memory_budget(const torch::Device& device, double limit_gib) {
  double budget = 0;
#ifdef QTRAIN_WITH_CUDA
  const c10::cuda::CUDAGuard on_device(device.index());
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  budget = static_cast<double>(free) + trainer::memory_usage(device).reserved_bytes;
#endif
  return limit_gib > 0 ? std::min(budget, limit_gib * kGiB) : budget;
}

// MemAvailable of /proc/meminfo: what the host can still pin.
double host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

using Measure = std::function<std::pair<double, double>(int64_t tokens, int64_t untimed, int64_t timed)>;

// --max-context: the longest sequence of one micro-batch that trains. A step's peak grows about
// linearly with the tokens (flash attention, the fused loss, MLP chunks), but not exactly: kernels
// pick other workspaces at other lengths. So probes double from `probe` until one reaches a quarter
// of the length they predict, the last two give bytes per token and a fixed part, and the longest
// length under the device's budget (and, offloading, the host's) is tried, 10% shorter after each
// out-of-memory. Returns it with the median of its `steps` timed steps.
std::pair<int64_t, double> longest_context(const torch::Device& device, int64_t probe, int64_t steps, double limit_gib,
                                           const Measure& measure, const trainer::LlamaOptions& llama,
                                           torch::ScalarType dtype, bool offloading) {
  if (!device.is_cuda()) throw Error(ErrorCode::kUsage, "--max-context searches a GPU's memory; the device is " + device.str());
  const auto round_down = [](double tokens) { return std::max<int64_t>(static_cast<int64_t>(tokens) / 1024 * 1024, 1024); };
  // The caching allocator's large blocks fragment: keep 4% of the budget free.
  const double budget = 0.96 * device_memory_budget(device, limit_gib);
  std::string bound = "the device's memory";
  double host_longest = std::numeric_limits<double>::infinity();
  if (offloading) {
    // Every layer's input waits on the host; buffers pinned by the probes are reused.
    const double host_per_token = static_cast<double>(llama.num_hidden_layers * llama.hidden_size * c10::elementSize(dtype));
    host_longest = 0.9 * (host_available_bytes() + static_cast<double>(trainer::ActivationOffload::pinned_bytes())) /
                   host_per_token;
  }
  std::vector<std::pair<int64_t, double>> peaks;  // tokens, peak bytes
  int64_t longest = 0;
  for (int64_t tokens = probe;; tokens *= 2) {
    peaks.emplace_back(tokens, measure(tokens, peaks.empty() ? 1 : 0, 1).second);
    trainer::release_cached_memory(device);
    std::printf("bench: probe %lld tokens: peak %s\n", static_cast<long long>(tokens), trainer::format_bytes(peaks.back().second).c_str());
    std::fflush(stdout);
    if (peaks.size() < 2) continue;
    const auto& [shorter_tokens, shorter_peak] = peaks[peaks.size() - 2];
    const double per_token = (peaks.back().second - shorter_peak) / static_cast<double>(tokens - shorter_tokens);
    if (per_token <= 0) continue;  // too short to see the growth: probe longer
    const double fixed = shorter_peak - per_token * static_cast<double>(shorter_tokens);
    const double predicted = (budget - fixed) / per_token;
    longest = round_down(std::min(predicted, host_longest));
    if (host_longest < predicted) bound = "the host's memory (offloaded layer inputs)";
    if (4 * tokens >= longest) {
      std::printf("bench: %s a token over %s fixed; %s to use: try %lld tokens (bound by %s)\n",
                  trainer::format_bytes(per_token).c_str(), trainer::format_bytes(fixed).c_str(),
                  trainer::format_bytes(budget).c_str(), static_cast<long long>(longest), bound.c_str());
      std::fflush(stdout);
      break;
    }
  }
  for (int attempt = 0;; ++attempt) {
    try {
      const double pinned_before = trainer::ActivationOffload::pinning_seconds();
      double seconds = measure(longest, 0, steps).first;
      const double pinning = trainer::ActivationOffload::pinning_seconds() - pinned_before;
      if (pinning > 0 && steps == 1) {
        // A run pins its buffers once; the step it does that in is not what its steps take.
        std::printf("bench: the step at %lld tokens spent %.1f s pinning host memory; its time leaves that out\n",
                    static_cast<long long>(longest), pinning);
        seconds -= pinning;
      }
      return {longest, seconds};
    } catch (const std::exception& error) {
      // The device's out-of-memory, or the host's (pinning the offloaded inputs).
      const auto* ours = dynamic_cast<const Error*>(&error);
      if (attempt == 3 || (!dynamic_cast<const c10::OutOfMemoryError*>(&error) &&
                           !(ours && ours->code() == ErrorCode::kOutOfMemory))) {
        throw;
      }
      std::printf("bench: %lld tokens ran out of memory; trying 10%% fewer\n", static_cast<long long>(longest));
      std::fflush(stdout);
      longest = round_down(0.9 * static_cast<double>(longest));
      trainer::release_cached_memory(device);
    }
  }
}

}  // namespace

int run_bench(const Arguments& arguments) {
  std::string shape, quant, dtype_name, device_name, checkpoint_run, optimizer_name, trace_path, lora_gradient;
  int64_t micro_batch = 0, sequence = 0, steps = 0, warmup = 0, lora_rank = 0, loss_chunk = 0, profile_steps = 0;
  int64_t mlp_chunk = 0, packed_samples = 0, checkpoint_every = 1;
  double memory_limit_gib = 0;
  po::options_description options("bench options");
  options.add_options()
      ("shape", po::value(&shape)->default_value("llama3-8b"),
       "llama3-8b, llama3-1b, qwen3-8b, qwen2.5-7b, mistral-7b, gemma2-9b, gemma3-12b, phi4-mini or tiny (random weights)")
      ("quant", po::value(&quant)->default_value("qlora"),
       "the frozen base: qlora (= nf4, double-quant), nf4, fp4, int8 (LLM.int8, threshold 6), fp8 (e4m3 rows, FP8 "
       "tensor cores) or none (16-bit)")
      ("optim", po::value(&optimizer_name)->default_value("adamw"), "adamw or adamw8bit")
      ("micro-batch", po::value(&micro_batch)->default_value(1), "sequences per step")
      ("seq", po::value(&sequence)->default_value(2048), "tokens per sequence")
      ("checkpointing", po::bool_switch(), "recompute every decoder layer in backward")
      ("checkpoint-every", po::value(&checkpoint_every)->default_value(1),
       "with --checkpointing: only every K-th decoder layer (train.gradient_checkpointing_every)")
      ("offload-activations", po::bool_switch(), "with --checkpointing: the layers' inputs wait in pinned host memory "
       "(train.offload_activations)")
      ("mlp-chunk", po::value(&mlp_chunk)->default_value(0), "MLP chunk tokens (train.mlp_chunk_tokens); 0: whole")
      ("unfused-loss", po::bool_switch(), "each loss chunk's whole logits (train.fused_loss: false)")
      ("packed-samples", po::value(&packed_samples)->default_value(0),
       "pack each sequence with this many samples of equal length (attention stays inside each); 0: unpacked")
      ("packed-mask", po::bool_switch(), "with --packed-samples: SDPA over the written-out block-causal mask instead "
       "of flash attention over the samples' spans (to compare)")
      ("rebuild-weights", po::bool_switch(), "with --checkpointing: dequantize again in backward instead of keeping "
       "a recomputed layer's weights (train.keep_built_weights: false)")
      ("embeddings-on-host", po::bool_switch(), "the input embedding table stays on the host (train.embeddings_on_host)")
      ("lm-head-on-host", po::bool_switch(), "lm_head waits on the host and visits the device for the loss "
       "(train.lm_head_on_host)")
      ("optimizer-states-on-host", po::bool_switch(), "the optimizer's state waits on the host between steps "
       "(train.optimizer_states_on_host)")
      ("max-context", po::bool_switch(),
       "find the longest sequence one micro-batch trains in the GPU's memory: measure the peak at two lengths, "
       "extrapolate, then train at the longest that fits (stepping down on out-of-memory); prints its tokens/s")
      ("memory-limit-gib", po::value(&memory_limit_gib)->default_value(0.0),
       "cap the device memory the caching allocator may use (e.g. 79 to act as an 80 GB card on a larger one); "
       "0: the whole device")
      ("dora", po::bool_switch(), "DoRA adapters (lora.use_dora) instead of LoRA")
      ("fp8-fast-accumulation", po::bool_switch(), "with --quant fp8 or --fp8-compute: the forward's FP8 matmuls "
       "unpromoted (qlora.fp8_fast_accumulation)")
      ("fp8-compute", po::bool_switch(), "with a 4-bit --quant: the adapted projections multiply on FP8 tensor cores, "
       "dequantizing to e4m3 rows; with --quant none: from e4m3 rows of the 16-bit weights, which wait on the host "
       "(qlora.fp8_compute)")
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
  recipe.qlora.fp8_fast_accumulation = values["fp8-fast-accumulation"].as<bool>();
  recipe.qlora.fp8_compute = values["fp8-compute"].as<bool>();
  recipe.qat.lora_gradient = lora_gradient;
  recipe.train.offload_activations = values["offload-activations"].as<bool>();
  recipe.train.mlp_chunk_tokens = mlp_chunk;
  recipe.train.fused_loss = !values["unfused-loss"].as<bool>();
  recipe.train.keep_built_weights = !values["rebuild-weights"].as<bool>();
  recipe.train.embeddings_on_host = values["embeddings-on-host"].as<bool>();
  recipe.train.lm_head_on_host = values["lm-head-on-host"].as<bool>();
  recipe.train.optimizer_states_on_host = values["optimizer-states-on-host"].as<bool>();
  if (checkpoint_every < 1) throw Error(ErrorCode::kUsage, "--checkpoint-every must be >= 1");
  if (checkpoint_every > 1 && !checkpointing) {
    throw Error(ErrorCode::kUsage, "--checkpoint-every picks the layers --checkpointing recomputes: add --checkpointing");
  }
  recipe.train.gradient_checkpointing_every = checkpoint_every;
  if (recipe.train.offload_activations && !checkpointing) {
    throw Error(ErrorCode::kUsage, "--offload-activations moves what --checkpointing keeps: add --checkpointing");
  }
  if (packed_samples < 0 || packed_samples > sequence) throw Error(ErrorCode::kUsage, "--packed-samples must be 0..--seq");
  if (values["packed-mask"].as<bool>() && packed_samples == 0) {
    throw Error(ErrorCode::kUsage, "--packed-mask compares packed attention: add --packed-samples");
  }
  const bool max_context = values["max-context"].as<bool>();
  if (max_context && packed_samples > 0) throw Error(ErrorCode::kUsage, "--max-context measures one unpacked sequence");
  if (max_context && micro_batch != 1) throw Error(ErrorCode::kUsage, "--max-context measures one sequence: --micro-batch 1");
  if (memory_limit_gib > 0) limit_device_memory(device, memory_limit_gib);
  if (base.kind == trainer::BaseQuantization::kFp8) qat::require_float8_tensor_cores(device, dtype, "--quant fp8", "--dtype");
  const bool four_bit = base.kind == trainer::BaseQuantization::kNf4 || base.kind == trainer::BaseQuantization::kFp4;
  if (recipe.qlora.fp8_compute && !four_bit && base.kind != trainer::BaseQuantization::kNone) {
    throw Error(ErrorCode::kUsage, "--fp8-compute needs a 4-bit (qlora, nf4, fp4) or 16-bit (none) --quant");
  }
  if (recipe.qlora.fp8_compute) qat::require_float8_tensor_cores(device, dtype, "--fp8-compute", "--dtype");
  if (recipe.qlora.fp8_fast_accumulation && base.kind != trainer::BaseQuantization::kFp8 && !recipe.qlora.fp8_compute) {
    throw Error(ErrorCode::kUsage, "--fp8-fast-accumulation needs --quant fp8 or --fp8-compute");
  }

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
      case trainer::BaseQuantization::kFp4: {
        auto layer = std::make_shared<qat::FourBitLinear>(
            random_four_bit(linear.out_features, linear.in_features, tables, device, dtype), bias, dtype);
        if (recipe.qlora.fp8_compute) layer->multiply_on_float8(recipe.qlora.fp8_fast_accumulation);
        return layer;
      }
      case trainer::BaseQuantization::kInt8:
        return random_int8(linear.out_features, linear.in_features, bias, device, dtype);
      case trainer::BaseQuantization::kNone:
        if (!recipe.qlora.fp8_compute) break;
        [[fallthrough]];  // e4m3 rows as the FP8 base's, the 16-bit weights kept on the host
      case trainer::BaseQuantization::kFp8:
        return qat::Float8Linear::from_dense(
            torch::randn({linear.out_features, linear.in_features}, on_device) * 0.02, bias,
            {dtype, device, recipe.qlora.fp8_fast_accumulation,
             /*keep_dense_weight_on_host=*/base.kind == trainer::BaseQuantization::kNone});
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
  trainer::apply_recipe_memory_settings(*model, recipe);
  auto optimizer = trainer::recipe_optimizer(recipe, trained.tensors);
  trainer::LossScaler scaler(/*enabled=*/dtype == torch::kFloat16);
  auto step_options = trainer::training_step_options(recipe, llama.vocab_size, device);
  if (loss_chunk < 0) step_options.loss_chunk_tokens = -1;
  if (values["packed-mask"].as<bool>()) step_options.packed_attention = trainer::PackedAttention::kWrittenOutMask;
  const int64_t chunk = step_options.loss_chunk_tokens;
  trainer::TrainingStep train_step(*model, trained.tensors, *optimizer, scaler, step_options);
  synchronize(device);
  std::printf("bench: model built in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - build_start).count());
  std::fflush(stdout);

  int64_t next_step = 0;
  // `timed` steps of `tokens`-long sequences after `untimed` ones: the median step time and the
  // peak memory of the timed steps.
  const auto measure = [&](int64_t tokens, int64_t untimed, int64_t timed) {
    const std::vector<data::Batch> batches = {random_batch(micro_batch, tokens, llama.vocab_size, packed_samples)};
    std::vector<double> seconds;
    trainer::reset_peak_memory(device);
    for (int64_t step = 0; step < untimed + timed; ++step) {
      if (step == untimed) trainer::reset_peak_memory(device);
      synchronize(device);
      const auto start = std::chrono::steady_clock::now();
      train_step.run(batches, next_step++);
      synchronize(device);
      if (step >= untimed) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(seconds.begin(), seconds.end());
    return std::make_pair(seconds[seconds.size() / 2], trainer::memory_usage(device).peak_bytes);
  };
  double median = 0;
  if (max_context) {
    const auto found = longest_context(device, sequence, steps, memory_limit_gib, measure, llama, dtype,
                                       recipe.train.offload_activations);
    sequence = found.first;
    median = found.second;
  } else {
    median = measure(sequence, warmup, steps).first;
  }
  const std::vector<data::Batch> batches = {random_batch(micro_batch, sequence, llama.vocab_size, packed_samples)};
  const auto memory = trainer::memory_usage(device);
  if (profile_steps > 0) {
    KernelProfile profile(device.is_cuda());
    for (int64_t step = 0; step < profile_steps; ++step) train_step.run(batches, next_step++);
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
    train_step.settle_optimizer_state();
    checkpoint.optimizer = optimizer->state();
    checkpoint.state = {{"step", next_step}};
    const auto start = std::chrono::steady_clock::now();
    const auto path = trainer::write_training_checkpoint(checkpoint_run, next_step, checkpoint);
    checkpoint_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("bench: training checkpoint %s written in %.2f s\n", path.c_str(), checkpoint_seconds);
  }
  const double tokens_per_second = static_cast<double>(micro_batch * sequence) / median;

  const double matmul_parameters =
      static_cast<double>(llama.num_hidden_layers) *
          (2.0 * llama.hidden_size * llama.num_attention_heads * llama.head_dim +
           2.0 * llama.hidden_size * llama.num_key_value_heads * llama.head_dim +
           3.0 * llama.hidden_size * llama.intermediate_size) +
      static_cast<double>(llama.hidden_size) * llama.vocab_size;
  // A token attends within its sample: packed rows do less attention work than one long sequence.
  const double attended = packed_samples > 0 ? static_cast<double>(sequence) / packed_samples : sequence;
  const double attention = 4.0 * llama.num_hidden_layers * attended * llama.num_attention_heads * llama.head_dim;
  const double flops_per_token = 4.0 * matmul_parameters + 3.0 * attention;
  const double peak = peak_flops(device);
  const double mfu = peak > 0 ? tokens_per_second * flops_per_token / peak : 0.0;

  quant = base.kind == trainer::BaseQuantization::kNf4 ? "qlora" : base.name;  // as tools/bench.sh names rows
  if (fake_quant) quant += lora_gradient == "identity" ? "+qat" : "+qat(" + lora_gradient + ")";
  if (recipe.lora.use_dora) quant += "+dora";
  if (recipe.qlora.fp8_compute) quant += "+fp8-compute";
  if (recipe.qlora.fp8_fast_accumulation) quant += "+fast-accumulation";
  std::printf("bench: %s %s + %s, %s compute on %s, micro-batch %lld x %lld, checkpointing %s%s, loss chunk %lld%s%s\n",
              shape.c_str(), quant.c_str(), optimizer_name.c_str(), dtype_name.c_str(), device.str().c_str(), static_cast<long long>(micro_batch),
              static_cast<long long>(sequence),
              !checkpointing ? "off" : checkpoint_every == 1 ? "on" : ("every " + std::to_string(checkpoint_every) + " layers").c_str(),
              recipe.train.offload_activations ? " (inputs offloaded)" : "", static_cast<long long>(chunk),
              recipe.train.fused_loss ? " (fused)" : "",
              mlp_chunk > 0 ? (", MLP chunk " + std::to_string(mlp_chunk)).c_str() : "");
  if (packed_samples > 0) {
    std::printf("  packed: %lld samples a sequence, attention %s\n", static_cast<long long>(packed_samples),
                values["packed-mask"].as<bool>() ? "over the written-out block-causal mask" : "over the samples' spans");
  }
  if (recipe.train.offload_activations) {
    std::printf("  pinned host memory: %s (pinning took %.1f s in all, in the first step at each length)\n",
                trainer::format_bytes(static_cast<double>(trainer::ActivationOffload::pinned_bytes())).c_str(),
                trainer::ActivationOffload::pinning_seconds());
  }
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
                                {"offload_activations", recipe.train.offload_activations},
                                {"mlp_chunk_tokens", mlp_chunk},
                                {"packed_samples", packed_samples},
                                {"packed_mask", values["packed-mask"].as<bool>()},
                                {"fused_loss", recipe.train.fused_loss},
                                {"keep_built_weights", recipe.train.keep_built_weights},
                                {"embeddings_on_host", recipe.train.embeddings_on_host},
                                {"lm_head_on_host", recipe.train.lm_head_on_host},
                                {"optimizer_states_on_host", recipe.train.optimizer_states_on_host},
                                {"checkpoint_every", checkpointing ? checkpoint_every : 0},
                                {"max_context", max_context},
                                {"pinned_host_bytes", trainer::ActivationOffload::pinned_bytes()},
                                {"pinning_seconds", trainer::ActivationOffload::pinning_seconds()},
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
