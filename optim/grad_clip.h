#pragma once
// Gradient clipping by global L2 norm, as torch.nn.utils.clip_grad_norm_ (norm_type 2):
//   norm = || (||g_1||, ..., ||g_n||) ||_2,  coef = min(1, max_norm / (norm + 1e-6)),  g_i *= coef
// Norms are accumulated in fp32 (fp64 when any gradient is fp64), also for bf16/fp16
// gradients. Like PyTorch, a non-finite norm is returned as is and poisons the gradients (the
// loss scaler's inf/NaN check skips such steps).
#include <torch/torch.h>

#include <vector>

namespace qtrain::optim {

// Scales the gradients of `parameters` in place so their global L2 norm is at most `max_norm`
// and returns the norm BEFORE clipping. max_norm <= 0 clips nothing but still returns the norm.
// Parameters without a gradient are ignored; with no gradients at all the norm is 0.
double clip_grad_norm(const std::vector<torch::Tensor>& parameters, double max_norm);

// The same, the norm left where the gradients are (a 0-d fp32 / fp64 tensor; undefined with no
// gradients), so that a step can queue its optimizer update before it waits to read the norm.
torch::Tensor clip_grad_norm_on_device(const std::vector<torch::Tensor>& parameters, double max_norm);

}  // namespace qtrain::optim
