// The fused CUDA RMSNorm (Llama's and Gemma's), rotary embedding, SwiGLU and GeGLU (trainer/model/llama_layers.h) against the torch
// operations of transformers' modeling_llama.py on the same GPU, forward and backward, on fresh
// random inputs in bf16, fp16 and fp32. Tolerance: one step of the dtype relative to each value
// (the kernels round where the operations round; what may differ is the order of RMSNorm's fp32
// sum and the fused multiply-adds), plus, for gradients that come out of a cancellation
// (RMSNorm's), that step relative to the largest value. The rotary embedding rounds exactly as
// the operations do and must be equal, and so must split_rotary_qkv (a fused qkv projection's
// output split and turned by one function) and the narrow / view / rotary_embedding composition it
// replaces. On the CPU every function is the reference itself.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

#include "kernels/cuda_build.h"
#include "kernels/error.h"
#include "kernels/llama_layers.h"
#include "qat/lora_linear.h"
#include "small_llama.h"
#include "trainer/model/llama.h"
#include "trainer/model/llama_layers.h"

namespace qtrain::trainer {
namespace {

#define SKIP_WITHOUT_CUDA()                                                          \
  if (!kernels::kCudaKernelsBuilt) GTEST_SKIP() << "built without the CUDA kernels"; \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine"

const torch::ScalarType kDtypes[] = {torch::kBFloat16, torch::kHalf, torch::kFloat32};

// fp32's: 8 of its steps, for sums taken in another order and contracted multiply-adds.
double step_of(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 ? 1.0 / 128 : dtype == torch::kHalf ? 1.0 / 1024 : 1e-6;
}

// The spread for fp32, where cancellations leave values far below their operands.
double fp32_spread(torch::ScalarType dtype, double spread) { return dtype == torch::kFloat32 ? std::max(spread, 1e-2) : spread; }

// |actual - expected| <= steps x step (|expected| + spread max|expected| + magnitude) everywhere;
// `magnitude` (defined or not) adds a scale of each value's own.
void expect_within_steps(const torch::Tensor& actual, const torch::Tensor& expected, double spread,
                         const std::string& what, double steps = 1.0, const torch::Tensor& magnitude = {}) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const auto a = actual.to(torch::kFloat64).cpu();
  const auto e = expected.to(torch::kFloat64).cpu();
  const double step = steps * step_of(actual.scalar_type());
  auto allowed = step * (e.abs() + spread * e.abs().max());
  if (magnitude.defined()) allowed = allowed + step * magnitude.to(torch::kFloat64).cpu();
  const auto excess = ((a - e).abs() - allowed).max().item<double>();
  const auto worst = ((a - e).abs() - allowed).argmax().item<int64_t>();
  EXPECT_LE(excess, 0.0) << what << ": max |difference| " << (a - e).abs().max().item<double>() << "; worst at "
                         << worst << ": " << a.flatten()[worst].item<double>() << " vs " << e.flatten()[worst].item<double>();
}

struct Outcome {
  torch::Tensor output;
  std::vector<torch::Tensor> grads;
};

// Runs `layer` on leaf copies of `inputs` and backpropagates `grad_output`.
Outcome run_layer(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& layer,
            const std::vector<torch::Tensor>& inputs, const torch::Tensor& grad_output) {
  std::vector<torch::Tensor> leaves;
  for (const auto& input : inputs) leaves.push_back(input.detach().clone().requires_grad_(true));
  auto output = layer(leaves);
  output.backward(grad_output);
  Outcome outcome{output.detach(), {}};
  for (const auto& leaf : leaves) outcome.grads.push_back(leaf.grad());
  return outcome;
}

torch::TensorOptions on_cuda(torch::ScalarType dtype) { return torch::TensorOptions().dtype(dtype).device(torch::kCUDA); }

// A fused qkv projection's output [batch, seq, (heads + 2 key_value_heads) * head_dim] (Phi-3) and
// the rotary tables [batch, seq, rotary_dim] its query and key turn by.
struct QkvShape {
  int64_t batch, sequence, heads, key_value_heads, head_dim, rotary_dim;
};

std::string describe_qkv(const QkvShape& shape, torch::ScalarType dtype) {
  return std::string(c10::toString(dtype)) + " [" + std::to_string(shape.batch) + ", " + std::to_string(shape.sequence) +
         "], " + std::to_string(shape.heads) + " / " + std::to_string(shape.key_value_heads) + " heads of " +
         std::to_string(shape.head_dim) + ", " + std::to_string(shape.rotary_dim) + " turned";
}

// Random fused outputs, tables for random angles per position, and one gradient per attention input
// in attention's [batch, heads, seq, head_dim] layout.
struct QkvInputs {
  torch::Tensor fused, cos, sin;
  std::vector<torch::Tensor> grads;
};

QkvInputs random_qkv_inputs(const QkvShape& shape, const torch::TensorOptions& options) {
  QkvInputs inputs;
  const int64_t width = (shape.heads + 2 * shape.key_value_heads) * shape.head_dim;
  inputs.fused = (torch::randn({shape.batch, shape.sequence, width}) * 2).to(options);
  const auto angles = torch::rand({shape.batch, shape.sequence, shape.rotary_dim / 2}) * 100;
  inputs.cos = torch::cat({angles.cos(), angles.cos()}, -1).to(options);
  inputs.sin = torch::cat({angles.sin(), angles.sin()}, -1).to(options);
  for (const int64_t heads : {shape.heads, shape.key_value_heads, shape.key_value_heads}) {
    inputs.grads.push_back(torch::randn({shape.batch, heads, shape.sequence, shape.head_dim}).to(options));
  }
  return inputs;
}

// The attention's query, key and value [batch, heads, seq, head_dim] as it made them before
// split_rotary_qkv: narrow, view per head, rotary_embedding, transpose.
std::vector<torch::Tensor> qkv_by_composition(const torch::Tensor& fused, const QkvInputs& inputs, const QkvShape& shape) {
  const int64_t query_width = shape.heads * shape.head_dim;
  const int64_t key_value_width = shape.key_value_heads * shape.head_dim;
  const auto query = fused.narrow(-1, 0, query_width).view({shape.batch, shape.sequence, shape.heads, shape.head_dim});
  const auto key =
      fused.narrow(-1, query_width, key_value_width).view({shape.batch, shape.sequence, shape.key_value_heads, shape.head_dim});
  const auto value = fused.narrow(-1, query_width + key_value_width, key_value_width)
                         .view({shape.batch, shape.sequence, shape.key_value_heads, shape.head_dim});
  return {rotary_embedding(query, inputs.cos, inputs.sin).transpose(1, 2),
          rotary_embedding(key, inputs.cos, inputs.sin).transpose(1, 2), value.transpose(1, 2)};
}

// The same through split_rotary_qkv, as the attention makes them now.
std::vector<torch::Tensor> qkv_by_split(const torch::Tensor& fused, const QkvInputs& inputs, const QkvShape& shape) {
  const auto split = split_rotary_qkv(fused, inputs.cos, inputs.sin, shape.heads, shape.key_value_heads, shape.head_dim);
  return {split.query.transpose(1, 2), split.key.transpose(1, 2), split.value.transpose(1, 2)};
}

struct QkvOutcome {
  std::vector<torch::Tensor> outputs;  // query, key, value
  torch::Tensor grad;                  // of the fused output
};

// Runs `attention_inputs` on a leaf copy of the fused output and backpropagates inputs.grads.
QkvOutcome run_qkv(const std::function<std::vector<torch::Tensor>(const torch::Tensor&, const QkvInputs&, const QkvShape&)>&
                       attention_inputs,
                   const QkvInputs& inputs, const QkvShape& shape) {
  auto fused = inputs.fused.detach().clone().requires_grad_(true);
  const auto outputs = attention_inputs(fused, inputs, shape);
  torch::autograd::backward(outputs, inputs.grads);
  QkvOutcome outcome{{}, fused.grad()};
  for (const auto& output : outputs) outcome.outputs.push_back(output.detach());
  return outcome;
}

const char* const kQkvNames[] = {"query", "key", "value"};

// Row shapes the fused RMSNorm spreads differently over threads (kernels/rms_norm.cu). It reads rows
// in 16-byte packs, or value by value where the width is no whole number of packs (100, 3077 and 3084
// in bf16 and fp16) or no row starts on 16 bytes (x one value into its storage); a row is held by a
// few lanes of a warp, several rows to a block and the last block not full (64, 100, 128 as Qwen3's
// per-head norms, 384, and 1000 in bf16 and fp16), by a block (1000 in fp32, 4096, 5120), or is
// longer than a block holds (3077, 3084 and 5120 value by value, 33000).
struct RmsNormShape {
  std::vector<int64_t> sizes;   // x's, the width last
  bool one_value_into_storage;  // x a view one value into a larger storage, as a slice of another tensor
};

const RmsNormShape kRmsNormShapes[] = {
    {{3, 37, 1000}, false}, {{4, 50, 64}, false}, {{5000, 128}, false}, {{5000, 128}, true},
    {{64, 384}, false},     {{37, 100}, false},   {{8, 4096}, false},   {{9, 3084}, false},
    {{7, 3077}, false},     {{16, 5120}, false},  {{16, 5120}, true},   {{3, 33000}, false}};

std::string describe_rms_norm(const RmsNormShape& shape, torch::ScalarType dtype) {
  return c10::str(dtype, " ", c10::IntArrayRef(shape.sizes), shape.one_value_into_storage ? " one value into its storage" : "");
}

// x as the fused function gets it: itself, or a copy placed one value into a larger storage, so that
// no row starts on 16 bytes (the gradient still reaches x).
torch::Tensor placed(const RmsNormShape& shape, const torch::Tensor& x) {
  if (!shape.one_value_into_storage) return x;
  return torch::cat({x.new_zeros({1}), x.flatten()}).narrow(0, 1, x.numel()).view(x.sizes());
}

TEST(LlamaLayersCuda, RmsNormMatchesTheReferenceForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  for (const auto& shape : kRmsNormShapes) {
    const int64_t width = shape.sizes.back();
    for (const auto dtype : kDtypes) {
      torch::manual_seed(21);
      const auto x = (torch::randn(shape.sizes) * 3).to(on_cuda(dtype));
      const auto weight = (1 + 0.1 * torch::randn({width})).to(on_cuda(dtype));
      const auto grad = torch::randn(shape.sizes).to(on_cuda(dtype));
      const auto fused =
          run_layer([&](const auto& in) { return rms_norm(placed(shape, in[0]), in[1], 1e-5); }, {x, weight}, grad);
      const auto expected = run_layer([](const auto& in) { return rms_norm_reference(in[0], in[1], 1e-5); }, {x, weight}, grad);
      const std::string name = describe_rms_norm(shape, dtype);
      // Two roundings (the normalized value, then the product): an rstd one fp32 step away can move
      // the first by a step, and the product then rounds again.
      expect_within_steps(fused.output, expected.output, fp32_spread(dtype, 0.0), "RMSNorm output " + name, 2.0);
      expect_within_steps(fused.grads[0], expected.grads[0], fp32_spread(dtype, 0.05), "RMSNorm input gradient " + name);
      // The weight gradient, sum over rows of dy * normalized, against float64: autograd rounds each
      // product to the dtype before summing, the fused path sums fp32 products (closer), so both
      // are held to the exact sum of the rounded normalized values.
      const auto x32 = x.to(torch::kFloat32).reshape({-1, width});
      const auto normalized = (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + 1e-5)).to(dtype);
      const auto products = grad.reshape({-1, width}).to(torch::kFloat64) * normalized.to(torch::kFloat64);
      const auto exact = products.sum(0);
      // fp32: sums over the rows of products of either sign, taken in another order than float64's.
      // Each rounded normalized value may round the other way (an rstd one fp32 step away): a step
      // of each product's size, which a sum over a few rows does not average out.
      expect_within_steps(fused.grads[1], exact.to(dtype), dtype == torch::kFloat32 ? 1.0 : 0.01,
                          "RMSNorm weight gradient " + name, 1.0, products.abs().sum(0));
    }
  }
}

