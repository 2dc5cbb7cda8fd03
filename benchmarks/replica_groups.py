"""What a failure costs with fault-tolerant replica groups (torchft): time to heal, time lost.

Starts a torchft lighthouse and ``--groups`` replica groups of ``--ngpu`` processes each, every
group its own ``./run_train.sh`` (the debug model on CPU, gloo), lets them train together, then
SIGKILLs group 1's training processes; torchrun restarts them (``MAX_RESTARTS=1``), they heal
from group 0 and the run ends with every group. Each output line is timed here as it arrives.

Prints one JSON line:

- ``step_s``: the median time between group 0's steps while every group trains;
- ``survivor_stall_s``: group 0's longest gap between two committed steps around the kill (the
  step the kill broke, the timeout or connection reset that reveals it, the new quorum);
  ``survivor_join_s``: its gap around the step at which group 1 heals (it waits for the
  transfer); ``lost_s`` both less a step each: what the survivors lose per failure;
- ``heal_s``: from the kill to group 1's "healed" line (torchrun's restart, the process's start,
  build and the transfer of weights, optimizer, schedule and data position from group 0);
  ``transfer_s``: from the restarted process's first quorum to "healed" (the transfer alone);
- ``steps_missed``: the steps group 0 trained without group 1 (their shards were skipped).

Without fault tolerance the same kill costs a restart of the whole job (about ``heal_s`` less
the transfer) and every step since the newest checkpoint (``checkpoint.interval`` / 2 on average).

``--quorum-cost`` measures what fault tolerance costs every step when nothing fails: the same
job as one group without fault tolerance and as the only group of a fault-tolerant job (a quorum
at every step's start, the sums through torchft), run one after the other ``--rounds`` times;
one JSON line per round with each mean step time and their ratio.

    python benchmarks/replica_groups.py [--groups 2] [--ngpu 1] [--steps 60] [--kill-at 8]
    python benchmarks/replica_groups.py --quorum-cost [--rounds 3] [--ngpu 1] [--steps 60]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"replica groups: step (\d+) trained by groups \[([\d, ]*)\]")
TRAINED = re.compile(r"step: +(\d+)/")


class Group:
    """One replica group's ``./run_train.sh``, every output line stamped as it arrives."""

    def __init__(self, group: int, args: argparse.Namespace, lighthouse: str, dump: Path, fault_tolerant: bool = True):
        env = {**os.environ, "NGPU": str(args.ngpu), "OMP_NUM_THREADS": "1", "MAX_RESTARTS": "1"}
        env.setdefault("RUST_LOG", "warn")
        command = [
            str(ROOT / "run_train.sh"),
            "--validation.enable=false",
            "--metrics.enable_tensorboard=false",
            "--metrics.log_freq=1",
            "--training.dataset=shakespeare_dialogue",
            "--training.seq_len=64",
            "--training.local_batch_size=2",
            f"--training.global_batch_size={2 * args.ngpu * 2}",
            f"--training.steps={args.steps}",
            f"--job.dump_folder={dump}",
        ]
        if fault_tolerant:
            command += [
                "--fault_tolerance.enable",
                f"--fault_tolerance.group_count={args.groups}",
                f"--fault_tolerance.replica_id={group}",
                f"--fault_tolerance.lighthouse={lighthouse}",
                "--fault_tolerance.timeout_seconds=10",
            ]
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern: str, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, line in list(self.lines):
                if re.search(pattern, line):
                    return stamp
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {pattern!r}:\n" + "".join(line for _, line in self.lines[-40:]))

    def workers(self) -> list[int]:
        def children(pid: int) -> list[int]:
            try:
                return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                return []

        return [worker for torchrun in children(self.proc.pid) for worker in children(torchrun)]

    def steps(self) -> list[tuple[float, int, list[int]]]:
        found = []
        for stamp, line in self.lines:
            match = STEP.search(line)
            if match:
                found.append((stamp, int(match[1]), [int(g) for g in match[2].split(",")]))
        return found

    def step_s(self) -> float:
        """The mean time per step from the third step's log line to the last's: torchrun passes
        the lines on in bursts about 0.1 s apart, so one step's gap says little and many say a lot."""
        stamps = [stamp for stamp, line in self.lines if TRAINED.search(line)][2:]
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def quorum_cost(args: argparse.Namespace, lighthouse: str) -> None:
    args.groups = 1
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            times = {}
            for fault_tolerant in (False, True):
                group = Group(0, args, lighthouse, Path(folder) / str(fault_tolerant), fault_tolerant)
                if group.proc.wait(timeout=600) != 0:
                    raise RuntimeError("".join(line for _, line in group.lines[-40:]))
                times[fault_tolerant] = group.step_s()
        print(
            json.dumps(
                {
                    "round": round_,
                    "processes": args.ngpu,
                    "step_s_without": round(times[False], 4),
                    "step_s_fault_tolerant": round(times[True], 4),
                    "ratio": round(times[True] / times[False], 3),
                }
            ),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ngpu", type=int, default=1, help="processes per group")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--quorum-cost", action="store_true", help="what fault tolerance costs a step without failures")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=30_000, quorum_tick_ms=20, heartbeat_timeout_ms=1_000
    )
    if args.quorum_cost:
        try:
            quorum_cost(args, lighthouse.address())
        finally:
            lighthouse.shutdown()
        return
    with tempfile.TemporaryDirectory() as folder:
        groups = [Group(g, args, lighthouse.address(), Path(folder) / f"group{g}") for g in range(args.groups)]
        try:
            groups[1].wait_for(rf"step: {args.kill_at}/{args.steps}")
            killed_at = time.monotonic()
            for pid in groups[1].workers():
                os.kill(pid, signal.SIGKILL)
            healed_at = groups[1].wait_for(r"replica group 1 healed from a live group")
            # The restarted process's first quorum is where its manager starts; torchft logs nothing
            # there at warning level, so the transfer is timed from its "model built" line.
            built = [s for s, line in groups[1].lines if "model built and initialised" in line]
            for group in groups:
                if group.proc.wait(timeout=600) != 0:
                    raise RuntimeError("".join(line for _, line in group.lines[-40:]))
        finally:
            for group in groups:
                if group.proc.poll() is None:
                    group.proc.kill()
            lighthouse.shutdown()
    steps = groups[0].steps()
    pairs = list(itertools.pairwise(steps))
    step_s = statistics.median(b[0] - a[0] for a, b in pairs if len(a[2]) == len(b[2]) == args.groups)
    stall = max(b[0] - a[0] for a, b in pairs if a[0] <= killed_at + 10 and b[0] >= killed_at)
    joining = max(b[0] - a[0] for a, b in pairs if a[0] <= healed_at + 10 and b[0] >= healed_at)
    print(
        json.dumps(
            {
                "groups": args.groups,
                "processes_per_group": args.ngpu,
                "step_s": round(step_s, 3),
                "survivor_stall_s": round(stall, 3),
                "survivor_join_s": round(joining, 3),
                "lost_s": round(stall + joining - 2 * step_s, 3),
                "heal_s": round(healed_at - killed_at, 3),
                "transfer_s": round(healed_at - max(built), 3) if len(built) > 1 else None,
                "steps_missed": sum(len(g) < args.groups for _, _, g in steps),
            }
        )
    )


if __name__ == "__main__":
    main()
