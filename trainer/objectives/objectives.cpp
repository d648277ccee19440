#include "trainer/objectives/objectives.h"

#include "kernels/error.h"

namespace qtrain::trainer {

const std::vector<ObjectiveRow>& objective_rows() {
  static const std::vector<ObjectiveRow> rows = {
      {Objective::kSft, "sft", false, false, false, "next-token cross-entropy on the labelled tokens"},
      {Objective::kDpo, "dpo", true, true, false,
       "DPO on preference pairs against the reference (the base with the adapters off)"},
      {Objective::kOrpo, "orpo", true, false, true, "ORPO on preference pairs: chosen NLL + beta x log-odds ratio"},
      {Objective::kSimpo, "simpo", true, false, true,
       "SimPO on preference pairs (TRL's CPO loss_type simpo): length-normalised rewards, margin simpo_gamma"},
  };
  return rows;
}

std::vector<std::string> objective_names() {
  std::vector<std::string> names;
  for (const auto& row : objective_rows()) names.push_back(row.name);
  return names;
}

const ObjectiveRow& objective_row(Objective objective) {
  for (const auto& row : objective_rows()) {
    if (row.objective == objective) return row;
  }
  throw Error(ErrorCode::kInternal, "an objective without a row in objective_rows()");
}

const ObjectiveRow& find_objective(const std::string& name, const std::string& key) {
  for (const auto& row : objective_rows()) {
    if (row.name == name) return row;
  }
  std::string choices;
  for (const auto& row : objective_rows()) choices += (choices.empty() ? "" : ", ") + row.name;
  throw Error(ErrorCode::kRecipe, key + ": '" + name + "' is not an objective; expected one of " + choices);
}

int64_t longest_row_tokens(const std::string& objective, int64_t max_seq_len) {
  return find_objective(objective).pairs ? 2 * max_seq_len : max_seq_len;
}

const std::vector<DpoLossTypeRow>& dpo_loss_type_rows() {
  static const std::vector<DpoLossTypeRow> rows = {
      {"sigmoid", false, "-log sigmoid(beta x margin): the paper's loss"},
      {"ipo", false, "IPO: the length-normalised margin regressed to 1 / (2 beta)"},
      {"hinge", false, "relu(1 - beta x margin) (SLiC)"},
      {"robust", true, "sigmoid with label_smoothing's chance of a flipped label, unbiased (rDPO)"},
  };
  return rows;
}

std::vector<std::string> dpo_loss_type_names() {
  std::vector<std::string> names;
  for (const auto& row : dpo_loss_type_rows()) names.push_back(row.name);
  return names;
}

}  // namespace qtrain::trainer