// Gemma's (1 + w) RMSNorm: one rounding (the product, in fp32, to the dtype), so one step; the
// input gradient as Llama's. The weight gradient (full fine-tuning) is held to the float64 sum of
// dy * n with n unrounded, as autograd differentiates the fp32 product.
TEST(LlamaLayersCuda, GemmaRmsNormMatchesTheReferenceForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  for (const auto& shape : kRmsNormShapes) {
    const int64_t width = shape.sizes.back();
    for (const auto dtype : kDtypes) {
      torch::manual_seed(26);
      const auto x = (torch::randn(shape.sizes) * 3).to(on_cuda(dtype));
      const auto weight = (0.3 * torch::randn({width})).to(on_cuda(dtype));  // around Gemma's zero init
      const auto grad = torch::randn(shape.sizes).to(on_cuda(dtype));
      const auto fused = run_layer([&](const auto& in) { return unit_offset_rms_norm(placed(shape, in[0]), in[1], 1e-6); },
                                   {x, weight}, grad);
      const auto expected =
          run_layer([](const auto& in) { return unit_offset_rms_norm_reference(in[0], in[1], 1e-6); }, {x, weight}, grad);
      const std::string name = describe_rms_norm(shape, dtype);
      expect_within_steps(fused.output, expected.output, fp32_spread(dtype, 0.0), "Gemma RMSNorm output " + name);
      expect_within_steps(fused.grads[0], expected.grads[0], fp32_spread(dtype, 0.05), "Gemma RMSNorm input gradient " + name);
      const auto x32 = x.to(torch::kFloat32).reshape({-1, width});
      const auto normalized = x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + 1e-6);
      const auto exact = (grad.reshape({-1, width}).to(torch::kFloat64) * normalized.to(torch::kFloat64)).sum(0);
      expect_within_steps(fused.grads[1], exact.to(dtype), dtype == torch::kFloat32 ? 1.0 : 0.01,
                          "Gemma RMSNorm weight gradient " + name);
    }
  }
}

