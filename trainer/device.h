#pragma once
#include <string>

#include <torch/torch.h>

namespace qtrain::trainer {

// "cpu", "cuda", "cuda:N" or "auto" (CUDA when a GPU is visible) -> a device; a CUDA device
// that is not there is an Error that says what to use instead.
torch::Device resolve_device(const std::string& name);

}  // namespace qtrain::trainer
