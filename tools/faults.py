#!/usr/bin/env python3
"""Fault injection against the qtrain CLI: kills, a full disk, a killed rank, NaN storms.

    tools/faults.py [--kills 50] [--qtrain build/qtrain] [--work DIR] [--report FILE] [--device cpu|cuda] [FAULT ...]

FAULT is any of kill, disk, torchrun, stop, nan (default: kill, disk, torchrun, nan). Each runs
tiny-llama (recipes/demo_tiny.yaml, 32-token sequences, a checkpoint after every step) on the CPU,
or with --device cuda on the GPUs (one per rank: torchrun and stop then run over NCCL), and checks
what the issue promises:

  kill      --kills times: start `--resume auto`, kill -9 it at a random moment (during a step,
            while a checkpoint is being written: the moment its staging directory appears, or
            once the last checkpoint is written, while the adapter and exports are); after each
            kill every checkpoint that looks complete must verify (size and CRC-32C of each file
            against manifest.json), and the next start must resume from the newest one. Only kills
            that hit a running process count: a run that ends first must have finished with
            verified checkpoints and its adapter, and a fresh run takes its place.
  disk      a checkpoint written into a full disk (RLIMIT_FSIZE, and a small tmpfs when mount is
            permitted): one clean error line with its code, exit status non-zero, the previous
            checkpoint intact and resumable.
  torchrun  two ranks under torchrun --max-restarts 1; rank 1 kills itself after the first
            checkpoint: the other exits, torchrun restarts both, and they resume from it.
  stop      two ranks under torchrun; SIGTERM to rank 1 alone once step 2 is logged: both ranks
            stop after the same step, exit 0, and the checkpoint of that step verifies.
  nan       a learning rate that overflows the weights: the run either survives (non-finite
            steps skipped) or stops with the documented message (QT-NUMERICS), never a crash.

Prints one summary line per fault and, with --report, writes them as Markdown. Exit status 1
when any promise was broken.
"""
import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CRC32C_TABLE = []
for byte in range(256):
    value = byte
    for _ in range(8):
        value = (value >> 1) ^ 0x82F63B78 if value & 1 else value >> 1
    CRC32C_TABLE.append(value)


def crc32c(path):
    value = 0xFFFFFFFF
    table = CRC32C_TABLE
    with open(path, "rb") as file:
        for byte in file.read():
            value = table[(value ^ byte) & 0xFF] ^ (value >> 8)
    return value ^ 0xFFFFFFFF


def checkpoint_problems(run_dir, checksums=True):
    """Every checkpoint under RUN/checkpoints that has a manifest (looks complete) and does not
    verify, as 'name: why'."""
    problems = []
    checkpoints = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(checkpoints):
        return problems
    for name in sorted(os.listdir(checkpoints)):
        manifest_path = os.path.join(checkpoints, name, "manifest.json")
        if not name.startswith("step-") or not os.path.exists(manifest_path):
            continue
        try:
            with open(manifest_path) as file:
                manifest = json.load(file)
            for file_name, entry in manifest["files"].items():
                path = os.path.join(checkpoints, name, file_name)
                if os.path.getsize(path) != entry["bytes"]:
                    problems.append(f"{name}/{file_name}: size differs from the manifest")
                elif checksums and int(str(entry["crc32c"]), 16) != crc32c(path):
                    problems.append(f"{name}/{file_name}: checksum differs from the manifest")
        except (OSError, ValueError, KeyError) as error:
            problems.append(f"{name}: {error}")
    return problems


def complete_checkpoints(run_dir):
    checkpoints = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(checkpoints):
        return []
    return sorted(n for n in os.listdir(checkpoints)
                  if n.startswith("step-") and os.path.exists(os.path.join(checkpoints, n, "manifest.json")))