TEST(LlamaLayersCuda, RotaryEmbeddingEqualsTheReferenceForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  for (const auto dtype : kDtypes) {
    torch::manual_seed(22);
    const auto x = torch::randn({2, 33, 4, 64}).to(on_cuda(dtype));
    const auto angles = torch::rand({2, 33, 32}) * 100;
    const auto cos = torch::cat({angles.cos(), angles.cos()}, -1).to(on_cuda(dtype));
    const auto sin = torch::cat({angles.sin(), angles.sin()}, -1).to(on_cuda(dtype));
    const auto grad = torch::randn({2, 33, 4, 64}).to(on_cuda(dtype));
    const auto fused = run_layer([&](const auto& in) { return rotary_embedding(in[0], cos, sin); }, {x}, grad);
    const auto expected = run_layer([&](const auto& in) { return rotary_embedding_reference(in[0], cos, sin); }, {x}, grad);
    const std::string name = c10::toString(dtype);
    // fp32 products may be contracted into a fused multiply-add: one step there.
    if (dtype == torch::kFloat32) {
      expect_within_steps(fused.output, expected.output, fp32_spread(dtype, 0.0), "rotary output " + name);
      expect_within_steps(fused.grads[0], expected.grads[0], fp32_spread(dtype, 0.0), "rotary gradient " + name);
    } else {
      EXPECT_TRUE(torch::equal(fused.output, expected.output)) << "rotary output " << name;
      EXPECT_TRUE(torch::equal(fused.grads[0], expected.grads[0])) << "rotary gradient " << name;
    }
  }
}

