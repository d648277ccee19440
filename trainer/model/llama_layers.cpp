#include "trainer/model/llama_layers.h"

#include <string>

#include "kernels/cuda_build.h"
#include "kernels/error.h"
#include "kernels/llama_layers.h"

namespace qtrain::trainer {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;


class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& x, const torch::Tensor& weight,
                               double eps, bool unit_offset) {
    const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
    auto [out, rstd] = kernels::rms_norm_forward_cuda(rows, weight.contiguous(), eps, unit_offset);
    context->save_for_backward({rows, weight, rstd});
    context->saved_data["unit_offset"] = unit_offset;
    return out.view(x.sizes());
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    const auto saved = context->get_saved_variables();
    const auto& rows = saved[0];
    const auto& weight = saved[1];
    const auto& rstd = saved[2];
    const bool unit_offset = context->saved_data["unit_offset"].toBool();
    const auto grad_rows = grads[0].reshape(rows.sizes()).contiguous();
    auto grad_x = kernels::rms_norm_backward_cuda(grad_rows, rows, weight.contiguous(), rstd, unit_offset);
    torch::Tensor grad_weight;
    if (context->needs_input_grad(1)) {
      // Trained norms only (full fine-tuning): the weight's gradient is sum over rows of dy * n_t
      // (Gemma's: of dy * n, its normalized value never rounded).
      auto normalized = rows.to(torch::kFloat32) * rstd.unsqueeze(1);
      if (!unit_offset) normalized = normalized.to(rows.scalar_type()).to(torch::kFloat32);
      grad_weight = (grad_rows.to(torch::kFloat32) * normalized).sum(0).to(weight.scalar_type());
    }
    return {grad_x.view(grads[0].sizes()), grad_weight, torch::Tensor(), torch::Tensor()};
  }
};

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin) {
    const auto cos_table = cos.contiguous();
    const auto sin_table = sin.contiguous();
    context->save_for_backward({cos_table, sin_table});
    return kernels::rotary_embedding_cuda(x.contiguous(), cos_table, sin_table, /*inverse=*/false);
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    const auto saved = context->get_saved_variables();
    return {kernels::rotary_embedding_cuda(grads[0].contiguous(), saved[0], saved[1], /*inverse=*/true),
            torch::Tensor(), torch::Tensor()};
  }
};

// Columns [first_head * head_dim, (first_head + heads) * head_dim) of rows [batch, seq, width],
// viewed [batch, seq, heads, head_dim]: a view whose positions lie `width` apart.
torch::Tensor head_columns(const torch::Tensor& rows, int64_t first_head, int64_t heads, int64_t head_dim) {
  return rows.narrow(-1, first_head * head_dim, heads * head_dim).view({rows.size(0), rows.size(1), heads, head_dim});
}

