"""What a training job says about its own pace: iteration times, straggler reports, checkpoints.

Pure parsers for the lines training frameworks print (or a job pushes as a one-line log), by
class rather than by example, so a framework not named here that prints the same shape of
line is read too:

- a time per iteration (step, batch): Megatron-LM's ``elapsed time per iteration (ms): 1035.9``,
  NeMo's ``train_step_timing in s=1.23``, DeepSpeed's ``iter time (s): 1.234``, tqdm's
  ``3.21s/it`` and generic ``step time: 1.2 s``, ``step_time=1234ms``, ``iteration 120 took
  1.5 s``, ``1.2 s/step``, ``850 ms/iter``;
- a rate: tqdm's ``1.44it/s``, ``samples/sec``, ``tokens/s``, torchtitan's ``tps: 5,213``,
  DeepSpeed's ``CurrSamplesPerSec=12.1``, Hugging Face's ``'train_steps_per_second': 1.2``;
- nvidia-resiliency-ext's straggler report (``Rank=76 Node=h100-001 Score=0.94``, one per line
  under ``GPU relative performance:`` or all on one line);
- a checkpoint written: Megatron's ``successfully saved checkpoint from iteration 2000 to ...``,
  Hugging Face's ``Saving model checkpoint to out/checkpoint-500``, DeepSpeed's and
  Lightning's and a generic ``checkpoint saved`` (``incidents.remediation`` waits for one).

Launcher prefixes (``3: ``, ``[rank3]:``, timestamps in brackets) are ignored, as
``parsers.parse_job_line`` ignores them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUMBER = r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"

# Units of time, in seconds.
_TIME_UNITS = {"ms": 0.001, "msec": 0.001, "millisecond": 0.001, "milliseconds": 0.001,
               "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0, "us": 1e-6,
               "min": 60.0}


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass(frozen=True, slots=True)
class Pace:
    """One reading of a job's pace. ``cost`` grows as the job slows down: seconds per
    iteration for a time, 1 / rate for a rate, so two readings of one kind compare by their
    ratio whatever the unit. ``shown`` is the reading as a person reads it."""

    kind: str      # "time" (seconds per iteration) or a rate's unit ("it/s", "samples/s", ...)
    cost: float
    value: float   # seconds per iteration, or the rate
    step: int | None = None
    # Which form of line said it: readings of one form compare with each other; another form
    # on the same node may measure something else (rank 0's whole iteration beside its own
    # step's compute, say).
    form: str = ""

    @property
    def shown(self) -> str:
        if self.kind == "time":
            return f"{self.value * 1000:,.0f} ms" if self.value < 10 else f"{self.value:,.1f} s"
        return f"{self.value:,.3g} {self.kind}" if self.value < 100 else \
            f"{self.value:,.0f} {self.kind}"


# "elapsed time per iteration (ms): 1035.9" (Megatron), "iter time (s): 1.234" (DeepSpeed),
# "time per step (s): 1.2", "step time (ms) = 900".
_TIME_PER = re.compile(
    r"\b(?:elapsed\s+)?(?:time\s+per\s+(?:iteration|iter|step|batch)|(?:iteration|iter|step|batch)"
    r"[ _-]?time(?:[ _-]?(?:avg|mean))?)\s*(?:\((?P<u1>ms|s|sec|seconds)\))?\s*(?:in\s+(?P<u3>ms|s)\b)?"
    r"\s*[:=]\s*" + _NUMBER + r"\s*(?P<u2>ms|msec|s|sec|secs|seconds|us)?\b",
    re.IGNORECASE)
# NeMo/Lightning: "train_step_timing in s=1.23", "train_step_timing=1.23"
_STEP_TIMING = re.compile(r"(?:\b|_)step_timing(?:\s+in\s+(?P<u>ms|s))?\s*[=:]\s*" + _NUMBER,
                          re.IGNORECASE)
# "iteration 120 took 1.5 s", "step 10 took 1234 ms", "batch 3 finished in 0.8s"
_TOOK = re.compile(r"\b(?:iteration|iter|step|batch)\s*#?\s*(?P<step>\d+)\b[^\n]{0,40}?"
                   r"\b(?:took|in)\s+" + _NUMBER + r"\s*(?P<u>ms|msec|s|sec|secs|seconds)\b",
                   re.IGNORECASE)
# "1.2 s/step", "850 ms/iter", "3.21s/it" (tqdm, slower than one per second)
_PER_ITER = re.compile(_NUMBER + r"\s*(?P<u>ms|s|sec)\s*/\s*(?:it|iter|iteration|step|batch)\b",
                       re.IGNORECASE)
# "1.44it/s" (tqdm), "12.3 samples/sec", "5,213 tokens/s", "800 img/s", "2.5 steps/s"
_RATE = re.compile(_NUMBER + r"\s*(?P<what>it|its|iters?|iterations|steps?|batch(?:es)?|samples?|"
                   r"seqs?|sequences|tokens?|toks?|img|images?)\s*/\s*(?:s|sec|second)\b",
                   re.IGNORECASE)
# "tps: 5,213" (torchtitan), "CurrSamplesPerSec=12.1" (DeepSpeed),
# "'train_steps_per_second': 1.2" (Hugging Face), "samples_per_second=40.1",
# "throughput/samples_per_sec: 512"
_RATE_NAMED = re.compile(
    r"(?:\b(?P<tps>tps|wps)|(?P<name>(?:curr)?(?:train_)?(?:samples|steps|tokens|it|iters)"
    r"_?per_?sec(?:ond)?))['\"]?\s*[:=]\s*" + _NUMBER, re.IGNORECASE)
# The step a line is about: "iteration     1040/  500000", "step: 10", "global_step=10",
# "step 100", "Epoch 0:  12%| 120/1000".
_STEP = re.compile(r"\b(?:iteration|iter|global_step|step)\s*[:=#]?\s*(?P<step>\d+)\b",
                   re.IGNORECASE)
_RANK_PREFIX = re.compile(r"^(?:\s*(?:\[[^\]\n]{1,64}\]:?|\d{1,6}:)\s*)+")

_RATE_UNITS = {"it": "it/s", "its": "it/s", "iter": "it/s", "iters": "it/s",
               "iterations": "it/s", "step": "steps/s", "steps": "steps/s", "batch": "batches/s",
               "batches": "batches/s", "sample": "samples/s", "samples": "samples/s",
               "seq": "samples/s", "seqs": "samples/s", "sequences": "samples/s",
               "token": "tokens/s", "tokens": "tokens/s", "tok": "tokens/s", "toks": "tokens/s",
               "img": "samples/s", "image": "samples/s", "images": "samples/s"}
# Words that make a number a pace; a line with none of them is passed over at once (most of a
# job's output: losses, learning rates, warnings).
_WORDS = ("time", "timing", "took", "/s", "/it", "/step", "/iter", "/batch", "/sec", "per_sec",
          "persec", "tps", "wps", " in ")


def parse_pace(message: str) -> Pace | None:
    """The pace a job's output line reports, or None. Times win over rates where a line has
    both (a time is per iteration by definition; a rate may count samples or tokens)."""
    lowered = message.lower()
    if not any(word in lowered for word in _WORDS):
        return None
    line = _RANK_PREFIX.sub("", message.strip().rsplit("\r", 1)[-1], count=1)
    step_match = _STEP.search(line)
    step = int(step_match.group("step")) if step_match else None
    timed = _seconds(line)
    if timed is not None:
        seconds, form = timed
        if seconds <= 0:
            return None
        return Pace("time", seconds, seconds, step, form)
    m = _RATE_NAMED.search(line)
    if m:
        rate = _number(m.group(3))
        name = (m.group("tps") or m.group("name") or "").lower()
        kind = ("tokens/s" if name in ("tps", "wps") or "token" in name else
                "steps/s" if "step" in name or name.startswith(("it", "currit")) else "samples/s")
        return Pace(kind, 1.0 / rate, rate, step, "named rate") if rate > 0 else None
    found = list(_RATE.finditer(line))
    if found:
        m = found[-1]  # tqdm rewrites its bar: the last reading is the current one
        rate = _number(m.group(1))
        return Pace(_RATE_UNITS.get(m.group("what").lower(), "it/s"), 1.0 / rate, rate, step,
                    "rate") if rate > 0 else None
    return None


def _seconds(line: str) -> tuple[float, str] | None:
    """Seconds per iteration, and the form of line that said it."""
    m = _TIME_PER.search(line)
    if m:
        unit = m.group("u1") or m.group("u3") or m.group("u2") or "s"
        return _number(m.group(3)) * _TIME_UNITS.get(unit.lower(), 1.0), "time per iteration"
    m = _STEP_TIMING.search(line)
    if m:
        return (_number(m.group(2)) * _TIME_UNITS.get((m.group("u") or "s").lower(), 1.0),
                "step timing")
    m = _TOOK.search(line)
    if m:
        return _number(m.group(2)) * _TIME_UNITS.get(m.group("u").lower(), 1.0), "took"
    found = list(_PER_ITER.finditer(line))
    if found:
        m = found[-1]
        return _number(m.group(1)) * _TIME_UNITS.get(m.group("u").lower(), 1.0), "per iteration"
    return None


# --- straggler reports (nvidia-resiliency-ext) ------------------------------------------------

RELATIVE, INDIVIDUAL = "relative", "individual"
_RANK_SCORE = re.compile(r"\bRank=(?P<rank>\d+)\s*,?\s*Node=(?P<node>[^\s,;]+)\s*,?\s*"
                         r"Score=(?P<score>\d+(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class RankScore:
    rank: int
    node: str
    score: float  # 1.0: as fast as the best; 0.5: takes twice as long


@dataclass(frozen=True, slots=True)
class StragglerReport:
    """Ranks' performance scores. ``section``: ``relative`` (each rank against the others: a
    low one is a straggler), ``individual`` (each rank against its own best: a low one may be
    the whole job slowing), or "" when the line does not say (a lone rank line: its header
    came on an earlier line)."""

    section: str
    scores: tuple[RankScore, ...]


def parse_straggler_report(message: str) -> StragglerReport | None:
    if "Score=" not in message:
        return None
    scores = tuple(RankScore(int(m.group("rank")), m.group("node"), float(m.group("score")))
                   for m in _RANK_SCORE.finditer(message))
    lowered = message.lower()
    section = (RELATIVE if "relative" in lowered else INDIVIDUAL if "individual" in lowered
               else "")
    if not scores:
        return StragglerReport(section, ()) if section else None
    return StragglerReport(section, scores)


def straggler_header(message: str) -> str:
    """``relative`` or ``individual`` for a report's header line ("GPU relative performance:"),
    else "": the rank lines after it belong to that section."""
    lowered = message.lower()
    if "performance" not in lowered:
        return ""
    return RELATIVE if "relative performance" in lowered else (
        INDIVIDUAL if "individual performance" in lowered else "")


# --- checkpoints ------------------------------------------------------------------------------

# Megatron-LM: "successfully saved checkpoint from iteration    2000 to /ckpt [ t 1/8, p 1/1 ]"
# Hugging Face Trainer: "Saving model checkpoint to out/checkpoint-500"
# DeepSpeed: "[Rank 0] Saving model checkpoint: /ckpt/global_step500/mp_rank_00_model_states.pt"
#            "Checkpoint global_step500 is ready now!"
# Lightning: "Epoch 3, global step 4000: 'val_loss' reached 1.23 (best 1.23), saving model to ..."
# torch.distributed.checkpoint, NeMo, custom loops: "checkpoint saved at step 400", "saved
# checkpoint step_400", "Checkpoint saved to /ckpt/step_400"
_CHECKPOINT = re.compile(
    r"successfully saved checkpoint|saving model checkpoint|saving model to|checkpoint\b[^\n]{0,60}"
    r"\b(?:saved|written|is ready)|\bsaved\b[^\n]{0,20}\bcheckpoint", re.IGNORECASE)
_CHECKPOINT_STEP = re.compile(r"(?:iteration|global[ _]step|step|checkpoint)[ _:=-]*(?P<step>\d+)",
                              re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    step: int | None  # the training step it holds, where the line says


def parse_checkpoint(message: str) -> CheckpointSaved | None:
    if "heckpoint" not in message and "aving model" not in message:
        return None
    if not _CHECKPOINT.search(message) or re.search(r"\b(?:fail|error|could not|unable)",
                                                    message, re.IGNORECASE):
        return None
    m = _CHECKPOINT_STEP.search(message)
    return CheckpointSaved(int(m.group("step")) if m else None)
