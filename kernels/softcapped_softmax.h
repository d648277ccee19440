#pragma once
// Gemma 2's score path between the two attention matmuls as one CUDA kernel each way: from the raw
// scores q k^T to the probabilities, cap * tanh((s * scale) / cap) with the causal (and sliding
// window) mask written from positions, softmax in fp32. Left to torch operations that is eight
// kernels over [batch, heads, T, keys] and an fp32 copy of it (docs/PERFORMANCE.md).
//
// Each step rounds to the scores' dtype where transformers' eager attention rounds (the scale,
// the division by the cap, tanh, the cap's product), the softmax runs in fp32 and the backward
// differentiates that chain with the same roundings, so results equal the torch operations'
// up to the order of the softmax's fp32 sums.
#include <ATen/core/Tensor.h>

#include <tuple>

namespace qtrain::kernels {

struct SoftcappedScores {
  int64_t queries = 0;  // rows per (batch, head): row r holds query r % queries
  int64_t past = 0;     // the first query's position (cached keys before it)
  int64_t window = 0;   // > 0: a query sees only the last `window` keys, itself included
  double scale = 1.0;
  double cap = 0.0;
};

// scores [rows, keys] (contiguous, fp32 / fp16 / bf16) -> (probabilities in the scores' dtype,
// the same in fp32, tanh's output in the scores' dtype): the two last are what the backward reads.
// Key j is visible to the query at position p = past + r % queries when j <= p and, with a window,
// j > p - window.
std::tuple<at::Tensor, at::Tensor, at::Tensor> softcapped_softmax_forward_cuda(const at::Tensor& scores,
                                                                               const SoftcappedScores& options);
// The gradient to the raw scores, given the probabilities' gradient (the scores' dtype).
at::Tensor softcapped_softmax_backward_cuda(const at::Tensor& grad_probabilities, const at::Tensor& probabilities32,
                                            const at::Tensor& tanh_output, const SoftcappedScores& options);

}  // namespace qtrain::kernels
