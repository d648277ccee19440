"""Runs the tests' interop Python scripts in forks of one process that has imported torch,
transformers and peft once, instead of paying that import (about 8 s of CPU on a 2-core machine)
in every one of the suite's few hundred Python runs.

    python python_server.py SOCKET_PATH

tools/run-tests.sh starts it and points QTRAIN_PYTHON at tests/interop/warm_python, the client.
The client sends its command line, working directory and environment with its stdin, stdout and
stderr (SCM_RIGHTS); the server forks a handler, which forks the script's process, waits for it
and sends back its exit status (or the signal that ended it). A client whose environment differs
from the server's (HF_HOME, say, which transformers reads at import) is told to run the real
Python itself: the modules imported here must see what a fresh interpreter would.
"""
import array
import atexit
import gc
import importlib
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import sys
import traceback

# Modules imported once here; every fork finds them in sys.modules. What a module reads from the
# environment at import is why clients with a different environment run the real Python.
PRELOADED = (
    "numpy", "torch", "safetensors.torch", "tokenizers", "transformers", "peft", "gguf", "llama_cpp",
    "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
)
# What a client's shell adds or changes without changing what Python would do.
ENVIRONMENT_IGNORED = {
    "PWD", "OLDPWD", "SHLVL", "_", "CTEST_INTERACTIVE_DEBUG_MODE",
    "QTRAIN_PYTHON", "QTRAIN_PYTHON_SERVER", "QTRAIN_PYTHON_REAL",
}
MESSAGE_HEADER = struct.Struct("!I")
# The environment before the imports (torch sets TORCHINDUCTOR_CACHE_DIR, for one).
STARTING_ENVIRONMENT = dict(os.environ)


def differing_keys(environment):
    """The keys in which a client's environment differs from what a fresh interpreter's would be
    after the same imports: the server's before them, plus what they set (torch sets
    TORCHINDUCTOR_CACHE_DIR, which scripts run here pass on to the Pythons they start)."""
    keys = (environment.keys() | STARTING_ENVIRONMENT.keys()) - ENVIRONMENT_IGNORED
    return sorted(
        key for key in keys
        if environment.get(key) != STARTING_ENVIRONMENT.get(key)
        and not (key not in STARTING_ENVIRONMENT and environment.get(key) == os.environ.get(key)))


def receive_request(connection):
    """The client's JSON request and its three file descriptors."""
    fds = array.array("i")
    data, ancillary, _, _ = connection.recvmsg(MESSAGE_HEADER.size, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    (length,) = MESSAGE_HEADER.unpack(data)
    body = b""
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            raise ConnectionError("client closed the connection mid-request")
        body += chunk
    return json.loads(body), list(fds)


def send_line(connection, text):
    connection.sendall(text.encode() + b"\n")


def print_from_script(error):
    """The traceback a fresh interpreter prints: from the script's frames on, not this file's or runpy's."""
    frames = error.__traceback__
    while frames is not None and (frames.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
        frames = frames.tb_next
    traceback.print_exception(type(error), error, frames)


def run_script(request, fds):
    """In the script's process: becomes `python ARGV...` as a fresh interpreter would run it."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    os.chdir(request["cwd"])
    # Only ignored keys differ from the server's; what the imports set (TORCHINDUCTOR_CACHE_DIR) stays.
    for key in ENVIRONMENT_IGNORED - request["environment"].keys():
        os.environ.pop(key, None)
    os.environ.update(request["environment"])
    # Every fork would otherwise draw the same numbers from the server's generators.
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    code = 0
    namespace = {}
    try:
        if argv[0] == "-c":
            sys.argv = ["-c"] + argv[2:]
            sys.path.insert(0, "")
            namespace = {"__name__": "__main__", "__builtins__": __builtins__}
            exec(compile(argv[1], "<string>", "exec"), namespace)
        elif argv[0] == "-m":
            sys.argv = [argv[1]] + argv[2:]
            sys.path.insert(0, os.getcwd())
            namespace = runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            namespace = runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_request:
        code = exit_request.code
    except BaseException as error:  # noqa: BLE001 - reported as the interpreter reports it
        print_from_script(error)
        code = 1
    # As the interpreter turns sys.exit's argument into a status.
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    exit_quickly(namespace, code)


def exit_quickly(namespace, code):
    """Ends the script's process as the interpreter would, less tearing down every module torch and
    transformers brought: in a fork of the server that teardown writes to every object's memory,
    copies the server's ~700 MB and takes 1.4 s. The script's globals go first (closing the files
    they hold), then the atexit functions (logging's flush among them), then the standard streams."""
    namespace.clear()
    gc.collect()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


def handle(connection, listener):
    """In the handler process: checks the request, runs the script's process, reports how it ended."""
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        request, fds = receive_request(connection)
    except (OSError, ValueError, ConnectionError):
        os._exit(0)
    differing = differing_keys(request["environment"])
    if len(fds) != 3 or differing:
        if os.environ.get("QTRAIN_PYTHON_SERVER_LOG"):
            with open(os.environ["QTRAIN_PYTHON_SERVER_LOG"], "a") as log:
                print(f"fallback: {request['argv'][:2]} environment differs in {differing}", file=log)
        send_line(connection, "fallback")
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        connection.close()
        run_script(request, fds)
    for fd in fds:
        os.close(fd)
    send_line(connection, f"pid {pid}")
    process = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([process, connection], [], [])
        if process in ready:
            break
        # The client went away (killed by a test's timeout): its script goes too.
        if not connection.recv(1):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        send_line(connection, f"signal {os.WTERMSIG(status)}")
    else:
        send_line(connection, f"exit {os.WEXITSTATUS(status)}")
    os._exit(0)


def main() -> int:
    socket_path = sys.argv[1]
    for module in PRELOADED:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - a module the environment lacks is simply not preloaded
            print(f"python_server: {module} not preloaded: {error}", file=sys.stderr)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # tools/run-tests.sh's kill: remove the socket
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".starting")
    listener.listen(64)
    os.rename(socket_path + ".starting", socket_path)  # clients connect only once imports are done
    server_pid = os.getpid()
    # Out of the collector's sight: a fork's collections would otherwise write to (and so copy) them all.
    gc.freeze()
    try:
        while True:
            connection, _ = listener.accept()
            if os.fork() == 0:
                handle(connection, listener)
            connection.close()
    finally:
        if os.getpid() == server_pid and os.path.exists(socket_path):
            os.unlink(socket_path)


if __name__ == "__main__":
    sys.exit(main())
