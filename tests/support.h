#pragma once
// What every test suite needs: where ../shared/fixtures, the sources, the qtrain binary and the
// interop Python are, temporary directories, and running a command.
#include <glob.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "trainer/base/file_system.h"

namespace qtrain::testing {

inline std::string fixtures_dir() {
  if (const char* overridden = std::getenv("QTRAIN_FIXTURES")) return overridden;
  return QTRAIN_FIXTURES_DIR;
}

inline std::string fixture(const std::string& relative) { return fixtures_dir() + "/" + relative; }

inline std::string source_dir() { return QTRAIN_SOURCE_DIR; }

inline std::string qtrain_binary() { return QTRAIN_BINARY; }

inline std::string python() {
  if (const char* overridden = std::getenv("QTRAIN_PYTHON")) return overridden;
  return QTRAIN_PYTHON;
}

struct CommandResult {
  int status = -1;     // exit status, or -1 when the command did not exit normally
  std::string output;  // stdout (and stderr when the command redirects it)
};

inline CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer{};
  size_t count = 0;
  while ((count = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), count);
  const int status = pclose(pipe);
  if (WIFEXITED(status)) result.status = WEXITSTATUS(status);
  return result;
}

// A local TCP port nobody listens on right now (for a rendezvous in a test).
// The qtrain binary with these arguments, its stderr folded into the output.
inline CommandResult qtrain(const std::string& arguments) { return run_command(qtrain_binary() + " " + arguments + " 2>&1"); }

inline int free_port() {
  const int socket_fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(socket_fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  getsockname(socket_fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(socket_fd);
  return ntohs(address.sin_port);
}

// The qtrain::Error message `action` throws; "" when it throws none (any other exception fails the
// test).
inline std::string error_message(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// The whole file, or "" when it cannot be read (for failure messages).
inline std::string read_text(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// A Python statement that exits 0 when every module in `modules` (space separated) is
// installed. importlib's find_spec finds a module without importing it: importing torch alone
// takes 3 s, and a hundred tests ask before they run (a dotted name imports its parents).
inline std::string modules_installed(const std::string& modules) {
  return "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in \"" + modules + "\".split()))";
}

// True when the interop Python has every module in `modules` (space separated).
inline bool python_has(const std::string& modules) {
  return run_command(python() + " -c '" + modules_installed(modules) + "' >/dev/null 2>&1").status == 0;
}

// Why a test that needs every module in `modules` (space separated) in the interop Python skips
// ("python3 lacks torch/safetensors (run tools/setup.sh)"); "" when that Python has them all.
inline std::string python_lacks(const std::string& modules) {
  if (python_has(modules)) return "";
  std::string names = modules;
  std::replace(names.begin(), names.end(), ' ', '/');
  return python() + " lacks " + names + " (run tools/setup.sh)";
}

// The interop Python (QTRAIN_PYTHON) if it has every module in `modules` (space separated),
// else the project's environment (~/.cache/qtrain/venv-torch2.11.0-*) if this machine has one
// that does; "" when none does.
inline std::string find_python_with(const std::string& modules) {
  std::vector<std::string> candidates = {python()};
  if (const char* home = std::getenv("HOME")) {
    glob_t found{};
    if (::glob((std::string(home) + "/.cache/qtrain/venv-torch2.11.0-*/bin/python").c_str(), 0, nullptr, &found) == 0) {
      for (size_t index = 0; index < found.gl_pathc; ++index) candidates.emplace_back(found.gl_pathv[index]);
    }
    globfree(&found);
  }
  for (const auto& candidate : candidates) {
    if (run_command("'" + candidate + "' -c '" + modules_installed(modules) + "' >/dev/null 2>&1").status == 0) return candidate;
  }
  return "";
}

// Runs tests/interop/`script` with the interop Python and `arguments`; its output (stdout and
// stderr) comes back for the failure message.
inline CommandResult run_interop_script(const std::string& script, const std::string& arguments) {
  return run_command(python() + " " + source_dir() + "/tests/interop/" + script + " " + arguments + " 2>&1");
}

// tests/interop/gguf_model.py quantize-compare with `python` (one with llama_cpp): llama.cpp's own
// quantizer on `f32_gguf` to file type `type`, against `prefix` + type + ".gguf" (the same
// tensors, types and bytes), then llama.cpp runs ours. `summary` is the script's line for the type
// ("Q4_K_M: 39 of 39 tensors byte for byte as llama_model_quantize's"), or empty.
struct QuantizeComparison {
  std::string command;
  CommandResult result;
  std::string summary;
};
inline QuantizeComparison compare_with_llama_quantize(const std::string& python, const std::string& f32_gguf,
                                                      const std::string& prefix, const std::string& type) {
  QuantizeComparison comparison;
  comparison.command = "'" + python + "' '" + source_dir() + "/tests/interop/gguf_model.py' quantize-compare '" + f32_gguf +
                       "' '" + prefix + "' " + type + " 2>&1";
  comparison.result = run_command(comparison.command);
  const auto& output = comparison.result.output;
  const auto line = output.rfind(type + ": ");
  if (line != std::string::npos) comparison.summary = output.substr(line, output.find('\n', line) - line);
  return comparison;
}

// A fresh directory under the system's temp dir, removed when the object goes.
class TempDir {
 public:
  TempDir() {
    std::random_device seed;
    path_ = std::filesystem::temp_directory_path() / ("qtrain-test-" + std::to_string(seed()) + std::to_string(seed()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { trainer::remove_tree(path_.string()); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  // Writes `text` to `relative` (creating folders) and returns the file's path.
  std::string write(const std::string& relative, const std::string& text) const {
    const auto file = path_ / relative;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file, std::ios::binary) << text;
    return file.string();
  }

 private:
  std::filesystem::path path_;
};

}  // namespace qtrain::testing
