// Gemma 2's soft-capped attention through the fused CUDA score kernel (kernels/softcapped_softmax.h)
// against the torch operations of transformers' eager attention on the same GPU (the written-out
// path, softcapped_attention): outputs and the gradients of query, key and value, in bf16, fp16 and
// fp32, for training (causal, with and without a window shorter than the input) and for decoding
// after cached keys. The kernel rounds where the operations round; what may differ is the order
// of the softmax's fp32 sums, so the outputs agree to a step of the dtype and the gradients, sums
// over the keys, to a few.
#include "trainer/model/softcapped_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda_build.h"
#include "kernels/softcapped_flash_attention.h"
#include "trainer/model/flash_attention.h"

namespace qtrain::trainer {
namespace {

struct SoftcappedAttended {
  torch::Tensor out, grad_q, grad_k, grad_v;
};

template <typename Attention>
SoftcappedAttended run_softcapped(const Attention& attention, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
             const torch::Tensor& grad) {
  auto q_ = q.detach().clone().requires_grad_(true), k_ = k.detach().clone().requires_grad_(true),
       v_ = v.detach().clone().requires_grad_(true);
  auto out = attention(q_, k_, v_);
  out.backward(grad);
  return {out.detach(), q_.grad(), k_.grad(), v_.grad()};
}

double relative_error(const torch::Tensor& value, const torch::Tensor& reference) {
  const auto v = value.to(torch::kFloat64), r = reference.to(torch::kFloat64);
  return (v - r).abs().max().item<double>() / r.abs().max().item<double>();
}

// The flash kernels' output and gradients must be as close to the fp32 reference as the written-out
// path in the same dtype is: within 1.5x of its error, or half a step of the dtype.
void expect_as_close_to_fp32(const std::string& name, torch::ScalarType dtype, const SoftcappedAttended& flash,
                             const SoftcappedAttended& written, const SoftcappedAttended& reference) {
  const double step = dtype == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
  const std::pair<const char*, std::array<torch::Tensor, 3>> outputs[] = {
      {"output", {flash.out, written.out, reference.out}},
      {"grad q", {flash.grad_q, written.grad_q, reference.grad_q}},
      {"grad k", {flash.grad_k, written.grad_k, reference.grad_k}},
      {"grad v", {flash.grad_v, written.grad_v, reference.grad_v}}};
  for (const auto& [what, tensors] : outputs) {
    const double flash_error = relative_error(tensors[0], tensors[2]);
    const double written_error = relative_error(tensors[1], tensors[2]);
    std::printf("[ measured ] %s %s: flash %.3g, written out %.3g relative to fp32\n", name.c_str(), what, flash_error,
                written_error);
    EXPECT_LE(flash_error, std::max(1.5 * written_error, 0.5 * step)) << what;
  }
}

TEST(SoftcappedAttentionCuda, FusedScoresEqualTheWrittenOutAttentionForwardAndBackward) {
  if (!kernels::kCudaKernelsBuilt) GTEST_SKIP() << "built without the CUDA kernels";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  struct Case {
    int64_t past, queries, window;
  };
  // Training without and with a window that cuts (8 of 300 keys); decoding: 1 and 5 new queries
  // after 40 cached keys, inside and beyond a 16-key window.
  const Case cases[] = {{0, 300, 0}, {0, 300, 8}, {40, 1, 0}, {40, 5, 16}};
  for (const auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat32}) {
    for (const auto& c : cases) {
      const std::string name = std::string(c10::toString(dtype)) + " past " + std::to_string(c.past) + " queries " +
                               std::to_string(c.queries) + " window " + std::to_string(c.window);
      SCOPED_TRACE(name);
      torch::manual_seed(31);
      const auto options = torch::TensorOptions().dtype(dtype).device(torch::kCUDA);
      const int64_t keys = c.past + c.queries;
      // 8 query heads over 2 key/value heads; scores large enough that the cap of 5 bends them.
      const auto q = (torch::randn({2, 8, c.queries, 32}) * 2).to(options);
      const auto k = (torch::randn({2, 2, keys, 32}) * 2).to(options);
      const auto v = torch::randn({2, 2, keys, 32}).to(options);
      const auto grad = torch::randn({2, 8, c.queries, 32}).to(options);
      const double scale = 1.0 / std::sqrt(24.0), cap = 5.0;
      const auto visible = visible_keys(c.past, c.queries, c.window, q.device());
      const auto fused = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_causal_attention(a, b, d, c.past, c.window, scale, cap);
      }, q, k, v, grad);
      const auto reference = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_attention(a, b, d, visible, scale, cap);
      }, q, k, v, grad);
      const double step = dtype == torch::kBFloat16 ? 1.0 / 128 : dtype == torch::kHalf ? 1.0 / 1024 : 1e-6;
      std::printf("[ measured ] %s: output %.3g, grad q %.3g, k %.3g, v %.3g relative\n", name.c_str(),
                  relative_error(fused.out, reference.out), relative_error(fused.grad_q, reference.grad_q),
                  relative_error(fused.grad_k, reference.grad_k), relative_error(fused.grad_v, reference.grad_v));
      EXPECT_LE(relative_error(fused.out, reference.out), 2 * step);
      EXPECT_LE(relative_error(fused.grad_v, reference.grad_v), 2 * step);
      EXPECT_LE(relative_error(fused.grad_q, reference.grad_q), 4 * step);
      EXPECT_LE(relative_error(fused.grad_k, reference.grad_k), 4 * step);
    }
  }
}

