"""A data-parallel training job in miniature, one rank per node, for the failure drill.

Launched by the drill's batch script as ``srun --ntasks-per-node=1 python train.py --dir D``.
Each rank fits the same linear model on its own batches; after every step the ranks average
their gradients through files in ``D/sync`` (the all-reduce: a rank cannot finish a step until
every rank has posted its gradient, so one stuck rank stops them all, as NCCL does). Plain
Python, no NumPy: nothing to install on the nodes.

- Rank 0 writes a checkpoint every ``--checkpoint-every`` steps; any rank that gets SIGTERM
  writes one for the last step all ranks finished, then exits. Checkpoints are written to a
  temporary file and renamed over ``D/checkpoint.json`` (atomic: a kill mid-write leaves the
  previous one), and never replaced by an older step.
- On start every rank loads the latest checkpoint and logs ``resumed from step N``.
- A rank whose node's GPU died (the drill creates ``D/faults/<node>``, as the driver losing the
  device would) hangs in its "CUDA call": it stops stepping and no longer reacts to SIGTERM (a
  process stuck in the driver never runs its handler), so only Slurm's SIGKILL after KillWait
  ends it.

Every event is appended as one JSON line to ``D/train.log`` (wall-clock ``at``, job, restart,
rank, node), which the drill's report reads; stdout carries the same as text for the Slurm
output file. Each rank also touches ``D/heartbeat/<node>`` after each step, which the drill uses
to make the simulated dcgm-exporter report that node's GPUs busy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

DIM = 16


class Rank:
    def __init__(self, root: Path, step_seconds: float, checkpoint_every: int) -> None:
        self.root = root
        self.step_seconds = step_seconds
        self.checkpoint_every = checkpoint_every
        self.rank = int(os.environ.get("SLURM_PROCID", "0"))
        self.world = int(os.environ.get("SLURM_NTASKS", "1"))
        self.node = os.environ.get("SLURMD_NODENAME", "local")
        self.job = os.environ.get("SLURM_JOB_ID", "0")
        self.restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        # Per run of the job: a requeued run never reads the gradients of the one before.
        self.sync = root / "sync" / f"{self.job}.{self.restart}"
        self.sync.mkdir(parents=True, exist_ok=True)
        (root / "heartbeat").mkdir(exist_ok=True)
        self.checkpoint = root / "checkpoint.json"
        self.step = 0  # the last step every rank finished
        self.weights = [0.0] * DIM
        self.terminated = False

    # --- the log ---

    def log(self, event: str, **fields: Any) -> None:
        record = {"at": time.time(), "job": self.job, "restart": self.restart,
                  "rank": self.rank, "node": self.node, "event": event, **fields}
        # One write per line with O_APPEND: lines from several ranks never interleave.
        fd = os.open(self.root / "train.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"rank {self.rank} on {self.node}: {event} {text}".rstrip(), flush=True)

    # --- checkpoints ---

    def load(self) -> None:
        try:
            saved = json.loads(self.checkpoint.read_text())
        except FileNotFoundError:
            self.log("starting fresh")
            return
        self.step, self.weights = int(saved["step"]), [float(w) for w in saved["weights"]]
        self.log("resumed from step", step=self.step, saved_by=saved.get("why", ""))

    def save(self, why: str) -> None:
        try:
            existing = int(json.loads(self.checkpoint.read_text())["step"])
        except (FileNotFoundError, ValueError, KeyError):
            existing = -1
        if existing >= self.step:
            self.log("checkpoint kept", step=existing, why=why)
            return
        tmp = self.checkpoint.with_name(f".checkpoint.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"step": self.step, "weights": self.weights, "why": why,
                                   "job": self.job, "restart": self.restart,
                                   "saved_at": time.time()}))
        os.replace(tmp, self.checkpoint)
        self.log("checkpoint", step=self.step, why=why)

    # --- the fault and the signal ---

    def gpu_dead(self) -> bool:
        return (self.root / "faults" / self.node).exists()

    def hang(self) -> None:
        """Stuck in the driver: no more steps, SIGTERM unheard; Slurm's SIGKILL ends it."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.log("gpu fault: CUDA call never returns", step=self.step)
        while True:
            time.sleep(3600)

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.terminated = True  # acted on at the next safe point (never mid-update)

    def stop_if_asked(self) -> None:
        if self.terminated:
            self.log("SIGTERM", step=self.step)
            self.save("sigterm")
            sys.exit(0)

    # --- training ---

    def gradient(self, step: int) -> tuple[list[float], float]:
        """Mean-squared-error gradient of this rank's batch for ``step`` (deterministic, so a
        resumed run computes exactly what the lost one would have)."""
        rng = random.Random(f"{step}/{self.rank}")
        truth = [math.sin(i + 1) for i in range(DIM)]
        grad, loss = [0.0] * DIM, 0.0
        for _ in range(32):
            x = [rng.gauss(0.0, 1.0) for _ in range(DIM)]
            y = sum(t * xi for t, xi in zip(truth, x, strict=True)) + rng.gauss(0.0, 0.01)
            err = sum(w * xi for w, xi in zip(self.weights, x, strict=True)) - y
            loss += err * err / 32
            for i in range(DIM):
                grad[i] += 2 * err * x[i] / 32
        return grad, loss

    def all_reduce(self, step: int, grad: list[float]) -> list[float]:
        mine = self.sync / f"{step}.{self.rank}.json"
        tmp = mine.with_suffix(".tmp")
        tmp.write_text(json.dumps(grad))
        os.replace(tmp, mine)
        while True:
            if self.gpu_dead():
                self.hang()
            try:
                grads = [json.loads((self.sync / f"{step}.{r}.json").read_text())
                         for r in range(self.world)]
                break
            except (FileNotFoundError, ValueError):
                self.stop_if_asked()  # waiting for the others is a safe point
                time.sleep(0.02)
        return [sum(g[i] for g in grads) / self.world for i in range(DIM)]

    def run(self, total_steps: int) -> None:
        signal.signal(signal.SIGTERM, self.on_sigterm)
        self.load()
        while self.step < total_steps:
            started = time.monotonic()
            if self.gpu_dead():
                self.hang()
            self.stop_if_asked()
            step = self.step + 1
            grad, loss = self.gradient(step)
            mean = self.all_reduce(step, grad)
            self.weights = [w - 0.05 * g for w, g in zip(self.weights, mean, strict=True)]
            self.step = step
            self.log("step", step=step, loss=round(loss, 6))
            (self.root / "heartbeat" / self.node).write_text(f"{time.time()}\n")
            if self.rank == 0:
                (self.sync / f"{step - 2}.0.json").unlink(missing_ok=True)
                for r in range(1, self.world):
                    (self.sync / f"{step - 2}.{r}.json").unlink(missing_ok=True)
                if step % self.checkpoint_every == 0:
                    self.save("periodic")
            # The rest of the step's time is the "GPU" working; SIGTERM is checked after it.
            left = self.step_seconds - (time.monotonic() - started)
            deadline = time.monotonic() + max(0.0, left)
            while time.monotonic() < deadline and not self.terminated:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        self.log("finished", step=self.step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One rank of the drill's training job.")
    parser.add_argument("--dir", type=Path, required=True, help="shared run directory")
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--total-steps", type=int, default=10**9)
    args = parser.parse_args(argv)
    Rank(args.dir, args.step_seconds, args.checkpoint_every).run(args.total_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
