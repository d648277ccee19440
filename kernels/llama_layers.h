#pragma once
// The elementwise and per-row pieces of a Llama decoder layer as single CUDA kernels, forward and
// backward: RMSNorm (Llama's and Gemma's), the rotary embedding, SwiGLU and GeGLU. Left to torch operations each is 4-10
// kernels and as many round trips through memory (35% of an 8B LoRA step on an H100 went to them,
// docs/PERFORMANCE.md).
//
// Each kernel rounds where the torch operations of transformers' modeling_llama.py round (the
// reference: trainer/model/llama_layers.cpp runs those operations on the CPU and for other dtypes), so
// the results equal theirs up to the order of one fp32 sum (RMSNorm's mean) and the fused
// multiply-adds the compiler chooses: within one step of the output dtype.
//
// Raw entry points: contiguous CUDA tensors of one floating dtype (fp32, fp16 or bf16) in, fresh
// tensors out, on the input's device and current stream (rotary_embedding_into_cuda: strided views,
// written in place).
#include <ATen/core/Tensor.h>

#include <utility>

namespace qtrain::kernels {

// x [rows, width], weight [width] (x's dtype) -> (weight * dtype(x32 * rstd), rstd fp32 [rows]) with
// rstd = 1 / sqrt(mean(x32^2) + eps); unit_offset (Gemma): dtype(x32 * rstd * (1 + weight32)).
std::pair<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                        bool unit_offset = false);
// The gradient to x of the forward above, given its output's gradient and the saved rstd.
at::Tensor rms_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& rstd, bool unit_offset = false);

// x [batch, seq, heads, head_dim] (the projection's layout), cos/sin [batch, seq, rotary_dim] ->
// x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype. With `inverse`
// the transpose (the backward: rotate by -angle). rotary_dim (even) may be less than head_dim
// (partial rotary): the leading rotary_dim dimensions of each head turn, the rest are copied.
at::Tensor rotary_embedding_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse);
// The same from x into `out`, two [batch, seq, heads, head_dim] views that need not be contiguous:
// each position's heads side by side (stride 1 and head_dim), the positions one row stride apart
// (each view its own): the query or key columns of a fused qkv projection's output
// [batch, seq, q + 2 kv] read in place, or of its gradient written in place. out must not overlap x.
void rotary_embedding_into_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse,
                                const at::Tensor& out);

// silu(gate) * up, silu rounded to the dtype before the product.
at::Tensor swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up);
// (grad gate, grad up) of the forward above.
std::pair<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up);

// gelu_tanh(gate) * up (GeGLU, Gemma's), the GELU rounded to the dtype before the product, and
// its backward.
at::Tensor geglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up);
std::pair<at::Tensor, at::Tensor> geglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                      const at::Tensor& up);

// The same on a fused gate_up projection's contiguous output [..., 2 * intermediate] (gate the first
// half of each row, up the second, as Phi-3's chunk(2)), read in place: forward -> [..., intermediate];
// backward -> d gate_up [..., 2 * intermediate], equal to the pair kernels' results side by side.
at::Tensor swiglu_fused_forward_cuda(const at::Tensor& gate_up);
at::Tensor swiglu_fused_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate_up);
at::Tensor geglu_fused_forward_cuda(const at::Tensor& gate_up);
at::Tensor geglu_fused_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate_up);

}  // namespace qtrain::kernels
