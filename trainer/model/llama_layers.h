#pragma once
// The differentiable per-row and elementwise pieces of a Llama decoder layer: RMSNorm (and Gemma's
// (1 + w) one), the rotary embedding (also on a fused qkv projection's output), SwiGLU and GeGLU.
// On CUDA each is one fused kernel forward and one backward (kernels/llama_layers.h), saving less
// for backward than autograd would (the fp32 copies of the residual stream, silu's output);
// elsewhere, and for the dtype mixes the kernels do not take, they are the torch operations of
// transformers' modeling_llama.py, the reference the kernels are tested against.
#include <torch/torch.h>

namespace qtrain::trainer {

// Whether the fused CUDA kernels (ours, kernels/*.cu) take `tensor`: built with them, on CUDA, in
// fp32 / fp16 / bf16.
bool on_fused_kernels(const torch::Tensor& tensor);

// x [..., width]; weight [width]: weight * to(x dtype)(x32 / sqrt(mean(x32^2) + eps)).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Gemma's: to(x dtype)(x32 / sqrt(mean(x32^2) + eps) * (1 + weight32)).
torch::Tensor unit_offset_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor unit_offset_rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// x [batch, seq, heads, head_dim] (the projection's output viewed per head), cos/sin
// [batch, seq, head_dim] in x's dtype -> x * cos + rotate_half(x) * sin, same layout. Tables
// narrower than head_dim (partial rotary) turn the leading dimensions and pass the rest.
torch::Tensor rotary_embedding(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor rotary_embedding_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// A fused qkv projection's output (Phi-3, Phi-4-mini) split into heads, query and key turned:
// fused [batch, seq, (heads + 2 key_value_heads) * head_dim], the query's columns first, then the
// key's, then the value's; cos/sin [batch, seq, rotary_dim] as rotary_embedding takes them ->
// query [batch, seq, heads, head_dim], key and value [batch, seq, key_value_heads, head_dim]:
// rotary_embedding of the query and key column ranges viewed per head, and the value's range so
// viewed. On the fused kernels one function reads `fused` in place and gives back its gradient as
// one [batch, seq, width] tensor, the inverse rotation written straight into its query and key
// columns (the split's copies, partial rotary's cat and three zero-filled slice gradients of the
// whole width cost Phi-4-mini ~22 ms a step on an H100); there the three outputs are contiguous and
// bit for bit the composition's. Elsewhere it is that composition.
struct QueryKeyValue {
  torch::Tensor query, key, value;
};
QueryKeyValue split_rotary_qkv(const torch::Tensor& fused, const torch::Tensor& cos, const torch::Tensor& sin,
                               int64_t heads, int64_t key_value_heads, int64_t head_dim);

// silu(gate) * up.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor swiglu_reference(const torch::Tensor& gate, const torch::Tensor& up);

// gelu_tanh(gate) * up (Gemma's GeGLU).
torch::Tensor geglu(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor geglu_reference(const torch::Tensor& gate, const torch::Tensor& up);

// The same on a fused gate_up projection's output [..., 2 * intermediate] (gate the first half of
// each row, up the second, as Phi-3's chunk(2)): read in place by one kernel each way on CUDA, where
// splitting it cost three copies of [tokens, intermediate] per layer and step; its gradient comes
// back as one [..., 2 * intermediate] tensor. Equal to swiglu / geglu on the two halves.
torch::Tensor swiglu_of_fused(const torch::Tensor& gate_up);
torch::Tensor geglu_of_fused(const torch::Tensor& gate_up);

// act(gate) * up (GeGLU where `gelu`; `up` undefined: `gate` is a fused gate_up output) where
// nothing reads the values, only their place in autograd's graph: they are left unwritten, and
// backward gives the gradients of the computed product bit for bit. For the input of a projection
// that does not read it (qat::LinearLayer::reads_input_for_graph) in a checkpointed layer's
// recomputation.
torch::Tensor gated_activation_for_graph(bool gelu, const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace qtrain::trainer
