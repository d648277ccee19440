// Flash attention's sliding window against SDPA over the written-out [T, T] window mask, in fp32
// from the same bf16 inputs: outputs and the gradients of query, key and value (GPU only).
#include "trainer/model/sliding_window_attention.h"

#include <gtest/gtest.h>

#include <chrono>

#include "trainer/base/memory_stats.h"

namespace qtrain::trainer {
namespace {

// Query i sees keys i - window + 1 .. i (transformers' sliding-window mask).
torch::Tensor window_mask(int64_t length, int64_t window, const torch::Device& device) {
  const auto positions = torch::arange(length, torch::TensorOptions().dtype(torch::kInt64).device(device));
  const auto keys = positions.unsqueeze(0), queries = positions.unsqueeze(1);
  return (keys <= queries) & (keys > queries - window);
}

torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t window,
                               double scale) {
  return at::scaled_dot_product_attention(q, k, v, window_mask(q.size(2), window, q.device()), 0.0, false, scale,
                                          /*enable_gqa=*/q.size(1) != k.size(1));
}

double relative_error(const torch::Tensor& value, const torch::Tensor& reference) {
  return (value.to(torch::kFloat32) - reference).abs().max().item<double>() / reference.abs().max().item<double>();
}

struct Attended {
  torch::Tensor out, grad_q, grad_k, grad_v;
};
template <typename Attention>
Attended run(Attention attention, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
             const torch::Tensor& grad_out, torch::ScalarType dtype) {
  auto q_ = q.to(dtype).detach().requires_grad_(true), k_ = k.to(dtype).detach().requires_grad_(true),
       v_ = v.to(dtype).detach().requires_grad_(true);
  auto out = attention(q_, k_, v_);
  out.backward(grad_out.to(dtype));
  return {out.detach(), q_.grad(), k_.grad(), v_.grad()};
}

TEST(SlidingWindowAttention, CudaFlashWindowEqualsTheMaskedAttentionWithItsGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  torch::manual_seed(0);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t window = 64;
  const double scale = 0.125;
  // GQA (8 query heads over 2 key / value heads), a length that is not a multiple of any tile.
  const auto q = torch::randn({2, 8, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto k = torch::randn({2, 2, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto v = torch::randn({2, 2, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto grad_out = torch::randn({2, 8, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  ASSERT_TRUE(flash_window_attention_applies(q.to(torch::kBFloat16), k.to(torch::kBFloat16)));
  ASSERT_FALSE(flash_window_attention_applies(q, k));  // fp32: the masked path

  auto masked = [&](auto&& a, auto&& b, auto&& c) { return masked_attention(a, b, c, window, scale); };
  auto flash = [&](auto&& a, auto&& b, auto&& c) { return flash_window_attention(a, b, c, window, scale); };
  const auto reference = run(masked, q, k, v, grad_out, torch::kFloat32);
  const auto dense_bf16 = run(masked, q, k, v, grad_out, torch::kBFloat16);
  const auto ours = run(flash, q, k, v, grad_out, torch::kBFloat16);
  const std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>> parts[] = {
      {"output", {ours.out, reference.out}},
      {"grad query", {ours.grad_q, reference.grad_q}},
      {"grad key", {ours.grad_k, reference.grad_k}},
      {"grad value", {ours.grad_v, reference.grad_v}}};
  const torch::Tensor dense[] = {dense_bf16.out, dense_bf16.grad_q, dense_bf16.grad_k, dense_bf16.grad_v};
  int index = 0;
  for (const auto& [what, tensors] : parts) {
    const double error = relative_error(tensors.first, tensors.second);
    const double dense_error = relative_error(dense[index++], tensors.second);
    std::printf("[ measured ] %s: flash window %.3g, SDPA with the mask in bf16 %.3g (relative to fp32)\n", what, error,
                dense_error);
    // bf16 rounding of the output and the gradients: 2^-8 relative each, a few roundings deep.
    EXPECT_LE(error, 2e-2) << what;
    EXPECT_LE(error, 2 * dense_error + 4e-3) << what;
  }
  // Keys outside the window get no gradient from the query that cannot see them: query 299 with
  // window 64 sees 236..299, so grad_out on query 299 alone moves keys 236..299 only.
  auto q_ = q.to(torch::kBFloat16).detach().requires_grad_(true), k_ = k.to(torch::kBFloat16).detach().requires_grad_(true);
  auto out = flash_window_attention(q_, k_, v.to(torch::kBFloat16), window, scale);
  auto only_last = torch::zeros_like(out);
  only_last.select(2, 299).fill_(1);
  out.backward(only_last);
  const auto moved = k_.grad().abs().sum({0, 1, 3}).ne(0).nonzero().flatten();
  EXPECT_EQ(moved.min().item<int64_t>(), 236);
  EXPECT_EQ(moved.max().item<int64_t>(), 299);
}

// What the window saves at Mistral 7B v0.1's shape (32 heads over 8, head_dim 128, window 4096)
// on 16k tokens: time and peak memory of forward + backward, flash window against the mask.
TEST(SlidingWindowAttention, CudaFlashWindowAtLongSequencesMeasured) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const torch::Device device(torch::kCUDA, 0);
  const auto options = torch::TensorOptions().device(device).dtype(torch::kBFloat16);
  const int64_t length = 16384, window = 4096;
  const double scale = 1.0 / std::sqrt(128.0);
  const auto q = torch::randn({1, 32, length, 128}, options), k = torch::randn({1, 8, length, 128}, options),
             v = torch::randn({1, 8, length, 128}, options), grad_out = torch::randn({1, 32, length, 128}, options);
  auto measure = [&](const char* what, auto attention) {
    for (int warm = 0; warm < 2; ++warm) run(attention, q, k, v, grad_out, torch::kBFloat16);
    torch::cuda::synchronize();
    reset_peak_memory(device);
    const double before = memory_usage(device).current_bytes;
    const auto start = std::chrono::steady_clock::now();
    const auto result = run(attention, q, k, v, grad_out, torch::kBFloat16);
    torch::cuda::synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double peak = memory_usage(device).peak_bytes - before;
    std::printf("[ measured ] %s, %ld tokens, window %ld: forward + backward %.1f ms, peak %s above the inputs\n", what,
                static_cast<long>(length), static_cast<long>(window), 1e3 * seconds, format_bytes(peak).c_str());
    return result.out;
  };
  const auto flash = measure("flash window", [&](auto&& a, auto&& b, auto&& c) {
    return flash_window_attention(a, b, c, window, scale);
  });
  const auto masked = measure("SDPA with the [T, T] mask", [&](auto&& a, auto&& b, auto&& c) {
    return masked_attention(a, b, c, window, scale);
  });
  EXPECT_LE(relative_error(flash, masked.to(torch::kFloat32)), 2e-2);
}

}  // namespace
}  // namespace qtrain::trainer
