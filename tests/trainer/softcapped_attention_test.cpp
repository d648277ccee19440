// Gemma 2's soft-capped attention through the fused CUDA score kernel (kernels/softcapped_softmax.h)
// against the torch operations of transformers' eager attention on the same GPU (the written-out
// path, softcapped_attention): outputs and the gradients of query, key and value, in bf16, fp16 and
// fp32, for training (causal, with and without a window shorter than the input) and for decoding
// after cached keys. The kernel rounds where the operations round; what may differ is the order
// of the softmax's fp32 sums, so the outputs agree to a step of the dtype and the gradients, sums
// over the keys, to a few.
#include "trainer/model/softcapped_attention.h"

#include <gtest/gtest.h>

#include <string>

#include "kernels/cuda_build.h"
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

}  // namespace
}  // namespace qtrain::trainer
