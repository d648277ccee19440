#pragma once
// Fake quantization as autograd functions: the forward rounds onto the grid and back
// (quantize.h's dequantize(quantize(x)), returned in x's dtype), the backward is a
// straight-through estimator.
//
// fake_quantize: scale and zero point are constants (from an observer, or computed from x and
// detached, as torchao's fake quantizers do). dL/dx = dL/dx^ where x lies inside the clipping
// range (FakeQuantized::inside), 0 outside: the derivative of the clipping x -> clamp(x, ...)
// that the rounding is a noisy copy of.
//
// fake_quantize_learned_scale: LSQ (Esser et al. 2020, "Learned Step Size Quantization"), int
// formats with an integer zero point only. With u = x / s, the grid's ends in steps -Qn = quant_min - z, Qp = quant_max - z,
// and x^ = round(clamp(u, -Qn, Qp)) * s (the same value as the int formula of quant_spec.h):
//   dx^/dx = 1 if -Qn < u < Qp, else 0
//   dx^/ds = round(u) - u if -Qn < u < Qp;  -Qn if u <= -Qn;  Qp if u >= Qp
// and the scale's gradient is multiplied by `gradient_scale` (the paper's g, lsq_gradient_scale).
// The scale passes through effective_scale (eps, fp16 rounding) with a gradient of 1.
#include <torch/torch.h>

#include "qat/quantize.h"

namespace qtrain::qat {

torch::Tensor fake_quantize(const torch::Tensor& x, const QuantSpec& spec, const QuantParams& params);

// `scale`: fp32 params_shape(spec, x.shape), usually a Parameter; `zero_point`: same shape,
// integers (zeros for symmetric specs), not trained.
torch::Tensor fake_quantize_learned_scale(const torch::Tensor& x, const torch::Tensor& scale,
                                          const torch::Tensor& zero_point, const QuantSpec& spec,
                                          double gradient_scale);

// LSQ's g = 1 / sqrt(N * Qp): N the elements sharing one scale (the layer's weights for a
// per-tensor scale, as in the paper), Qp the grid's positive end (quant_max for symmetric specs,
// quant_max - quant_min, the unsigned grid's, for asymmetric ones).
double lsq_gradient_scale(const QuantSpec& spec, int64_t elements_per_scale);

}  // namespace qtrain::qat
