#pragma once
// Attention with Gemma 2's soft-capped scores, written out as transformers' eager attention
// computes it (no SDPA kernel caps its scores):
//   scores = cap * tanh((q k^T * scale) / cap), hidden keys at -inf, softmax in fp32 cast back to
//   q's dtype, times v.
// It materialises [batch, heads, T, keys] scores: memory grows with T^2 (checkpointing keeps it
// to one layer's at a time).
#include <torch/torch.h>

#include "trainer/model/attention_mask.h"

namespace qtrain::trainer {

// query [batch, heads, T, head_dim]; key / value [batch, key_value_heads, keys, head_dim] (heads a
// multiple of key_value_heads); visible: bool, broadcastable to [batch, heads, T, keys], true where
// a query may attend to a key. Returns [batch, heads, T, head_dim]; differentiable.
torch::Tensor softcapped_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                   const torch::Tensor& visible, double scale, double softcap);

// The same for causal attention (the query at row i sits at position past + i and sees keys
// j <= past + i, with window > 0 only j > past + i - window). CUDA only: softcapped_kernel_applies.
// Training and prefill (past 0) in bf16 / fp16 with head_dim 128 or 256 run flash-style kernels
// (kernels/softcapped_flash_attention.h) that never write [T, T]; otherwise (decoding after cached
// keys, other head sizes, fp32) the scores' cap, mask and softmax run as one CUDA kernel each way
// between two matmuls (kernels/softcapped_softmax.h): no mask tensor, no fp32 copy of the scores
// beyond the probabilities the backward reads.
bool softcapped_kernel_applies(const torch::Tensor& query);
torch::Tensor softcapped_causal_attention(const torch::Tensor& query, const torch::Tensor& key,
                                          const torch::Tensor& value, int64_t past, int64_t window, double scale,
                                          double softcap);
// The second of those paths whatever the operands (the score kernel between two matmuls); the
// tests measure the two against each other.
torch::Tensor softcapped_scores_attention(const torch::Tensor& query, const torch::Tensor& key,
                                          const torch::Tensor& value, int64_t past, int64_t window, double scale,
                                          double softcap);

// Packed samples (a packed batch's spans, trainer/model/attention_mask.h) on the flash-style kernels:
// the batch's rows end to end, each query seeing the keys of its own sample, causal, with the
// window (no [batch, 1, T, T] mask, no work across samples). Where softcapped_packed_applies: the
// kernels take the operands (CUDA, bf16 / fp16, head_dim 128 or 256) and no keys are cached.
bool softcapped_packed_applies(const torch::Tensor& query, const torch::Tensor& key);
torch::Tensor softcapped_packed_attention(const torch::Tensor& query, const torch::Tensor& key,
                                          const torch::Tensor& value, const SampleSpans& spans, int64_t window,
                                          double scale, double softcap);

}  // namespace qtrain::trainer
