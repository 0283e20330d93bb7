"""The parsers and the engine on real lines: tests/fixtures/real_logs holds kernel lines and
Slurm reasons copied from public bug reports and source code, each with its provenance and
what FleetWatch must read in it. A line no parser reads there is a fault that goes unseen."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from collectors.knowledge.kernel import KERNEL_LINES_TO_SEND
from incidents.diagnosis import Observation, diagnose
from incidents.diagnosis import parsers as p

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_logs"
KERNEL = yaml.safe_load((CORPUS / "kernel.yaml").read_text())
SLURM = yaml.safe_load((CORPUS / "slurm.yaml").read_text())
AT = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
KINDS: dict[type, str] = {p.KernelXid: "xid", p.NvswitchSxid: "sxid", p.NvrmGpuHeader: "gpu_header",
                          p.NetdevLink: "link", p.IbPortState: "ib_port", p.PcieAer: "aer"}


def _id(entry: dict[str, Any]) -> str:
    return f"{entry['source']}:{entry.get('line', entry.get('reason', ''))[:60]}"


def test_every_line_cites_a_public_source() -> None:
    for corpus, key in ((KERNEL, "lines"), (SLURM, "reasons")):
        for entry in corpus[key]:
            source = corpus["sources"][entry["source"]]
            assert source["repository"] and source["url"].startswith("https://"), entry


def test_the_corpus_covers_every_class_of_line() -> None:
    kinds = {e["expect"]["kind"] for e in KERNEL["lines"]}
    assert kinds == {"xid", "sxid", "gpu_header", "link", "ib_port", "aer", "ignored"}
    assert len(KERNEL["lines"]) + len(SLURM["reasons"]) >= 40
    # The MIG form, a split fallen-off-bus message, and AER at every severity are all there.
    assert any("gpu_instance" in e["expect"] for e in KERNEL["lines"])
    assert any(e["expect"].get("pci") == "" for e in KERNEL["lines"])
    assert {e["expect"].get("severity") for e in KERNEL["lines"]} >= {"corrected", "nonfatal",
                                                                       "fatal"}


@pytest.mark.parametrize("entry", KERNEL["lines"], ids=_id)
def test_kernel_line_parses_as_expected(entry: dict[str, Any]) -> None:
    want = entry["expect"]
    got = p.parse_kernel(entry["line"])
    if want["kind"] == "ignored":
        assert got is None, got
        return
    assert got is not None and KINDS[type(got)] == want["kind"], got
    if isinstance(got, p.KernelXid):
        assert (got.code, got.pci) == (want["code"], want["pci"])
        assert got.gpu_instance == want.get("gpu_instance")
        assert got.compute_instance == want.get("compute_instance")
        assert bool(got.via) == want.get("via", False)
    elif isinstance(got, p.NvswitchSxid):
        assert (got.code, got.pci, got.fatal) == (want["code"], want["pci"], want["fatal"])
    elif isinstance(got, p.NvrmGpuHeader):
        assert got.pci == want["pci"]
    elif isinstance(got, p.NetdevLink):
        assert (got.device, got.up) == (want["device"], want["up"])
    elif isinstance(got, p.IbPortState):
        assert (got.device, got.port, got.state) == (want["device"], want["port"], want["state"])
    elif isinstance(got, p.PcieAer):
        assert (got.severity, got.pci) == (want["severity"], want["pci"])


@pytest.mark.parametrize("entry", [e for e in KERNEL["lines"]
                                   if e["expect"]["kind"] != "ignored"], ids=_id)
def test_every_line_read_reaches_diagnosis(entry: dict[str, Any]) -> None:
    """The agent sends it, and the database window does not leave it out: a line read here
    but dropped on the way is as unseen as one not read."""
    assert KERNEL_LINES_TO_SEND.search(entry["line"]), "the agent keeps it on the node"
    assert any(word in entry["line"] for word in p.KERNEL_WORDS), "the window leaves it out"


@pytest.mark.parametrize("entry", KERNEL["lines"], ids=_id)
def test_kernel_line_alone_opens_what_it_should(entry: dict[str, Any]) -> None:
    """Diagnosed alone on one node, a fault line opens its incident there and a benign one
    (a corrected AER, a port coming up, an application XID with no job) opens nothing."""
    found = diagnose([Observation(AT, "kernel", node="gpu-001", message=entry["line"])])
    want = entry["expect"]["incident"]
    assert [(d.root_cause, d.nodes) for d in found] == (
        [] if want == "none" else [(want, ("gpu-001",))]), [d.explanation for d in found]


@pytest.mark.parametrize("entry", SLURM["reasons"], ids=_id)
def test_slurm_reason_reads_as_expected(entry: dict[str, Any]) -> None:
    want = entry["expect"]
    lost = p.slurm_gpus_lost(entry["reason"])
    assert lost == (tuple(want["gpus_lost"]) if want["gpus_lost"] else None)
    record = {"source": "slurm", "node": "gpu-001", "node_state": entry["state"],
              "reason": entry["reason"]}
    found = diagnose([Observation.from_record(record, AT)])
    assert [(d.root_cause, d.nodes) for d in found] == (
        [] if want["incident"] == "none" else [(want["incident"], ("gpu-001",))])


def test_a_split_fallen_off_bus_message_names_its_gpu() -> None:
    """Three lines of a text log: the head names the GPU the last line is about."""
    lines = [e["line"] for e in KERNEL["lines"] if e["source"] == "nvsentinel-155"
             and e["expect"]["kind"] in ("gpu_header", "xid") and "\n" not in e["line"]
             and "probe" not in e["line"]]
    head, tail = sorted(lines, key=lambda line: "fallen" in line)
    found = diagnose([Observation(AT, "kernel", node="gpu-001", message=head),
                      Observation(AT, "kernel", node="gpu-001", message=tail)])
    assert [d.root_cause for d in found] == ["gpu_hardware"]
    assert "PCI 0000:b3:00" in found[0].explanation


def test_a_fatal_aer_on_a_gpu_blames_it_and_a_mig_xid_names_its_instance() -> None:
    """A fatal AER counts against a GPU when the agent matched its address to one (the
    ``gpu`` it adds to the record) or an NVRM line names the same address; on any other device
    it is shown, not blamed."""
    fatal = next(e["line"] for e in KERNEL["lines"]
                 if e["expect"].get("severity") == "fatal" and "received" in e["line"])
    mapped = Observation.from_record({"source": "kernel", "node": "gpu-001", "gpu": 3,
                                      "message": fatal}, AT)
    found = diagnose([mapped])
    assert [(d.root_cause, d.nodes) for d in found] == [("gpu_hardware", ("gpu-001",))]
    assert "AER" in found[0].explanation and "GPU 3" in found[0].explanation
    mig = next(e["line"] for e in KERNEL["lines"] if "GPU-I:" in e["line"])
    found = diagnose([Observation(AT, "kernel", node="gpu-002", message=mig)])
    assert "GPU-I 5" in found[0].explanation


# --- other health tools' verdicts: tests/fixtures/real_logs/health_tools.yaml ---------------

TOOLS = yaml.safe_load((CORPUS / "health_tools.yaml").read_text())


def _verdict_id(entry: dict[str, Any]) -> str:
    signal = entry["signal"]
    what = signal.get("condition") or signal.get("event_reason") or signal.get("component")
    return f"{entry['source']}:{what}:{signal.get('status', signal.get('type', ''))}"


def test_every_verdict_cites_a_public_source() -> None:
    for entry in TOOLS["verdicts"]:
        source = TOOLS["sources"][entry["source"]]
        assert source["repository"] and source["url"].startswith("https://"), entry


def test_the_verdicts_cover_each_tool_and_claim() -> None:
    signals = [e["signal"] for e in TOOLS["verdicts"]]
    assert any(s.get("source") == "gpud" for s in signals)
    assert any("event_reason" in s for s in signals)
    assert any(str(s.get("reason", "")).endswith("IsHealthy") for s in signals)
    claims = {e["expect"]["claim"] for e in TOOLS["verdicts"]}
    assert claims >= {"gpu", "nvlink", "network", "thermal", "not_gpu"}


@pytest.mark.parametrize("entry", TOOLS["verdicts"], ids=_verdict_id)
def test_verdict_parses_as_expected(entry: dict[str, Any]) -> None:
    signal, want = entry["signal"], entry["expect"]
    message = signal.get("message", "")
    got = (p.parse_gpud_event(signal, message) if signal["source"] == "gpud"
           else p.parse_tool_verdict(signal, message))
    if want["claim"] == "none":
        assert got is None
        return
    assert got is not None
    assert (got.claim, got.active) == (want["claim"], want["active"])
    assert [[x.code, x.pci] for x in got.xids] == want["xids"]


@pytest.mark.parametrize("entry", TOOLS["verdicts"], ids=_verdict_id)
def test_verdict_alone_opens_what_it_should(entry: dict[str, Any]) -> None:
    """Alone on a node with no job: a verdict naming a hardware XID opens that XID's incident,
    one without a code opens its claim below automatic repair, a cleared condition, a warning
    or a node problem that is not a GPU's opens nothing."""
    found = diagnose([Observation.from_record({**entry["signal"], "node": "gpu-001"}, AT)])
    want = entry["expect"]["incident"]
    assert [(d.root_cause, d.nodes) for d in found] == (
        [] if want == "none" else [(want, ("gpu-001",))]), [d.explanation for d in found]
    if want != "none" and not entry["expect"]["xids"]:
        assert found[0].confidence < 0.8  # incidents.lifecycle.AUTO_REMEDIATION_MIN_CONFIDENCE