// A fused qkv projection's output [batch, seq, (heads + 2 key_value_heads) * head_dim] -> query and
// key turned (rotary_embedding_into_cuda reading their columns in place), value copied; backward
// writes one [batch, seq, width] gradient: the inverse rotation into the query and key columns,
// the value's gradient copied into its own.
class SplitRotaryQkvFunction : public torch::autograd::Function<SplitRotaryQkvFunction> {
 public:
  static variable_list forward(AutogradContext* context, const torch::Tensor& fused, const torch::Tensor& cos,
                               const torch::Tensor& sin, int64_t heads, int64_t key_value_heads, int64_t head_dim) {
    const auto rows = fused.contiguous();  // a projection's output already is
    const auto cos_table = cos.contiguous();
    const auto sin_table = sin.contiguous();
    const auto turned = [&](int64_t first_head, int64_t count) {
      auto out = torch::empty({rows.size(0), rows.size(1), count, head_dim}, rows.options());
      kernels::rotary_embedding_into_cuda(head_columns(rows, first_head, count, head_dim), cos_table, sin_table,
                                          /*inverse=*/false, out);
      return out;
    };
    auto query = turned(0, heads);
    auto key = turned(heads, key_value_heads);
    auto value = head_columns(rows, heads + key_value_heads, key_value_heads, head_dim).clone(torch::MemoryFormat::Contiguous);
    context->save_for_backward({cos_table, sin_table});
    context->saved_data["heads"] = heads;
    context->saved_data["key_value_heads"] = key_value_heads;
    context->saved_data["head_dim"] = head_dim;
    return {query, key, value};
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    const auto saved = context->get_saved_variables();
    const int64_t heads = context->saved_data["heads"].toInt();
    const int64_t key_value_heads = context->saved_data["key_value_heads"].toInt();
    const int64_t head_dim = context->saved_data["head_dim"].toInt();
    const auto& grad_query = grads[0];
    auto grad_fused = torch::empty({grad_query.size(0), grad_query.size(1), (heads + 2 * key_value_heads) * head_dim},
                                   grad_query.options());
    kernels::rotary_embedding_into_cuda(grad_query.contiguous(), saved[0], saved[1], /*inverse=*/true,
                                        head_columns(grad_fused, 0, heads, head_dim));
    kernels::rotary_embedding_into_cuda(grads[1].contiguous(), saved[0], saved[1], /*inverse=*/true,
                                        head_columns(grad_fused, heads, key_value_heads, head_dim));
    head_columns(grad_fused, heads + key_value_heads, key_value_heads, head_dim).copy_(grads[2]);
    return {grad_fused, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// act(gate) * up through one kernel each way: SwiGLU's or GeGLU's (kernels/llama_layers.h), on two
// tensors or on a fused projection's [..., 2 * intermediate] output.
struct SiluKernels {
  static constexpr auto forward = kernels::swiglu_forward_cuda;
  static constexpr auto backward = kernels::swiglu_backward_cuda;
  static constexpr auto fused_forward = kernels::swiglu_fused_forward_cuda;
  static constexpr auto fused_backward = kernels::swiglu_fused_backward_cuda;
};
struct GeluTanhKernels {
  static constexpr auto forward = kernels::geglu_forward_cuda;
  static constexpr auto backward = kernels::geglu_backward_cuda;
  static constexpr auto fused_forward = kernels::geglu_fused_forward_cuda;
  static constexpr auto fused_backward = kernels::geglu_fused_backward_cuda;
};

// `written` false: the output's place in autograd's graph, its values left unwritten
// (gated_activation_for_graph).
template <typename Kernels>
class GatedActivationFunction : public torch::autograd::Function<GatedActivationFunction<Kernels>> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& gate, const torch::Tensor& up,
                               bool written) {
    const auto gate_values = gate.contiguous();
    const auto up_values = up.contiguous();
    context->save_for_backward({gate_values, up_values});
    return written ? Kernels::forward(gate_values, up_values) : torch::empty_like(gate_values);
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    const auto saved = context->get_saved_variables();
    auto [grad_gate, grad_up] = Kernels::backward(grads[0].contiguous(), saved[0], saved[1]);
    return {grad_gate, grad_up, torch::Tensor()};
  }
};

// act(gate) * up on the fused [..., 2 * intermediate] projection output, which it keeps whole.
template <typename Kernels>
class FusedGatedActivationFunction : public torch::autograd::Function<FusedGatedActivationFunction<Kernels>> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& gate_up, bool written) {
    const auto values = gate_up.contiguous();
    context->save_for_backward({values});
    if (written) return Kernels::fused_forward(values);
    auto sizes = values.sizes().vec();
    sizes.back() /= 2;
    return torch::empty(sizes, values.options());
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    return {Kernels::fused_backward(grads[0].contiguous(), context->get_saved_variables()[0]), torch::Tensor()};
  }
};

// The torch operations' act(gate) * up with its values unwritten: backward gives the gradients
// autograd gives the written-out composition, with the same operations (mul's two products,
// silu_backward / gelu_backward), bit for bit.
class UnwrittenGatedReference : public torch::autograd::Function<UnwrittenGatedReference> {
 public:
  static torch::Tensor forward(AutogradContext* context, const torch::Tensor& gate, const torch::Tensor& up, bool gelu) {
    context->save_for_backward({gate, up});
    context->saved_data["gelu"] = gelu;
    return torch::empty(gate.sizes(), gate.options());
  }

  static variable_list backward(AutogradContext* context, variable_list grads) {
    const auto saved = context->get_saved_variables();
    const auto& gate = saved[0];
    const auto& up = saved[1];
    const bool gelu = context->saved_data["gelu"].toBool();
    const auto& grad = grads[0];
    const auto activated = gelu ? torch::gelu(gate, "tanh") : torch::silu(gate);
    const auto grad_activated = grad * up;
    const auto grad_gate =
        gelu ? at::gelu_backward(grad_activated, gate, "tanh") : at::silu_backward(grad_activated, gate);
    return {grad_gate, grad * activated, torch::Tensor()};
  }
};

// Whether the rotary kernels take x with these tables: the same dtype and device.
bool kernels_take_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return on_fused_kernels(x) && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
         cos.device() == x.device() && sin.device() == x.device();
}

bool kernels_take_pair(const torch::Tensor& gate, const torch::Tensor& up) {
  return on_fused_kernels(gate) && up.scalar_type() == gate.scalar_type() && up.device() == gate.device() &&
         gate.sizes() == up.sizes();
}

// act(gate) * up, GeGLU where `gelu`; `up` undefined: `gate` is a fused gate_up output (gate the
// first half of each row). On the CUDA kernels where they take it, else torch's operations (on
// the CPU, transformers' views of the halves). `written` false: only the output's place in
// autograd's graph, its values unwritten, its gradients the written path's bit for bit.
torch::Tensor gated_activation(bool gelu, const torch::Tensor& gate, const torch::Tensor& up, bool written) {
  if (!up.defined()) {
    if (on_fused_kernels(gate)) {
      return gelu ? FusedGatedActivationFunction<GeluTanhKernels>::apply(gate, written)
                  : FusedGatedActivationFunction<SiluKernels>::apply(gate, written);
    }
    const auto halves = gate.chunk(2, -1);
    return gated_activation(gelu, halves[0], halves[1], written);
  }
  if (kernels_take_pair(gate, up)) {
    return gelu ? GatedActivationFunction<GeluTanhKernels>::apply(gate, up, written)
                : GatedActivationFunction<SiluKernels>::apply(gate, up, written);
  }
  if (!written) return UnwrittenGatedReference::apply(gate, up, gelu);
  return gelu ? geglu_reference(gate, up) : swiglu_reference(gate, up);
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}

}  // namespace