// The flash-style kernels (kernels/softcapped_flash_attention.h), which training and prefill take in
// bf16 / fp16 at head_dim 128 and 256, against the fp32 reference on the same inputs
// (expect_as_close_to_fp32). Token counts that are and are not multiples of the 64-token tiles,
// windows that cut, grouped query heads, query / key / value in the projections'
// [batch, T, heads, head_dim] layout (transposed views), Gemma 2's cap of 50.
TEST(SoftcappedAttentionCuda, FlashKernelsAreAsCloseToFp32AsTheWrittenOutPath) {
  if (!kernels::kCudaKernelsBuilt) GTEST_SKIP() << "built without the CUDA kernels";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  struct Case {
    int64_t tokens, window, head_dim;
    double cap, spread;
  };
  const Case cases[] = {{300, 0, 256, 5.0, 2.0},  {300, 100, 256, 5.0, 2.0}, {192, 0, 128, 5.0, 2.0},
                        {257, 70, 128, 5.0, 2.0}, {130, 0, 256, 50.0, 8.0}};
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const auto& c : cases) {
      const std::string name = std::string(c10::toString(dtype)) + " T " + std::to_string(c.tokens) + " window " +
                               std::to_string(c.window) + " head_dim " + std::to_string(c.head_dim) + " cap " +
                               std::to_string(static_cast<int>(c.cap));
      SCOPED_TRACE(name);
      torch::manual_seed(7);
      const auto options = torch::TensorOptions().dtype(dtype).device(torch::kCUDA);
      const auto q = (torch::randn({2, c.tokens, 8, c.head_dim}) * c.spread).to(options).transpose(1, 2);
      const auto k = (torch::randn({2, c.tokens, 2, c.head_dim}) * c.spread).to(options).transpose(1, 2);
      const auto v = torch::randn({2, c.tokens, 2, c.head_dim}).to(options).transpose(1, 2);
      const auto grad = torch::randn({2, 8, c.tokens, c.head_dim}).to(options);
      ASSERT_TRUE(kernels::softcapped_flash_takes(q, k));
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
      const auto visible = visible_keys(0, c.tokens, c.window, q.device());
      const auto flash = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_causal_attention(a, b, d, 0, c.window, scale, c.cap);
      }, q, k, v, grad);
      const auto written = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_attention(a, b, d, visible, scale, c.cap);
      }, q, k, v, grad);
      const auto reference = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_attention(a, b, d, visible, scale, c.cap);
      }, q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32), grad.to(torch::kFloat32));
      expect_as_close_to_fp32(name, dtype, flash, written, reference);
    }
  }
}

