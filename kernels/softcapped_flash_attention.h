#pragma once
// Gemma 2's soft-capped causal attention as flash-style kernels, forward and backward: the scores
// of 64 queries x 64 keys at a time live in registers and shared memory only, never the
// [T, T] scores or probabilities that the fused score kernel (kernels/softcapped_softmax.h) writes
// out between two matmuls. Tensor-core matrix products (mma.sync, bf16 / fp16 in, fp32 sums), the
// softmax online over the key blocks, blocks above the diagonal (and left of the window) skipped.
//
//   scores = cap * tanh(q k^T * scale / cap), key j visible to query i when j <= i and, with a
//   window, j > i - window; probabilities = softmax(scores) in fp32; out = probabilities v.
//
// As in flash attention, the probabilities meet v (and the backward's products) rounded to the
// inputs' dtype, and tanh is the GPU's tanh.approx: results equal the fp32 reference to the
// dtype's rounding, as the written-out path does (tests/trainer/softcapped_attention_test.cpp).
#include <ATen/core/Tensor.h>

#include <tuple>

namespace qtrain::kernels {

struct SoftcappedFlash {
  int64_t window = 0;  // > 0: a query sees only the last `window` keys, itself included
  double scale = 1.0;
  double cap = 0.0;
  // Packed samples: int32 [2, T] on the device, each token's run [start, end) (a query sees only
  // keys of its own run), with batch 1 (the batch's rows laid end to end). Undefined: one sequence
  // per row.
  at::Tensor run_bounds;
};

// Whether the kernels take these operands: CUDA, bf16 or fp16, head_dim 128 or 256, as many keys
// as queries (no cached keys before them), query heads a multiple of key / value heads, on a GPU
// with bf16 tensor cores and the shared memory the backward needs (head_dim 256: Hopper's).
bool softcapped_flash_takes(const at::Tensor& query, const at::Tensor& key);
// The dtype and head_dim part of that rule, for estimates made before any tensor exists (false in
// a build without the CUDA kernels; the GPU is taken to be the Hopper the build targets).
bool softcapped_flash_takes(at::ScalarType dtype, int64_t head_dim);

// query [batch, heads, T, head_dim]; key / value [batch, key_value_heads, T, head_dim] (any strides
// with head_dim contiguous). Returns (out [batch, heads, T, head_dim], laid out as
// [batch, T, heads, head_dim] so that merging the heads is a view; the rows' log-sum-exp of the
// capped scores in base 2, fp32 [batch, heads, T], which the backward reads).
std::tuple<at::Tensor, at::Tensor> softcapped_flash_forward_cuda(const at::Tensor& query, const at::Tensor& key,
                                                                 const at::Tensor& value,
                                                                 const SoftcappedFlash& options);

// The gradients of query, key and value (each in its operand's shape and dtype) given out's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> softcapped_flash_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& log_sum_exp2, const SoftcappedFlash& options);

}  // namespace qtrain::kernels
