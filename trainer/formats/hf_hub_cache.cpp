#include "trainer/formats/hf_hub_cache.h"

#include <limits.h>
#include <pwd.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

const char* environment(const char* name) { return std::getenv(name); }

// os.path.expanduser: a leading ~ or ~user.
std::string expand_user(const std::string& path) {
  if (path.empty() || path[0] != '~') return path;
  const auto slash = path.find('/');
  const std::string user = path.substr(1, slash == std::string::npos ? std::string::npos : slash - 1);
  std::string home;
  if (user.empty()) {
    if (const char* value = environment("HOME")) {
      home = value;
    } else if (const passwd* entry = getpwuid(getuid())) {
      home = entry->pw_dir;
    }
  } else if (const passwd* entry = getpwnam(user.c_str())) {
    home = entry->pw_dir;
  }
  if (home.empty()) return path;
  return home + (slash == std::string::npos ? "" : path.substr(slash));
}

bool is_name_character(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// os.path.expandvars: $NAME and ${NAME} of set variables; others stay as they are.
std::string expand_variables(const std::string& path) {
  std::string out;
  for (size_t index = 0; index < path.size();) {
    if (path[index] != '$') {
      out += path[index++];
      continue;
    }
    const bool braced = index + 1 < path.size() && path[index + 1] == '{';
    size_t start = index + (braced ? 2 : 1), end = start;
    if (braced) {
      end = path.find('}', start);
    } else {
      while (end < path.size() && is_name_character(path[end])) ++end;
    }
    if (end == std::string::npos || end == start) {
      out += path[index++];
      continue;
    }
    const char* value = environment(path.substr(start, end - start).c_str());
    const size_t after = braced ? end + 1 : end;
    out += value ? std::string(value) : path.substr(index, after - index);
    index = after;
  }
  return out;
}

// os.path.join(a, b) for a relative b.
std::string join(const std::string& directory, const std::string& name) {
  if (directory.empty()) return name;
  return directory.back() == '/' ? directory + name : directory + "/" + name;
}

// pathlib's resolve(): absolute, with the symlinks of the part that exists resolved.
std::string absolute_resolved(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) != nullptr) return resolved;
  if (!path.empty() && path[0] == '/') return path;
  char here[PATH_MAX];
  return getcwd(here, sizeof here) != nullptr ? join(here, path) : path;
}

bool is_directory(const std::string& path) {
  struct stat status {};
  return ::stat(path.c_str(), &status) == 0 && S_ISDIR(status.st_mode);
}

bool exists(const std::string& path) {
  struct stat status {};
  return ::stat(path.c_str(), &status) == 0;
}

bool is_commit_hash(const std::string& revision) {
  if (revision.size() != 40) return false;
  for (const char c : revision) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && (c < 'a' || c > 'f')) return false;
  }
  return true;
}

bool is_valid_part(const std::string& part) {
  if (part.empty() || part.size() > 96) return false;
  for (const char c : part) {
    if (!is_name_character(c) && c != '-' && c != '.') return false;
  }
  return is_name_character(part.front()) && is_name_character(part.back());
}

// huggingface_hub's _is_true: 1, ON, YES or TRUE in any case.
bool is_true(const char* value) {
  if (value == nullptr) return false;
  std::string upper;
  for (const char* c = value; *c; ++c) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
  return upper == "1" || upper == "ON" || upper == "YES" || upper == "TRUE";
}

std::string repo_folder(const std::string& repo_id) {
  std::string folder = "models--";
  for (const char c : repo_id) folder += c == '/' ? std::string("--") : std::string(1, c);
  return folder;
}

}  // namespace

std::string hf_hub_cache_dir() {
  std::string cache;
  if (const char* value = environment("HF_HUB_CACHE")) {
    cache = value;
  } else if (const char* legacy = environment("HUGGINGFACE_HUB_CACHE")) {
    cache = legacy;
  } else {
    const char* xdg = environment("XDG_CACHE_HOME");
    const char* home = environment("HF_HOME");
    const std::string hf_home = home ? home : join(xdg ? xdg : expand_user("~/.cache"), "huggingface");
    cache = join(expand_variables(expand_user(hf_home)), "hub");
  }
  return absolute_resolved(expand_variables(expand_user(cache)));
}

bool is_hf_repo_id(const std::string& text) {
  const auto slash = text.find('/');
  if (slash != std::string::npos && text.find('/', slash + 1) != std::string::npos) return false;
  const bool parts_valid = slash == std::string::npos
                               ? is_valid_part(text)
                               : is_valid_part(text.substr(0, slash)) && is_valid_part(text.substr(slash + 1));
  const bool git_suffix = text.size() >= 4 && text.compare(text.size() - 4, 4, ".git") == 0;
  return parts_valid && text.find("--") == std::string::npos && text.find("..") == std::string::npos && !git_suffix;
}

std::optional<std::string> find_cached_snapshot(const std::string& repo_id, const std::string& revision) {
  const std::string repo = join(hf_hub_cache_dir(), repo_folder(repo_id));
  std::string commit = revision;
  if (!is_commit_hash(revision)) {
    // The ref file holds the commit as written, without a newline (and is not stripped).
    const std::string ref = repo + "/refs/" + revision;
    if (is_directory(ref)) return std::nullopt;
    std::ifstream file(ref, std::ios::binary);
    if (!file) return std::nullopt;
    std::ostringstream text;
    text << file.rdbuf();
    commit = text.str();
    if (commit.empty() || commit.find('/') != std::string::npos || commit.find('\0') != std::string::npos) return std::nullopt;
  }
  const std::string snapshot = repo + "/snapshots/" + commit;
  if (!exists(snapshot)) return std::nullopt;
  return snapshot;
}

std::string resolve_model_path(const std::string& path, const std::string& what) {
  if (path.empty() || exists(path)) return path;
  const auto at = path.find('@');
  const std::string repo_id = path.substr(0, at);
  const std::string revision = at == std::string::npos ? "main" : path.substr(at + 1);
  if (!is_hf_repo_id(repo_id) || revision.empty()) return path;
  if (auto snapshot = find_cached_snapshot(repo_id, revision)) return *snapshot;
  const std::string cache = hf_hub_cache_dir();
  const std::string looked_at = join(cache, repo_folder(repo_id)) +
                                (is_commit_hash(revision) ? "/snapshots/" + revision : "/refs/" + revision);
  const char* offline_flag = environment("HF_HUB_OFFLINE");
  const bool offline = is_true(offline_flag && *offline_flag ? offline_flag : environment("TRANSFORMERS_OFFLINE"));
  throw Error(ErrorCode::kUsage,
              what + " '" + path + "': no such directory, and the Hugging Face cache " + cache +
                  " (HF_HUB_CACHE / HF_HOME) holds no snapshot of " + repo_id + " at revision " + revision +
                  " (looked for " + looked_at + "). qtrain does not download; fill the cache with: hf download " +
                  repo_id + (at == std::string::npos ? "" : " --revision " + revision) +
                  (offline ? " (HF_HUB_OFFLINE is set here: run it where the Hub is reachable, with the same HF_HOME)" : ""));
}

}  // namespace qtrain::trainer