// Packed samples on the flash kernels (softcapped_packed_attention: the rows end to end, each query
// in its own sample's run) against the written-out block-causal mask, in fp32 and in the dtype:
// runs of several lengths, a row that is one sample, a padding run (sample id -1), with and
// without a window.
TEST(SoftcappedAttentionCuda, PackedSamplesOnTheFlashKernelsAreAsCloseToFp32AsTheWrittenOutMask) {
  if (!kernels::kCudaKernelsBuilt) GTEST_SKIP() << "built without the CUDA kernels";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device device(torch::kCUDA);
  const int64_t tokens = 300;
  // Row 0: samples of 100, 37, 150 and 13 tokens; row 1: one of 250, then 50 of padding; row 2:
  // one sample end to end.
  std::vector<int64_t> ids;
  for (const auto& [id, length] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 100}, {1, 37}, {2, 150}, {3, 13}, {0, 250}, {-1, 50}, {0, 300}}) {
    ids.insert(ids.end(), length, id);
  }
  const auto sample_ids = torch::tensor(ids, torch::kInt64).view({3, tokens});
  const auto mask = AttentionMask::packed(sample_ids, device);
  ASSERT_NE(mask.spans(), nullptr);
  const auto same_sample = (sample_ids.unsqueeze(2) == sample_ids.unsqueeze(1)).unsqueeze(1).to(device);
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const int64_t window : {0, 50}) {
      const std::string name = std::string(c10::toString(dtype)) + " packed, window " + std::to_string(window);
      SCOPED_TRACE(name);
      torch::manual_seed(11);
      const auto options = torch::TensorOptions().dtype(dtype).device(device);
      const auto q = (torch::randn({3, tokens, 8, 256}) * 2).to(options).transpose(1, 2);
      const auto k = (torch::randn({3, tokens, 2, 256}) * 2).to(options).transpose(1, 2);
      const auto v = torch::randn({3, tokens, 2, 256}).to(options).transpose(1, 2);
      const auto grad = torch::randn({3, 8, tokens, 256}).to(options);
      ASSERT_TRUE(softcapped_packed_applies(q, k));
      const double scale = 1.0 / 16, cap = 5.0;
      const auto visible = same_sample & visible_keys(0, tokens, window, device);
      const auto flash = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_packed_attention(a, b, d, *mask.spans(), window, scale, cap);
      }, q, k, v, grad);
      const auto written = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_attention(a, b, d, visible, scale, cap);
      }, q, k, v, grad);
      const auto reference = run_softcapped([&](const auto& a, const auto& b, const auto& d) {
        return softcapped_attention(a, b, d, visible, scale, cap);
      }, q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32), grad.to(torch::kFloat32));
      expect_as_close_to_fp32(name, dtype, flash, written, reference);
    }
  }
}

// Gemma 2 9B's attention (16 query heads over 8, head_dim 256, 2,048 tokens), forward + backward in
// bf16: the flash kernels against the score kernel between two matmuls.
TEST(SoftcappedAttentionCuda, FlashKernelsAgainstTheScoreKernelMeasured) {
  if (!kernels::kCudaKernelsBuilt) GTEST_SKIP() << "built without the CUDA kernels";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto options = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const int64_t tokens = 2048;
  const double scale = 1.0 / std::sqrt(256.0), cap = 50.0;
  const auto q = torch::randn({1, tokens, 16, 256}, options).transpose(1, 2);
  const auto k = torch::randn({1, tokens, 8, 256}, options).transpose(1, 2);
  const auto v = torch::randn({1, tokens, 8, 256}, options).transpose(1, 2);
  const auto grad = torch::randn({1, 16, tokens, 256}, options);
  auto measure = [&](const char* what, auto attention) {
    for (int warm = 0; warm < 2; ++warm) run_softcapped(attention, q, k, v, grad);
    torch::cuda::synchronize();
    const int repeats = 10;
    const auto start = std::chrono::steady_clock::now();
    SoftcappedAttended result;
    for (int repeat = 0; repeat < repeats; ++repeat) result = run_softcapped(attention, q, k, v, grad);
    torch::cuda::synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / repeats;
    const auto forward_start = std::chrono::steady_clock::now();
    {
      const torch::NoGradGuard no_grad;
      for (int repeat = 0; repeat < repeats; ++repeat) attention(q, k, v);
      torch::cuda::synchronize();
    }
    const double forward_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - forward_start).count() / repeats;
    std::printf("[ measured ] %s, 16 heads over 8, head_dim 256, %ld tokens: forward %.2f ms, forward + backward %.2f ms\n",
                what, static_cast<long>(tokens), 1e3 * forward_seconds, 1e3 * seconds);
    return result;
  };
  const auto flash = measure("flash kernels", [&](const auto& a, const auto& b, const auto& d) {
    return softcapped_causal_attention(a, b, d, 0, 0, scale, cap);
  });
  const auto scores = measure("score kernel between matmuls", [&](const auto& a, const auto& b, const auto& d) {
    return softcapped_scores_attention(a, b, d, 0, 0, scale, cap);
  });
  EXPECT_LE(relative_error(flash.out, scores.out), 2e-2);
  EXPECT_LE(relative_error(flash.grad_q, scores.grad_q), 4e-2);
}

}  // namespace
}  // namespace qtrain::trainer