// SwiGLU and Gemma's GeGLU: the activation rounded to the dtype, then the product.
TEST(LlamaLayersCuda, GatedActivationsMatchTheReferenceForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  using Gated = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&);
  for (const auto& [name, fused_path, reference] : {std::tuple<std::string, Gated, Gated>{"SwiGLU", swiglu, swiglu_reference},
                                                   std::tuple<std::string, Gated, Gated>{"GeGLU", geglu, geglu_reference}}) {
    // 999 columns take the one-value kernel, 1024 the 16-byte one.
    for (const auto& [dtype, width] : {std::pair{torch::kBFloat16, 999}, std::pair{torch::kBFloat16, 1024},
                                       std::pair{torch::kHalf, 1024}, std::pair{torch::kFloat32, 999},
                                       std::pair{torch::kFloat32, 1024}}) {
      torch::manual_seed(23);
      const auto gate = (torch::randn({5, width}) * 4).to(on_cuda(dtype));
      const auto up = torch::randn({5, width}).to(on_cuda(dtype));
      const auto grad = torch::randn({5, width}).to(on_cuda(dtype));
      const auto fused = run_layer([path = fused_path](const auto& in) { return path(in[0], in[1]); }, {gate, up}, grad);
      const auto expected = run_layer([path = reference](const auto& in) { return path(in[0], in[1]); }, {gate, up}, grad);
      const std::string what = name + " " + c10::toString(dtype) + " x " + std::to_string(width);
      expect_within_steps(fused.output, expected.output, fp32_spread(dtype, 0.0), what + " output");
      expect_within_steps(fused.grads[0], expected.grads[0], fp32_spread(dtype, 1e-3), what + " gate gradient");
      expect_within_steps(fused.grads[1], expected.grads[1], fp32_spread(dtype, 0.0), what + " up gradient");
    }
  }
}

