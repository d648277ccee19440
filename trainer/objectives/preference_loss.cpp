#include "trainer/objectives/preference_loss.h"

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

namespace F = torch::nn::functional;

// log(1 - e^x) for x < 0, without cancellation on either side of -ln 2.
torch::Tensor log_one_minus_exp(const torch::Tensor& x) {
  constexpr double kMinusLn2 = -0.6931471805599453;
  return torch::where(x < kMinusLn2, torch::log1p(-torch::exp(x)), torch::log(-torch::expm1(x)));
}

double mean_of(const torch::Tensor& values) { return values.detach().to(torch::kFloat64).mean().item<double>(); }

// TRL's reward metrics: the rewards of both completions, how often the chosen one's is higher
// (strictly), and the mean margin.
void add_reward_metrics(const torch::Tensor& chosen_rewards, const torch::Tensor& rejected_rewards,
                        std::vector<std::pair<std::string, double>>& metrics) {
  metrics.emplace_back("rewards/chosen", mean_of(chosen_rewards));
  metrics.emplace_back("rewards/rejected", mean_of(rejected_rewards));
  metrics.emplace_back("rewards/accuracies", mean_of(chosen_rewards.gt(rejected_rewards).to(torch::kFloat64)));
  metrics.emplace_back("rewards/margins", mean_of(chosen_rewards - rejected_rewards));
}

// -log sigmoid(x) (1 - e) - log sigmoid(-x) e: the sigmoid loss with label smoothing e.
torch::Tensor smoothed_sigmoid_loss(const torch::Tensor& x, double smoothing) {
  auto loss = -F::logsigmoid(x) * (1 - smoothing);
  if (smoothing > 0) loss = loss - F::logsigmoid(-x) * smoothing;
  return loss;
}

PreferenceLoss dpo_loss(const PairLogProbs& policy, const PairLogProbs& reference, const PreferenceOptions& options) {
  const double beta = options.beta;
  const auto chosen_ratio = policy.chosen - reference.chosen.to(policy.chosen.dtype());
  const auto rejected_ratio = policy.rejected - reference.rejected.to(policy.rejected.dtype());
  const auto margin = chosen_ratio - rejected_ratio;
  torch::Tensor per_pair;
  const auto& type = options.loss_type;
  if (type == "sigmoid") {
    per_pair = -F::logsigmoid(beta * margin);
  } else if (type == "hinge") {
    per_pair = torch::relu(1 - beta * margin);
  } else if (type == "ipo") {
    const auto normalised = chosen_ratio / policy.chosen_tokens.clamp_min(1) - rejected_ratio / policy.rejected_tokens.clamp_min(1);
    per_pair = (normalised - 1 / (2 * beta)).pow(2);
  } else if (type == "robust") {
    const double e = options.label_smoothing;
    per_pair = (-(1 - e) * F::logsigmoid(beta * margin) + e * F::logsigmoid(-beta * margin)) / (1 - 2 * e);
  } else {
    throw Error(ErrorCode::kRecipe, "dpo.loss_type: '" + type + "' is not a DPO loss type");
  }
  PreferenceLoss result;
  result.loss = per_pair.mean();
  add_reward_metrics(beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), result.metrics);
  result.metrics.emplace_back("logps/chosen", mean_of(policy.chosen));
  result.metrics.emplace_back("logps/rejected", mean_of(policy.rejected));
  return result;
}

PreferenceLoss orpo_loss(const PairLogProbs& policy, const PreferenceOptions& options) {
  const auto chosen = policy.chosen / policy.chosen_tokens.clamp_min(1);
  const auto rejected = policy.rejected / policy.rejected_tokens.clamp_min(1);
  const auto log_odds = (chosen - rejected) - (log_one_minus_exp(chosen) - log_one_minus_exp(rejected));
  const auto ratio = F::logsigmoid(log_odds);
  const auto nll = policy.chosen_sequence_nll / policy.chosen_sequence_tokens.clamp_min(1);
  PreferenceLoss result;
  result.loss = nll - options.beta * ratio.mean();
  add_reward_metrics(options.beta * chosen.detach(), options.beta * rejected.detach(), result.metrics);
  result.metrics.emplace_back("logps/chosen", mean_of(chosen));
  result.metrics.emplace_back("logps/rejected", mean_of(rejected));
  result.metrics.emplace_back("nll_loss", mean_of(nll));
  result.metrics.emplace_back("log_odds_ratio", mean_of(ratio));
  result.metrics.emplace_back("log_odds_chosen", mean_of(log_odds));
  return result;
}

PreferenceLoss simpo_loss(const PairLogProbs& policy, const PreferenceOptions& options) {
  const double beta = options.beta;
  const auto chosen = policy.chosen / policy.chosen_tokens.clamp_min(1);
  const auto rejected = policy.rejected / policy.rejected_tokens.clamp_min(1);
  const auto z = (chosen - rejected) - options.simpo_gamma / beta;
  PreferenceLoss result;
  result.loss = smoothed_sigmoid_loss(beta * z, options.label_smoothing).mean();
  // The NLL of the chosen completions, a token mean over the micro-batch; TRL logs 0 without it.
  const auto nll = options.cpo_alpha != 0 ? -policy.chosen.sum() / policy.chosen_tokens.sum().clamp_min(1)
                                          : torch::zeros({}, policy.chosen.options());
  if (options.cpo_alpha != 0) result.loss = result.loss + options.cpo_alpha * nll;
  add_reward_metrics(beta * chosen.detach(), beta * rejected.detach(), result.metrics);
  result.metrics.emplace_back("logps/chosen", mean_of(chosen));
  result.metrics.emplace_back("logps/rejected", mean_of(rejected));
  result.metrics.emplace_back("nll_loss", mean_of(nll));
  return result;
}

}  // namespace

PreferenceLoss preference_loss(const PairLogProbs& policy, const PairLogProbs* reference, const PreferenceOptions& options) {
  switch (options.objective) {
    case Objective::kDpo:
      if (reference == nullptr) throw Error(ErrorCode::kInternal, "DPO's loss needs the reference's log-probabilities");
      return dpo_loss(policy, *reference, options);
    case Objective::kOrpo:
      return orpo_loss(policy, options);
    case Objective::kSimpo:
      return simpo_loss(policy, options);
    case Objective::kSft:
      break;
  }
  throw Error(ErrorCode::kInternal, "preference_loss called for the sft objective");
}

}  // namespace qtrain::trainer
