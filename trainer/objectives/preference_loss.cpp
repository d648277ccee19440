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

// The metrics' means as 0-d float64 tensors on the device, stacked into the loss's vector.
class MetricMeans {
 public:
  void add(std::string name, const torch::Tensor& values) {
    names_.push_back(std::move(name));
    means_.push_back(values.detach().to(torch::kFloat64).mean());
  }

  void put_into(PreferenceLoss& loss) {
    loss.metric_names = std::move(names_);
    loss.metric_values = torch::stack(means_);
  }

 private:
  std::vector<std::string> names_;
  std::vector<torch::Tensor> means_;
};

constexpr const char* kRewardAccuracies = "rewards/accuracies";
constexpr const char* kRewardMargins = "rewards/margins";

// TRL's reward metrics: the rewards of both completions, how often the chosen one's is higher
// (strictly), and the mean margin.
void add_reward_metrics(const torch::Tensor& chosen_rewards, const torch::Tensor& rejected_rewards, MetricMeans& metrics) {
  metrics.add("rewards/chosen", chosen_rewards);
  metrics.add("rewards/rejected", rejected_rewards);
  metrics.add(kRewardAccuracies, chosen_rewards.gt(rejected_rewards));
  metrics.add(kRewardMargins, chosen_rewards - rejected_rewards);
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
  MetricMeans metrics;
  add_reward_metrics(beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), metrics);
  metrics.add("logps/chosen", policy.chosen);
  metrics.add("logps/rejected", policy.rejected);
  metrics.put_into(result);
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
  MetricMeans metrics;
  add_reward_metrics(options.beta * chosen.detach(), options.beta * rejected.detach(), metrics);
  metrics.add("logps/chosen", chosen);
  metrics.add("logps/rejected", rejected);
  metrics.add("nll_loss", nll);
  metrics.add("log_odds_ratio", ratio);
  metrics.add("log_odds_chosen", log_odds);
  metrics.put_into(result);
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
  MetricMeans metrics;
  add_reward_metrics(beta * chosen.detach(), beta * rejected.detach(), metrics);
  metrics.add("logps/chosen", chosen);
  metrics.add("logps/rejected", rejected);
  metrics.add("nll_loss", nll);
  metrics.put_into(result);
  return result;
}

}  // namespace

bool shown_in_progress_line(const std::string& metric_name) {
  return metric_name == kRewardAccuracies || metric_name == kRewardMargins;
}

void PreferenceLoss::add_metrics_to(std::vector<std::pair<std::string, double>>& sums) const {
  const auto host = metric_values.cpu();
  const double* values = host.data_ptr<double>();
  if (sums.empty()) {
    for (const auto& name : metric_names) sums.emplace_back(name, 0.0);
  }
  for (size_t index = 0; index < metric_names.size(); ++index) sums[index].second += values[index];
}

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
