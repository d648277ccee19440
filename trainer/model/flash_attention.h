#pragma once
// Causal attention on flash attention's own masks, without the [T, T] mask SDPA would need:
//   - a sliding window: query i sees keys i - window + 1 .. i, so memory and time grow with
//     T x window instead of T x T;
//   - packed samples: each query sees only its own sample's keys, given as the samples'
//     cumulative lengths (trainer/model/attention_mask.h), so the blocks across samples are
//     never computed.
// Flash attention runs on CUDA in bf16 / fp16 with head_dim a multiple of 8 up to 256;
// flash_attention_applies() says when.
#include <torch/torch.h>

#include "trainer/model/attention_mask.h"

namespace qtrain::trainer {

// query [batch, heads, T, head_dim], key / value [batch, key_value_heads, T, head_dim] (heads a
// multiple of key_value_heads), every query at the position of its key (no cache before them).
bool flash_attention_applies(const torch::Tensor& query, const torch::Tensor& key);
// The part of that rule a run knows before any tensor exists (the memory estimate asks it).
bool flash_attention_takes(torch::DeviceType device, torch::ScalarType dtype, int64_t head_dim);

// [sequence, past + sequence] bool: new query i (at position past + i) sees key j when j <= past + i
// and, with a window, j > past + i - window, as transformers' causal and sliding-window masks
// (the mask the other attention paths write out).
torch::Tensor visible_keys(int64_t past, int64_t sequence, int64_t window, const torch::Device& device);

// The attention output [batch, heads, T, head_dim]; differentiable in query, key and value.
// window 0: no window. `sinks` [heads], if defined: gpt-oss's sink logits (trainer/model/attention_sinks.h),
// differentiable too.
torch::Tensor flash_window_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                     int64_t window, double scale, const torch::Tensor& sinks = {});

// The same over packed samples: `spans` cut the batch's batch * T tokens into the samples (and
// each row's padding) that attend only within themselves; a window, if any, applies within each.
// Without a window or sinks, the leading rows that are one sample each (spans.whole_rows) take
// SDPA's causal attention instead: on Hopper its cuDNN kernels run the same work ~1.8x faster
// than flash attention's over cumulative lengths (LibTorch 2.11's cuDNN varlen forward builds a
// new graph on every call, ~70 ms, and its backward misreads the longest sample).
torch::Tensor flash_packed_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                     const SampleSpans& spans, int64_t window, double scale, const torch::Tensor& sinks = {});

}  // namespace qtrain::trainer
