#pragma once
// Attention with gpt-oss's sinks, written out as transformers' eager attention computes it (no
// SDPA kernel takes them): each head's learned logit joins every query's scores as one more
// column, the row's maximum is subtracted, the softmax runs in the scores' dtype, and the sink's
// column is dropped before the product with v, so a query may give weight to nothing.
// It materialises [batch, heads, T, keys] scores: memory grows with T^2 (checkpointing keeps it to
// one layer's at a time).
#include <torch/torch.h>

namespace qtrain::trainer {

// query [batch, heads, T, head_dim]; key / value [batch, key_value_heads, keys, head_dim];
// visible: bool, broadcastable to [batch, heads, T, keys]; sinks [heads]. -> [batch, heads, T,
// head_dim]; differentiable (the sinks too).
torch::Tensor sink_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                             const torch::Tensor& visible, double scale, const torch::Tensor& sinks);

}  // namespace qtrain::trainer
