"""The command line of the interop scripts that hold several modes: `python SCRIPT.py MODE ARGUMENTS...`."""
import sys


def run_mode(modes) -> int:
    """Calls modes[MODE](*ARGUMENTS) with sys.argv's; 2, and a message, for a mode not in `modes`."""
    mode, arguments = sys.argv[1], sys.argv[2:]
    if mode in modes:
        return modes[mode](*arguments)
    print(f"unknown mode {mode!r}", file=sys.stderr)
    return 2