// A fused gate_up projection's output (Phi-3 / Phi-4-mini) read in place: the same bits, forward and
// backward, as the pair kernels on its two halves, which the test above holds to the reference; one
// gradient [rows, 2 * width] whose halves are theirs.
TEST(LlamaLayersCuda, GatedActivationsOfAFusedProjectionEqualThePairKernelsOnItsHalves) {
  SKIP_WITHOUT_CUDA();
  using Pair = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&);
  using Fused = torch::Tensor (*)(const torch::Tensor&);
  for (const auto& [name, fused_path, pair] : {std::tuple<std::string, Fused, Pair>{"SwiGLU", swiglu_of_fused, swiglu},
                                              std::tuple<std::string, Fused, Pair>{"GeGLU", geglu_of_fused, geglu}}) {
    // 999 columns per half take the one-value kernel, 1024 the 16-byte one; [2, 3, ...] rows as a batch.
    for (const auto& [dtype, width] : {std::pair{torch::kBFloat16, 999}, std::pair{torch::kBFloat16, 1024},
                                       std::pair{torch::kHalf, 1024}, std::pair{torch::kFloat32, 1024}}) {
      torch::manual_seed(26);
      const auto gate_up = (torch::randn({2, 3, 2 * width}) * 3).to(on_cuda(dtype));
      const auto grad = torch::randn({2, 3, width}).to(on_cuda(dtype));
      const auto fused = run_layer([path = fused_path](const auto& in) { return path(in[0]); }, {gate_up}, grad);
      const auto halves = run_layer(
          [path = pair](const auto& in) { return path(in[0].contiguous(), in[1].contiguous()); },
          {gate_up.narrow(-1, 0, width), gate_up.narrow(-1, width, width)}, grad);
      const std::string what = name + " " + c10::toString(dtype) + " x " + std::to_string(width);
      EXPECT_TRUE(torch::equal(fused.output, halves.output)) << what << " output";
      EXPECT_TRUE(torch::equal(fused.grads[0], torch::cat({halves.grads[0], halves.grads[1]}, -1))) << what << " gradient";
    }
  }
}

// The gated product's place in autograd's graph with its values unwritten (a checkpointed layer's
// recomputation, gated_activation_for_graph): the gradients of the computed product bit for bit,
// on the pair and fused kernels (CUDA) and the torch operations (CPU), SwiGLU and GeGLU.
void expect_unwritten_products_gradients_bitwise(torch::Device device, torch::ScalarType dtype) {
  for (const bool gelu : {false, true}) {
    for (const bool fused : {false, true}) {
      torch::manual_seed(31);
      const int64_t width = 1024;
      const auto options = torch::TensorOptions().dtype(dtype).device(device);
      const auto gate_up = torch::randn({2, 3, 2 * width}, options) * 3;
      const auto grad = torch::randn({2, 3, width}, options);
      const auto gate = gate_up.narrow(-1, 0, width).contiguous(), up = gate_up.narrow(-1, width, width).contiguous();
      const auto written = run_layer(
          [&](const auto& in) {
            return fused ? (gelu ? geglu_of_fused(in[0]) : swiglu_of_fused(in[0])) : (gelu ? geglu(in[0], in[1]) : swiglu(in[0], in[1]));
          },
          fused ? std::vector<torch::Tensor>{gate_up} : std::vector<torch::Tensor>{gate, up}, grad);
      const auto unwritten = run_layer(
          [&](const auto& in) { return gated_activation_for_graph(gelu, in[0], fused ? torch::Tensor() : in[1]); },
          fused ? std::vector<torch::Tensor>{gate_up} : std::vector<torch::Tensor>{gate, up}, grad);
      const std::string what = std::string(gelu ? "GeGLU" : "SwiGLU") + (fused ? " fused" : " pair") + " on " + device.str();
      EXPECT_EQ(unwritten.output.sizes(), written.output.sizes()) << what;
      for (size_t index = 0; index < written.grads.size(); ++index) {
        EXPECT_TRUE(torch::equal(unwritten.grads[index], written.grads[index])) << what << " gradient " << index;
      }
    }
  }
}

TEST(LlamaLayers, AnUnwrittenGatedProductGivesTheComputedOnesGradientsBitwise) {
  expect_unwritten_products_gradients_bitwise(torch::kCPU, torch::kFloat32);
}

