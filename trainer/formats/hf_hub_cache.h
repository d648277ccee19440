#pragma once
// Models by name: `model.path` and every command's --model take a model directory or a Hugging
// Face repository id, ORG/NAME[@REVISION] (REVISION: a branch, tag or 40-hex commit; main by
// default), found in the Hugging Face cache that huggingface_hub, transformers and `hf download`
// fill, as huggingface_hub's snapshot_download(..., local_files_only=True) finds it:
//   the cache    HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else
//                XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (~ and $VARS expanded)
//   the model    CACHE/models--ORG--NAME/snapshots/COMMIT, COMMIT read from refs/REVISION unless
//                REVISION is itself a commit
// qtrain never downloads: a model not there is an error naming the cache searched and the
// `hf download` command that fills it.
#include <optional>
#include <string>

namespace qtrain::trainer {

// `path` itself when it exists (or is no repository id); otherwise the snapshot folder of the
// repository it names. Error naming `what` (model.path, --model), the cache and the command to
// run when the cache has no such snapshot.
std::string resolve_model_path(const std::string& path, const std::string& what);

// The snapshot folder, or none (without errors) — for callers that only ask.
std::optional<std::string> find_cached_snapshot(const std::string& repo_id, const std::string& revision);

// huggingface_hub's cache folder from the environment, absolute.
std::string hf_hub_cache_dir();

// Whether `text` is a repository id huggingface_hub accepts (validate_repo_id): NAME or ORG/NAME,
// each 1-96 of A-Z a-z 0-9 _ - . starting and ending with a letter, digit or _, no "--" or "..",
// not ending in ".git".
bool is_hf_repo_id(const std::string& text);

}  // namespace qtrain::trainer
