#pragma once
// The preference objectives' loss for one micro-batch of pairs, from the sequences'
// log-probabilities, as TRL 1.16 computes it (trl/trainer/dpo_trainer.py, trl/experimental/orpo,
// trl/experimental/cpo). With c, r the policy's summed log-probabilities of the chosen and the
// rejected completion, c0, r0 the reference's, d = beta ((c - c0) - (r - r0)), and per pair:
//   dpo sigmoid   -log sigmoid(d)
//   dpo hinge     relu(1 - d)
//   dpo ipo       ((c - c0) / n_c - (r - r0) / n_r - 1 / (2 beta))^2   (n: completion tokens)
//   dpo robust    (-(1 - e) log sigmoid(d) + e log sigmoid(-d)) / (1 - 2e)   (e: label_smoothing)
//   orpo          with a = c / n_c, b = r / n_r: NLL - beta log sigmoid((a - b) - (log(1 - e^a) - log(1 - e^b)))
//                 where NLL is the token mean over every predicted token of the chosen sequences
//                 (prompts included, as TRL's ORPOTrainer takes it)
//   simpo         z = (a - b) - gamma / beta: -(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z),
//                 plus cpo_alpha times the token mean NLL of the chosen completions
// The loss is the mean over the pairs (plus the NLL term); the metrics are TRL's, averaged alike.
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "trainer/objectives/objectives.h"

namespace qtrain::trainer {

struct PreferenceOptions {
  Objective objective = Objective::kDpo;
  double beta = 0.1;
  std::string loss_type = "sigmoid";  // dpo
  double label_smoothing = 0;         // dpo robust, simpo
  double simpo_gamma = 0.5;
  double cpo_alpha = 1.0;             // simpo
};

// One micro-batch's sequence log-probabilities (trainer/objectives/pair_log_probs.h).
struct PairLogProbs {
  torch::Tensor chosen;           // [pairs] fp32: summed over the chosen completion's tokens
  torch::Tensor rejected;         // [pairs] fp32
  torch::Tensor chosen_tokens;    // [pairs] fp32: how many tokens each completion has
  torch::Tensor rejected_tokens;  // [pairs] fp32
  // Every predicted token of the chosen sequences, prompts included: the summed negative
  // log-probability and the count (scalars; ORPO's NLL). Undefined for a reference.
  torch::Tensor chosen_sequence_nll;
  torch::Tensor chosen_sequence_tokens;
};

struct PreferenceLoss {
  torch::Tensor loss;  // scalar fp32, differentiable through the policy's log-probabilities
  // TRL's metrics (rewards/chosen, ...): their names, and their means as one float64 vector on the
  // loss's device, so that reading them is one wait for the device, which a step makes after its
  // backward has been queued.
  std::vector<std::string> metric_names;
  torch::Tensor metric_values;
  // Adds each metric to its running sum in `sums` (the names in order; an empty `sums` starts them).
  void add_metrics_to(std::vector<std::pair<std::string, double>>& sums) const;
};

// The metrics that progress lines show beside the loss (rewards/accuracies and rewards/margins);
// every metric goes to metrics.jsonl and TensorBoard.
bool shown_in_progress_line(const std::string& metric_name);

// `reference` is needed by dpo (Error otherwise) and ignored by the others.
PreferenceLoss preference_loss(const PairLogProbs& policy, const PairLogProbs* reference, const PreferenceOptions& options);

}  // namespace qtrain::trainer
