#pragma once
// What a run minimises (train.objective), one row per objective: next-token loss, or a preference
// objective over pairs of completions (data.format preference), as TRL 1.16 computes it:
//   sft    next-token cross-entropy on the labelled tokens
//   dpo    Direct Preference Optimization (Rafailov et al. 2023) against a reference model: the
//          base with the adapters switched off, or log-probabilities computed before training
//   orpo   Odds Ratio Preference Optimization (Hong et al. 2024): NLL of the chosen sequences plus
//          a log-odds term, no reference (TRL's experimental ORPOTrainer)
//   simpo  SimPO (Meng et al. 2024) as TRL's CPOTrainer(loss_type="simpo"): length-normalised
//          rewards with a margin, no reference, plus cpo_alpha times the chosen completions' NLL
// Adding one is a row here and its formula in preference_loss.cpp.
#include <cstdint>
#include <string>
#include <vector>

namespace qtrain::trainer {

enum class Objective { kSft, kDpo, kOrpo, kSimpo };

struct ObjectiveRow {
  Objective objective;
  std::string name;
  bool pairs;                // trains on preference pairs (data.format preference)
  bool reference;            // needs the reference model's log-probabilities
  bool average_log_probs;    // compares per-token means of the completions' log-probabilities, not sums
  std::string doc;
};

const std::vector<ObjectiveRow>& objective_rows();
std::vector<std::string> objective_names();
const ObjectiveRow& objective_row(Objective objective);
// Error naming `key` and the choices when `name` is none of them.
const ObjectiveRow& find_objective(const std::string& name, const std::string& key = "train.objective");

// The longest row of a batch: a preference pair holds two sequences of data.max_seq_len each.
int64_t longest_row_tokens(const std::string& objective, int64_t max_seq_len);

// DPO's loss types (dpo.loss_type), TRL's names.
struct DpoLossTypeRow {
  std::string name;
  bool label_smoothing;  // takes dpo.label_smoothing
  std::string doc;
};
const std::vector<DpoLossTypeRow>& dpo_loss_type_rows();
std::vector<std::string> dpo_loss_type_names();

}  // namespace qtrain::trainer