class Faults:
    def __init__(self, args):
        self.qtrain = os.path.abspath(args.qtrain)
        self.work = args.work
        self.kills = args.kills
        self.steps = args.steps
        self.rows = []
        self.broken = False
        self.device = args.device
        self.environment = dict(os.environ, OMP_NUM_THREADS="1")

    def train_command(self, run_dir, *extra):
        return [self.qtrain, "--recipe", os.path.join(ROOT, "recipes/demo_tiny.yaml"),
                "--set", "data.train=" + os.path.join(ROOT, "recipes/demo/brown-val.jsonl"), "--set", "data.eval=",
                "--set", "data.max_seq_len=32", "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=2",
                "--set", "log.every=1", "--set", "train.output_dir=" + run_dir,
                "--set", "train.device=" + self.device, *extra]

    def record(self, fault, injected, survived, lost, detail):
        ok = survived == injected and lost == 0
        self.broken |= not ok
        line = f"{fault}: {injected} injected, {survived} handled as promised, {lost} data lost; {detail}"
        print(("ok   " if ok else "FAIL ") + line, flush=True)
        self.rows.append((fault, injected, survived, lost, detail, ok))

    # kill -9 at random moments, then --resume auto --------------------------------------------
    def kill(self):
        """Kills until --kills of them hit a running process. A run that finishes between two kills
        is checked (it finished, every checkpoint verifies) and a fresh one takes its place."""
        randomness = random.Random(2024)
        moments = {"during a step": 0, "during a checkpoint save": 0, "during the final export": 0}
        starts = resumed = corrupt = lost_steps = runs_finished = missed = 0
        problems_seen = []
        run_index = 0
        run_dir = None
        newest_before = None

        def finish_check(output, returncode):
            nonlocal runs_finished, corrupt
            problems = checkpoint_problems(run_dir, checksums=True)
            corrupt += len(problems)
            problems_seen.extend(problems)
            adapter = os.path.join(run_dir, "adapter", "adapter_model.safetensors")
            if returncode == 0 and f"done: {self.steps} steps" in output and os.path.exists(adapter) and os.path.getsize(adapter) > 0:
                runs_finished += 1
            else:
                problems_seen.append(f"run {run_index} ended with exit {returncode}: {output.strip()[-200:]}")

        killed = 0
        while killed < self.kills:
            if run_dir is None:
                run_index += 1
                run_dir = os.path.join(self.work, f"kill-{run_index}")
                shutil.rmtree(run_dir, ignore_errors=True)
                newest_before = None
            command = self.train_command(run_dir, "--set", f"train.steps={self.steps}", "--resume", "auto")
            log_path = os.path.join(self.work, "kill.log")
            with open(log_path, "w") as log:
                # Line-buffered, so that what a killed run printed is in its log.
                process = subprocess.Popen(["stdbuf", "-oL", "-eL", *command], stdout=log, stderr=subprocess.STDOUT,
                                           env=self.environment)
            starts += 1
            kind = randomness.choice(list(moments))
            hit = self.kill_at(process, run_dir, log_path, kind, randomness)
            with open(log_path, errors="replace") as log:
                output = log.read()
            if "resume: continuing from" in output:
                resumed += 1
            elif newest_before is not None:
                problems_seen.append(f"start {starts}: a checkpoint existed but the run did not resume")
            problems_seen.extend(line for line in output.splitlines() if line.startswith("resume: skipping"))
            if not hit:  # it finished before the moment came: check it, then start a fresh run
                missed += 1
                finish_check(output, process.returncode)
                run_dir = None
                continue
            killed += 1
            moments[kind] += 1
            problems = checkpoint_problems(run_dir, checksums=False)
            corrupt += len(problems)
            problems_seen.extend(problems)
            newest = complete_checkpoints(run_dir)
            newest = newest[-1] if newest else None
            # The newest complete checkpoint never goes backwards: a kill loses no saved step.
            if newest_before and newest and newest < newest_before:
                lost_steps += 1
            newest_before = newest or newest_before
        if run_dir is not None:  # the last killed run finishes
            final = subprocess.run(self.train_command(run_dir, "--set", f"train.steps={self.steps}", "--resume", "auto"),
                                   capture_output=True, text=True, env=self.environment)
            starts += 1
            if "resume: continuing from" in final.stdout + final.stderr:
                resumed += 1
            finish_check(final.stdout + final.stderr, final.returncode)
        detail = (f"kills {', '.join(f'{v} {k}' for k, v in moments.items())}; {runs_finished} runs of "
                  f"{self.steps} steps finished after them; of {starts} starts, {resumed} found a checkpoint and resumed "
                  f"from it (the others came before a run's first checkpoint), {missed} finished before their kill "
                  f"moment; {corrupt} corrupt checkpoints; "
                  f"{lost_steps} times the newest checkpoint went backwards")
        if problems_seen:
            detail += " (" + "; ".join(problems_seen[:3]) + ")"
        survived = self.kills if not problems_seen and runs_finished == run_index else 0
        self.record("kill -9", self.kills, survived, lost_steps + corrupt, detail)

    def kill_at(self, process, run_dir, log_path, kind, randomness):
        """Kills `process` at a moment of the given kind; False when it ended before that moment."""
        checkpoints = os.path.join(run_dir, "checkpoints")
        final_checkpoint = os.path.join(checkpoints, f"step-{self.steps:06d}", "manifest.json")
        deadline = time.time() + 300
        started = False
        while time.time() < deadline and process.poll() is None:
            if not started:
                # Training has started once this process logged a step.
                with open(log_path, errors="replace") as log:
                    started = any(line.startswith("step ") for line in log)
                if started and kind == "during a step":
                    time.sleep(randomness.uniform(0.0, 1.0))
                    break
            elif kind == "during a checkpoint save":
                if os.path.isdir(checkpoints) and any(name.startswith(".") for name in os.listdir(checkpoints)):
                    break  # a staging directory: a save is under way
            elif kind == "during the final export":
                if os.path.exists(final_checkpoint):
                    break  # the last checkpoint is written; the adapter and exports come next
            time.sleep(0.002)
        if process.poll() is not None:
            return False
        process.send_signal(signal.SIGKILL)
        process.wait()
        return True

    # a full disk while a checkpoint is written -----------------------------------------------
    def disk(self):
        injected = handled = lost = 0
        details = []
        for medium in ("file-size limit (ulimit -f)", "full tmpfs"):
            run_dir = os.path.join(self.work, "disk")
            mount_point = None
            shutil.rmtree(run_dir, ignore_errors=True)
            first = subprocess.run(self.train_command(run_dir, "--set", "train.steps=2"), capture_output=True,
                                   text=True, env=self.environment)
            if first.returncode != 0:
                details.append(f"{medium}: the first run failed: {first.stderr[-300:]}")
                injected += 1
                continue
            before = complete_checkpoints(run_dir)
            limit = ""
            if medium.startswith("file-size"):
                limit = "ulimit -f 64; "  # 64 KiB: less than one checkpoint file
            else:
                mount_point = tempfile.mkdtemp(prefix="qtrain-full-", dir=self.work)
                used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(run_dir) for f in fs)
                mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={used + 256 * 1024}", "tmpfs",
                                          mount_point], capture_output=True)
                if mounted.returncode != 0:
                    details.append(f"{medium}: skipped (mount not permitted)")
                    os.rmdir(mount_point)
                    continue
                shutil.copytree(run_dir, os.path.join(mount_point, "run"))
                run_dir = os.path.join(mount_point, "run")
                before = complete_checkpoints(run_dir)
            injected += 1
            command = " ".join(f"'{part}'" for part in self.train_command(run_dir, "--set", "train.steps=4",
                                                                         "--resume", "auto"))
            full = subprocess.run(["bash", "-c", limit + command], capture_output=True, text=True,
                                  env=self.environment)
            error_lines = [line for line in full.stderr.splitlines() if "error" in line]
            clean = (full.returncode != 0 and len(error_lines) == 1 and "[QT-" in error_lines[0]
                     and "terminate called" not in full.stderr and "Traceback" not in full.stderr)
            intact = not checkpoint_problems(run_dir) and set(before) <= set(complete_checkpoints(run_dir))
            resumable = False
            if mount_point:  # the user frees space, then resumes
                subprocess.run(["mount", "-o", "remount,size=256m", mount_point])
            if intact:
                again = subprocess.run(self.train_command(run_dir, "--set", "train.steps=3", "--resume", "auto"),
                                       capture_output=True, text=True, env=self.environment)
                resumable = again.returncode == 0 and "resume: continuing from" in again.stdout + again.stderr
            handled += clean and intact and resumable
            lost += not intact
            message = error_lines[0] if error_lines else full.stderr.strip()[-200:]
            details.append(f"{medium}: exit {full.returncode}, \"{message.strip()}\", previous checkpoints "
                           f"{'intact' if intact else 'DAMAGED'}, {'resumed' if resumable else 'NOT resumed'}")
            if mount_point:
                subprocess.run(["umount", mount_point])
                os.rmdir(mount_point)
        self.record("full disk", injected, handled, lost, "; ".join(details))

    # Both torchrun faults: a Python with torchrun, a fresh run directory, a rank wrapper, a port.
    def torchrun_job(self, fault, name, wrapper_text):
        """(python, run_dir, wrapper, port), or None (recorded as skipped) without torchrun."""
        python = os.environ.get("QTRAIN_PYTHON", sys.executable)
        if subprocess.run([python, "-c", "import torch.distributed.run"], capture_output=True).returncode != 0:
            self.record(fault, 0, 0, 0, f"skipped: {python} has no torch.distributed.run")
            return None
        run_dir = os.path.join(self.work, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        wrapper = os.path.join(run_dir, "rank.sh")
        with open(wrapper, "w") as file:
            file.write(wrapper_text(run_dir))
        os.chmod(wrapper, 0o755)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return python, run_dir, wrapper, port

    # torchrun: one rank dies, --max-restarts brings the job back -------------------------------
    def torchrun(self):
        def wrapper_text(run_dir):
            train = " ".join(f"'{part}'" for part in self.train_command(
                run_dir, "--set", "train.steps=6", "--set", "dist.timeout_s=60", "--resume", "auto"))
            # First attempt: rank 1 kills itself once the first checkpoint is complete.
            return f"""#!/bin/bash
log={run_dir}/attempt$TORCHELASTIC_RESTART_COUNT-rank$RANK.log
# Every rank but the victim is qtrain itself, as under `torchrun --no-python qtrain`: torchrun's
# SIGTERM reaches it, and torchrun waits for it to end before it restarts the job.
if [ "$TORCHELASTIC_RESTART_COUNT" != 0 ] || [ "$RANK" != 1 ]; then
  exec {train} > $log 2>&1
fi
{train} > $log 2>&1 &
pid=$!
for i in $(seq 1200); do ls {run_dir}/checkpoints/step-*/manifest.json >/dev/null 2>&1 && break; sleep 0.1; done
kill -9 $pid
date +%s.%N > {run_dir}/killed_at
wait $pid
"""
        job = self.torchrun_job("torchrun rank kill", "torchrun", wrapper_text)
        if job is None:
            return
        python, run_dir, wrapper, port = job
        started = time.time()
        result = subprocess.run([python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts",
                                 "1", "--master_port", str(port), "--no-python", wrapper], capture_output=True,
                                text=True, env=self.environment, timeout=600)
        seconds = time.time() - started

        def read(name):
            path = os.path.join(run_dir, name)
            return open(path, errors="replace").read() if os.path.exists(path) else ""
        survivor = read("attempt0-rank0.log")
        restarted = read("attempt1-rank0.log")
        # torchrun stops the other ranks itself (SIGTERM); a rank blocked in a collective with the
        # dead one ends on its own with one error line, never a library stack trace.
        survivor_exited = "error [QT-DISTRIBUTED]" in survivor and "frame #" not in survivor
        # When rank 0 stopped: its log's last write, against the moment rank 1 was killed.
        exit_seconds = None
        if os.path.exists(os.path.join(run_dir, "killed_at")) and survivor:
            killed_at = float(read("killed_at").strip() or 0)
            exit_seconds = os.path.getmtime(os.path.join(run_dir, "attempt0-rank0.log")) - killed_at
        within_timeout = exit_seconds is not None and exit_seconds <= 60
        last_line = survivor.strip().splitlines()[-1] if survivor.strip() else ""
        resumed = "resume: continuing from" in restarted and "done: 6 steps" in restarted
        intact = not checkpoint_problems(run_dir)
        resumed_from = [line for line in restarted.splitlines() if "resume: continuing from" in line]
        detail = (f"torchrun exit {result.returncode} after {seconds:.0f} s; rank 0 "
                  f"{'exited with one error line' if survivor_exited else 'did NOT exit cleanly'}"
                  + (f" {exit_seconds:.1f} s after the kill (dist.timeout_s 60)" if exit_seconds is not None else "")
                  + (f", its last line: \"{last_line.strip()[:160]}\"" if last_line else "")
                  + f"; the restart {'resumed and finished' if resumed else 'did NOT resume'}"
                  + (f" (\"{resumed_from[0].strip()[:120]}\")" if resumed_from else ""))
        self.record("torchrun rank kill", 1,
                    int(result.returncode == 0 and survivor_exited and within_timeout and resumed and intact),
                    int(not intact), detail)

    # SIGTERM to one rank: every rank stops after the same step ----------------------------------
    def stop(self):
        def wrapper_text(run_dir):
            train = " ".join(f"'{part}'" for part in self.train_command(
                run_dir, "--set", "train.steps=400", "--set", "checkpoint.every=1000", "--set", "dist.timeout_s=60"))
            return f"""#!/bin/bash
echo $$ > {run_dir}/pid-rank$RANK
exec {train} > {run_dir}/rank$RANK.log 2>&1
"""
        job = self.torchrun_job("stop signal to one rank", "stop", wrapper_text)
        if job is None:
            return
        python, run_dir, wrapper, port = job
        launcher = subprocess.Popen([python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                                     str(port), "--no-python", wrapper], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=self.environment)

        def read(name):
            path = os.path.join(run_dir, name)
            return open(path, errors="replace").read() if os.path.exists(path) else ""
        deadline = time.time() + 300
        while "step 2/" not in read("rank0.log") and launcher.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        signalled = launcher.poll() is None and read("pid-rank1").strip() != ""
        if signalled:
            os.kill(int(read("pid-rank1")), signal.SIGTERM)
        try:
            output, _ = launcher.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            launcher.kill()
            output, _ = launcher.communicate()
        rank0 = read("rank0.log")
        stopped = [line for line in rank0.splitlines() if line.startswith("stopped after step")]
        step = int(stopped[0].split()[3].rstrip(":")) if stopped else None
        saved = complete_checkpoints(run_dir)
        same_step = step is not None and saved == [f"step-{step:06d}"] and not checkpoint_problems(run_dir)
        quiet = "error" not in read("rank1.log").lower()
        detail = (f"torchrun exit {launcher.returncode}; rank 1 {'got SIGTERM' if signalled else 'was NOT signalled'}; "
                  f"rank 0: \"{stopped[0] if stopped else rank0.strip().splitlines()[-1:]}\"; checkpoints {saved}"
                  + ("" if quiet else f"; rank 1's log: {read('rank1.log').strip()[-160:]}"))
        self.record("stop signal to one rank", 1,
                    int(signalled and launcher.returncode == 0 and same_step and quiet), int(bool(checkpoint_problems(run_dir))),
                    detail)

    # NaN storms --------------------------------------------------------------------------------
    def nan(self):
        injected = handled = 0
        details = []
        for lr in ("1e30", "1e38"):
            run_dir = os.path.join(self.work, "nan")
            shutil.rmtree(run_dir, ignore_errors=True)
            injected += 1
            result = subprocess.run(self.train_command(run_dir, "--set", "train.steps=12", "--set", f"optim.lr={lr}",
                                                       "--set", "train.max_skipped_steps=3"),
                                    capture_output=True, text=True, env=self.environment)
            output = result.stdout + result.stderr
            survived = result.returncode == 0
            stopped = result.returncode == 2 and "[QT-NUMERICS]" in output
            crashed = result.returncode < 0 or "terminate called" in output or result.returncode not in (0, 2)
            handled += (survived or stopped) and not crashed and not checkpoint_problems(run_dir)
            outcome = "survived" if survived else ("stopped with the documented message" if stopped else
                                                   f"exit {result.returncode}: {output.strip()[-200:]}")
            details.append(f"lr {lr}: {outcome}")
        self.record("NaN storm", injected, handled, 0, "; ".join(details))

    def report(self, path):
        with open(path, "w") as file:
            file.write("| fault | injected | handled as promised | data lost | detail |\n|---|---|---|---|---|\n")
            for fault, injected, survived, lost, detail, _ in self.rows:
                cell = detail.replace("|", "\\|")
                file.write(f"| {fault} | {injected} | {survived} | {lost} | {cell} |\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("faults", nargs="*", default=["kill", "disk", "torchrun", "nan"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--steps", type=int, default=40, help="training steps of the killed run")
    parser.add_argument("--qtrain", default=os.path.join(ROOT, "build/qtrain"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    args.work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="qtrain-faults-"))
    os.makedirs(args.work, exist_ok=True)
    faults = Faults(args)
    for fault in args.faults:
        getattr(faults, fault)()
    if args.report:
        faults.report(args.report)
    return 1 if faults.broken else 0


if __name__ == "__main__":
    sys.exit(main())
