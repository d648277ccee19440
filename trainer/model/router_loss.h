#pragma once
// The load-balancing loss of a mixture-of-experts model (Switch Transformer's, as transformers'
// load_balancing_loss_func computes it over every layer's router at once):
//
//     aux = E · Σ_e (n_e / N) · (P_e / N)
//
// n_e: how often expert e is among a token's top-k, P_e: the sum of its softmax probability, both
// over every router row (layer × token) of the forward pass, N the number of rows. The training
// loss adds router_aux_loss_coef · aux where config.json's output_router_logits asks for it.
//
// Each block's router reports its rows as it runs (observe), outside a checkpoint's
// recomputation. n is a count, so aux is linear in the probabilities: ∂aux/∂p_{row,e} =
// E · n_e / N². The model's last layer has run before backward reaches any router, so observe
// attaches that gradient (times what the caller scales the loss by) to each router's
// probabilities in backward, also inside recomputed layers, without keeping any router's
// probabilities for a loss term built after the forward pass.
#include <torch/torch.h>

#include <cstdint>
#include <memory>

namespace qtrain::trainer {

class RouterLoss {
 public:
  explicit RouterLoss(int64_t experts) : experts_(experts) {}
  // Starts a forward pass: its sums start at zero.
  void begin();
  // probabilities [rows, experts] fp32 (the softmax over every expert), chosen [rows, k] int64 ->
  // probabilities, with the loss's gradient joining theirs in backward under grad mode.
  torch::Tensor observe(const torch::Tensor& probabilities, const torch::Tensor& chosen);
  // aux of the pass since begin(): an fp64 scalar on the routers' device, read without waiting
  // for it (undefined when no router ran).
  torch::Tensor aux() const;
  // The same on the host (0 when no router ran); synchronises with the device.
  double value() const;
  // What backward's loss holds of aux: `scale` · aux (the coefficient times the loss's weight).
  void set_gradient_scale(double scale) { gradient_scale_ = scale; }

  // The gradient observe attaches, for the rows of a pass: E · scale · n / N² ([experts] fp32).
  torch::Tensor probability_gradient() const;

 private:
  int64_t experts_;
  torch::Tensor counts_;         // n [experts] fp32
  torch::Tensor probabilities_;  // P [experts] fp32
  double rows_ = 0;              // N
  double gradient_scale_ = 0;
};

}  // namespace qtrain::trainer
