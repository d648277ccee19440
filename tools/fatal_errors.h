#pragma once
// How the CLI ends on an error: one line "qtrain COMMAND: error [QT-CODE]: message" on stderr
// and a non-zero exit status, whatever was thrown (docs/ERRORS.md lists the codes). LibTorch's
// C++ stack traces and std::terminate's "terminate called ..." appear only with --debug.
#include <exception>
#include <string>

namespace qtrain::tools {

// Exit statuses: 2 for an error the user can fix (qtrain::Error, a bad command line), 1 for an
// unexpected one (a library failure: QT-INTERNAL, out of memory), 3 for std::terminate.
constexpr int kExitUserError = 2;
constexpr int kExitUnexpectedError = 1;
constexpr int kExitTerminated = 3;

// Installs the process-wide handlers: std::terminate prints one clean line (the pending
// exception's message and code) and exits with kExitTerminated; SIGXFSZ is ignored, so that a
// write over the file-size limit fails with EFBIG and becomes a QT-IO error instead of a kill;
// LibTorch's own log keeps only errors (its warnings carry stack traces).
// `command` names the subcommand in messages; with `debug`, full messages and traces are kept.
void install_fatal_error_handlers(const std::string& command, bool debug);

// Prints the exception `error` (from a catch (...) block: std::current_exception()) as the
// command's error line and returns the exit status for it.
int report_error(const std::string& command, const std::exception_ptr& error, bool debug);

}  // namespace qtrain::tools