bool on_fused_kernels(const torch::Tensor& tensor) {
  return kernels::kCudaKernelsBuilt && tensor.is_cuda() && tensor.is_floating_point() &&
         tensor.scalar_type() != torch::kFloat64;
}

torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto input_dtype = x.scalar_type();
  auto x32 = x.to(torch::kFloat32);
  auto variance = x32.pow(2).mean(-1, /*keepdim=*/true);
  x32 = x32 * torch::rsqrt(variance + eps);
  return weight * x32.to(input_dtype);
}

torch::Tensor unit_offset_rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto x32 = x.to(torch::kFloat32);
  x32 = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (x32 * (1.0 + weight.to(torch::kFloat32))).to(x.scalar_type());
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (on_fused_kernels(x) && weight.scalar_type() == x.scalar_type() && weight.device() == x.device()) {
    return RmsNormFunction::apply(x, weight, eps, /*unit_offset=*/false);
  }
  return rms_norm_reference(x, weight, eps);
}

torch::Tensor unit_offset_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (on_fused_kernels(x) && weight.scalar_type() == x.scalar_type() && weight.device() == x.device()) {
    return RmsNormFunction::apply(x, weight, eps, /*unit_offset=*/true);
  }
  return unit_offset_rms_norm_reference(x, weight, eps);
}

torch::Tensor rotary_embedding_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  // On transformers' [batch, heads, seq, head_dim] view, so that the result has the memory layout
  // attention was always given (CPU attention kernels round differently on another layout).
  const auto per_head = x.transpose(1, 2);
  return (per_head * cos.unsqueeze(1) + rotate_half(per_head) * sin.unsqueeze(1)).transpose(1, 2);
}

torch::Tensor rotary_embedding(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t rotary_dim = cos.size(-1);
  if (rotary_dim < x.size(-1)) {
    // Partial rotary (Phi-4-mini): the leading rotary_dim dimensions of each head turn, the rest pass.
    // Joined on the [batch, heads, seq, head_dim] view, the layout transformers' result has.
    const auto turned = rotary_embedding(x.narrow(-1, 0, rotary_dim), cos, sin);
    const auto passed = x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim);
    return torch::cat({turned.transpose(1, 2), passed.transpose(1, 2)}, -1).transpose(1, 2);
  }
  if (kernels_take_rotary(x, cos, sin)) return RotaryFunction::apply(x, cos, sin);
  return rotary_embedding_reference(x, cos, sin);
}

QueryKeyValue split_rotary_qkv(const torch::Tensor& fused, const torch::Tensor& cos, const torch::Tensor& sin,
                               int64_t heads, int64_t key_value_heads, int64_t head_dim) {
  if (fused.dim() != 3 || fused.size(-1) != (heads + 2 * key_value_heads) * head_dim) {
    throw Error(ErrorCode::kInternal, "split_rotary_qkv: the fused projection's output has shape " +
                c10::str(fused.sizes()) + ", expected [batch, seq, " + std::to_string((heads + 2 * key_value_heads) * head_dim) +
                "] for " + std::to_string(heads) + " query and " + std::to_string(key_value_heads) +
                " key/value heads of " + std::to_string(head_dim));
  }
  if (kernels_take_rotary(fused, cos, sin)) {
    const auto outputs = SplitRotaryQkvFunction::apply(fused, cos, sin, heads, key_value_heads, head_dim);
    return {outputs[0], outputs[1], outputs[2]};
  }
  return {rotary_embedding(head_columns(fused, 0, heads, head_dim), cos, sin),
          rotary_embedding(head_columns(fused, heads, key_value_heads, head_dim), cos, sin),
          head_columns(fused, heads + key_value_heads, key_value_heads, head_dim)};
}

torch::Tensor swiglu_reference(const torch::Tensor& gate, const torch::Tensor& up) {
  return torch::nn::functional::silu(gate) * up;
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) { return gated_activation(false, gate, up, true); }

torch::Tensor swiglu_of_fused(const torch::Tensor& gate_up) { return gated_activation(false, gate_up, {}, true); }

torch::Tensor geglu_of_fused(const torch::Tensor& gate_up) { return gated_activation(true, gate_up, {}, true); }

torch::Tensor geglu_reference(const torch::Tensor& gate, const torch::Tensor& up) {
  return torch::gelu(gate, "tanh") * up;
}

torch::Tensor geglu(const torch::Tensor& gate, const torch::Tensor& up) { return gated_activation(true, gate, up, true); }

torch::Tensor gated_activation_for_graph(bool gelu, const torch::Tensor& gate, const torch::Tensor& up) {
  return gated_activation(gelu, gate, up, false);
}

}  // namespace qtrain::trainer