TEST(LlamaLayersCuda, AnUnwrittenGatedProductGivesTheComputedOnesGradientsBitwise) {
  SKIP_WITHOUT_CUDA();
  expect_unwritten_products_gradients_bitwise(torch::Device(torch::kCUDA, 0), torch::kBFloat16);
}

// Phi-3 / Phi-4-mini's fused qkv_proj output split and turned by one function: the outputs and the
// fused output's one gradient bit for bit those of the composition the attention ran before
// (narrow, view per head, rotary_embedding, transpose) on the same GPU tensors, whose rotary
// kernel the tests above hold to the reference. Full and partial rotary (Phi-4-mini: 24 query and
// 8 key/value heads of 128, 96 dimensions turned), odd lengths, one decoded token; contiguous
// outputs ([batch, seq, heads, head_dim], what flash attention reads without a copy).
TEST(LlamaLayersCuda, SplitRotaryQkvEqualsTheCompositionForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  const QkvShape shapes[] = {
      {2, 33, 6, 2, 64, 64},    // full rotary
      {2, 17, 4, 2, 96, 64},    // partial
      {2, 9, 24, 8, 128, 96},   // Phi-4-mini (partial_rotary_factor 0.75)
      {1, 1, 24, 8, 128, 96},   // one decoded token
  };
  for (const auto dtype : kDtypes) {
    for (const auto& shape : shapes) {
      const std::string what = describe_qkv(shape, dtype);
      torch::manual_seed(27);
      const auto inputs = random_qkv_inputs(shape, on_cuda(dtype));
      const auto split = run_qkv(qkv_by_split, inputs, shape);
      const auto composed = run_qkv(qkv_by_composition, inputs, shape);
      for (size_t index = 0; index < 3; ++index) {
        EXPECT_TRUE(torch::equal(split.outputs[index], composed.outputs[index])) << what << ": " << kQkvNames[index];
        EXPECT_TRUE(split.outputs[index].transpose(1, 2).is_contiguous()) << what << ": " << kQkvNames[index];
      }
      EXPECT_TRUE(torch::equal(split.grad, composed.grad)) << what << ": the fused output's gradient";
      if (shape.rotary_dim < shape.head_dim) {
        // The raw kernel takes the narrower tables too: the leading dimensions turn, the rest are copied.
        const auto query = inputs.fused.narrow(-1, 0, shape.heads * shape.head_dim)
                               .view({shape.batch, shape.sequence, shape.heads, shape.head_dim})
                               .contiguous();
        EXPECT_TRUE(torch::equal(kernels::rotary_embedding_cuda(query, inputs.cos, inputs.sin, /*inverse=*/false),
                                 rotary_embedding(query, inputs.cos, inputs.sin)))
            << what << ": rotary_embedding_cuda with partial tables";
      }
    }
  }
}

// Phi-4-mini's partial rotary, written as transformers' apply_rotary_pos_emb: the leading
// rotary_dim dimensions of each head turn (cos / sin as wide as them), the rest pass unchanged;
// forward and backward, on the CPU and, through the fused kernel, on CUDA (bf16: equal).
TEST(LlamaLayers, PartialRotaryTurnsTheLeadingDimensionsAndPassesTheRest) {
  const auto transformers_partial = [](const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t rotary_dim = cos.size(-1);
    const auto turned = x.narrow(-1, 0, rotary_dim);
    const auto halves = turned.chunk(2, -1);
    const auto rotated_half = torch::cat({-halves[1], halves[0]}, -1);
    const auto c = cos.unsqueeze(2), s = sin.unsqueeze(2);  // [batch, seq, 1, rotary_dim] over the heads
    return torch::cat({turned * c + rotated_half * s, x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim)}, -1);
  };
  std::vector<torch::Device> devices = {torch::kCPU};
  if (kernels::kCudaKernelsBuilt && torch::cuda::is_available()) devices.emplace_back(torch::kCUDA);
  for (const auto& device : devices) {
    const auto dtype = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
    const auto options = torch::TensorOptions().dtype(dtype).device(device);
    torch::manual_seed(25);
    const auto x = torch::randn({2, 9, 4, 24}).to(options);
    const auto angles = torch::rand({2, 9, 9}) * 20;  // 18 of 24 dimensions turn (0.75)
    const auto cos = torch::cat({angles.cos(), angles.cos()}, -1).to(options);
    const auto sin = torch::cat({angles.sin(), angles.sin()}, -1).to(options);
    const auto grad = torch::randn({2, 9, 4, 24}).to(options);
    const auto ours = run_layer([&](const auto& in) { return rotary_embedding(in[0], cos, sin); }, {x}, grad);
    const auto theirs = run_layer([&](const auto& in) { return transformers_partial(in[0], cos, sin); }, {x}, grad);
    EXPECT_TRUE(torch::equal(ours.output, theirs.output)) << device;
    EXPECT_TRUE(torch::equal(ours.grads[0], theirs.grads[0])) << device;
    EXPECT_TRUE(torch::equal(ours.output.narrow(-1, 18, 6), x.narrow(-1, 18, 6))) << device;
  }
}

