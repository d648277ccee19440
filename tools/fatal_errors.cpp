#include "tools/fatal_errors.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <boost/program_options/errors.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <new>

#include "kernels/error.h"

namespace qtrain::tools {
namespace {

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

struct Report {
  ErrorCode code;
  std::string message;
  int exit_status;
};

// What the user sees for each kind of exception. LibTorch's messages carry a C++ backtrace
// after the first line (and, for TORCH_CHECK, the source location): kept only with --debug.
Report describe(const std::exception_ptr& error, bool debug) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& error) {
    return {error.code(), error.what(), kExitUserError};
  } catch (const boost::program_options::error& error) {
    return {ErrorCode::kUsage, error.what(), kExitUserError};
  } catch (const c10::OutOfMemoryError& error) {
    return {ErrorCode::kOutOfMemory,
            (debug ? std::string(error.what()) : first_line(error.what_without_backtrace())) +
                " (lower train.micro_batch_size or data.max_seq_len, or set train.gradient_checkpointing)",
            kExitUnexpectedError};
  } catch (const c10::Error& error) {
    return {ErrorCode::kInternal, debug ? std::string(error.what()) : first_line(error.what_without_backtrace()),
            kExitUnexpectedError};
  } catch (const std::bad_alloc&) {
    return {ErrorCode::kOutOfMemory, "out of host memory (lower train.micro_batch_size or data.max_seq_len)",
            kExitUnexpectedError};
  } catch (const std::exception& error) {
    return {ErrorCode::kInternal, debug ? std::string(error.what()) : first_line(error.what()), kExitUnexpectedError};
  } catch (...) {
    return {ErrorCode::kInternal, "an exception of unknown type", kExitUnexpectedError};
  }
}

std::string error_line(const std::string& command, const Report& report) {
  std::string line = "qtrain " + command + ": error [" + error_code_name(report.code) + "]: " + report.message;
  if (report.code == ErrorCode::kInternal) line += " (unexpected: rerun with --debug for details and report it)";
  if (report.code == ErrorCode::kUsage) line += " (see qtrain " + command + " --help)";
  return line;
}

std::string terminate_command;
bool terminate_debug = false;

[[noreturn]] void on_terminate() {
  const std::exception_ptr pending = std::current_exception();
  const Report report = pending ? describe(pending, terminate_debug)
                                : Report{ErrorCode::kInternal, "std::terminate without an exception", kExitTerminated};
  // One write of the whole line: other threads may still be printing.
  std::fprintf(stderr, "%s\n", error_line(terminate_command, report).c_str());
  std::fflush(stderr);
  if (terminate_debug) std::abort();  // a core dump for the debugger
  std::_Exit(kExitTerminated);
}

}  // namespace

void install_fatal_error_handlers(const std::string& command, bool debug) {
  terminate_command = command;
  terminate_debug = debug;
  std::set_terminate(on_terminate);
  std::signal(SIGXFSZ, SIG_IGN);
  // LibTorch logs warnings with a C++ backtrace in them (c10d's store client when torchrun's
  // agent ends an attempt, for one); qtrain reports what went wrong itself. TORCH_CPP_LOG_LEVEL,
  // when set, still chooses.
  constexpr int kLibTorchErrorsOnly = 2;
  if (!debug && !std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = kLibTorchErrorsOnly;
}

int report_error(const std::string& command, const std::exception_ptr& error, bool debug) {
  const Report report = describe(error, debug);
  std::cerr << error_line(command, report) << std::endl;
  return report.exit_status;
}

}  // namespace qtrain::tools