TEST(LlamaLayers, OnTheCpuEachFunctionIsItsReference) {
  torch::manual_seed(24);
  const auto x = torch::randn({2, 3, 4, 8});
  const auto angles = torch::rand({2, 3, 4});
  const auto cos = torch::cat({angles.cos(), angles.cos()}, -1);
  const auto sin = torch::cat({angles.sin(), angles.sin()}, -1);
  EXPECT_TRUE(torch::equal(rotary_embedding(x, cos, sin), rotary_embedding_reference(x, cos, sin)));
  const auto weight = torch::rand({8});
  EXPECT_TRUE(torch::equal(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)));
  EXPECT_TRUE(torch::equal(swiglu(x, x * 2), swiglu_reference(x, x * 2)));
  EXPECT_TRUE(torch::equal(geglu(x, x * 2), geglu_reference(x, x * 2)));
  // A fused gate_up output as transformers' Phi-3 MLP takes it: chunk(2), gate first, views read
  // in place (the CPU's kernels round a strided view and a contiguous copy differently).
  const auto gate_up = torch::cat({x, x * 2}, -1);
  const auto halves = gate_up.chunk(2, -1);
  EXPECT_TRUE(torch::equal(swiglu_of_fused(gate_up), swiglu_reference(halves[0], halves[1])));
  EXPECT_TRUE(torch::equal(geglu_of_fused(gate_up), geglu_reference(halves[0], halves[1])));
  EXPECT_TRUE(torch::equal(unit_offset_rms_norm(x, weight, 1e-6), unit_offset_rms_norm_reference(x, weight, 1e-6)));
  // The rotation keeps each pair's norm: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
  const auto rotated = rotary_embedding_reference(x, cos, sin);
  const auto norms = [](const torch::Tensor& t) {
    const auto halves = t.chunk(2, -1);
    return halves[0].pow(2) + halves[1].pow(2);
  };
  EXPECT_TRUE(torch::allclose(norms(rotated), norms(x), 1e-5, 1e-6));
}


// On the CPU (and for what the kernels do not take) split_rotary_qkv is the composition the
// attention ran before, transformers' operations: the same values and memory layouts (the CPU's
// attention rounds differently on another layout) and the same gradient of the fused output.
TEST(LlamaLayers, SplitRotaryQkvOnTheCpuIsTheComposition) {
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const auto& shape : {QkvShape{2, 5, 4, 2, 16, 16}, QkvShape{2, 7, 6, 2, 32, 24}}) {
      const std::string what = describe_qkv(shape, dtype);
      torch::manual_seed(28);
      const auto inputs = random_qkv_inputs(shape, torch::TensorOptions().dtype(dtype));
      const auto split = run_qkv(qkv_by_split, inputs, shape);
      const auto composed = run_qkv(qkv_by_composition, inputs, shape);
      for (size_t index = 0; index < 3; ++index) {
        EXPECT_TRUE(torch::equal(split.outputs[index], composed.outputs[index])) << what << ": " << kQkvNames[index];
        EXPECT_EQ(split.outputs[index].strides(), composed.outputs[index].strides()) << what << ": " << kQkvNames[index];
      }
      EXPECT_TRUE(torch::equal(split.grad, composed.grad)) << what << ": the fused output's gradient";
    }
  }
}

// No family has both, and split_rotary_qkv turns the heads straight from the fused output: the
// decoder refuses a per-head query / key RMSNorm after a fused qkv_proj rather than skip it.
TEST(LlamaLayers, QueryKeyNormAfterAFusedQkvProjectionIsRefused) {
  auto options = testing::small_llama_options(/*hidden_size=*/32, /*layers=*/1);
  options.fused_projections = true;
  options.query_key_norm = true;
  try {
    LlamaForCausalLM model(options, torch::kFloat32);
    ADD_FAILURE() << "a model with q_norm after qkv_proj was built";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kModelConfig);
    EXPECT_NE(std::string(error.what()).find("model.layers.0.self_attn: an RMSNorm on each head's query and key"),
              std::string::npos)
        << error.what();
  }
}

// Adapters over a norm's output (LoRA's q, k and v; gate and up) keep a way to make it again
// instead of the output (RMSNormImpl::forward_rebuildable): every gradient is the same bit for
// bit as when they keep it, and the output is made once for all of them. The fused kernels too,
// where there is a GPU.
TEST(LlamaLayers, AdaptersRebuildingANormsOutputGetTheSameGradientsBitwise) {
  std::vector<torch::Device> devices{torch::kCPU};
  if (kernels::kCudaKernelsBuilt && torch::cuda::is_available()) devices.emplace_back(torch::kCUDA, 0);
  for (const auto& device : devices) {
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      for (const auto style : {NormStyle::kLlama, NormStyle::kUnitOffset}) {
        const std::string what = device.str() + ", " + std::string(c10::toString(dtype)) +
                                 (style == NormStyle::kUnitOffset ? ", Gemma's norm" : ", Llama's norm");
        torch::manual_seed(3);
        RMSNorm norm(16, 1e-6, dtype, style);
        std::vector<std::shared_ptr<qat::LoraLinear>> adapters;
        for (const int64_t out : {8, 24}) {
          qat::DenseLinearOptions dense;
          dense.in_features = 16;
          dense.out_features = out;
          dense.dtype = dtype;
          qat::LoraOptions options;
          options.rank = 4;
          adapters.push_back(std::make_shared<qat::LoraLinear>(std::make_shared<qat::DenseLinear>(dense), options));
        }
        {
          torch::NoGradGuard no_grad;
          norm->weight.normal_(style == NormStyle::kUnitOffset ? 0.0 : 1.0, 0.2);
          for (auto& adapter : adapters) {
            for (auto& parameter : adapter->base_layer()->parameters()) parameter.normal_(0.0, 0.2);
            adapter->lora_B().normal_(0.0, 0.05);
          }
        }
        norm->weight.requires_grad_(false);  // frozen, as under LoRA
        norm->to(device);
        for (auto& adapter : adapters) adapter->to(device);
        const auto input = torch::randn({2, 5, 16}, torch::TensorOptions().dtype(dtype).device(device));

        // x's gradient, then each adapter's A and B gradients.
        const auto gradients = [&](bool rebuilt) {
          auto x = input.clone().requires_grad_(true);
          const auto normed = rebuilt ? norm->forward_rebuildable(x) : RMSNormImpl::Rebuildable{norm->forward(x), {}};
          EXPECT_EQ(static_cast<bool>(normed.rebuild), rebuilt) << what;
          auto loss = torch::zeros({}, torch::TensorOptions().device(device));
          for (auto& adapter : adapters) {
            loss = loss + adapter->forward_rebuilding_input(normed.value, normed.rebuild).to(torch::kFloat32).pow(2).sum();
          }
          if (rebuilt) {
            const auto made = normed.rebuild();
            EXPECT_TRUE(torch::equal(made, normed.value)) << what;
            EXPECT_EQ(normed.rebuild().data_ptr(), made.data_ptr()) << what << ": made again";
          }
          loss.backward();
          std::vector<torch::Tensor> result{x.grad()};
          for (auto& adapter : adapters) {
            for (const auto* weight : {&adapter->lora_A(), &adapter->lora_B()}) {
              result.push_back(weight->grad().clone());
              const_cast<torch::Tensor&>(*weight).mutable_grad() = torch::Tensor();
            }
          }
          return result;
        };
        const auto kept = gradients(false);
        const auto rebuilt = gradients(true);
        for (size_t index = 0; index < kept.size(); ++index) {
          ASSERT_GT(kept[index].abs().sum().item<double>(), 0.0) << what << ": gradient " << index;
          EXPECT_TRUE(torch::equal(kept[index], rebuilt[index])) << what << ": gradient " << index;
        }
        torch::NoGradGuard no_grad;
        EXPECT_FALSE(norm->forward_rebuildable(input).rebuild) << what << ": without grad there is nothing to rebuild";
      }
    }
  }
}

}  // namespace
}  // namespace qtrain::trainer
