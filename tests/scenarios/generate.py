"""Write the public scenario suite: ``python tests/scenarios/generate.py``.

Each scenario is a replay file (``fleetwatch-replay/1``, see ../shared/REPLAY.md) with a fault,
the symptoms a naive rule would blame on healthy nodes (NCCL timeouts on the other ranks, jobs
dying, nodes going NotReady under a dead switch), and background noise: GPU temperature and
utilisation scrapes, NIC counters with non-zero baselines, Kubernetes heartbeats, Slurm node
records. Seeds are fixed, so the files are reproducible; ``test_scenarios`` checks they match.
The ``example-*`` files are copies of ../shared/scenarios and are not generated here.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
XID79 = "NVRM: Xid (PCI:0000:{bus}:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
WATCHDOG = ("[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, "
            "OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for "
            "600{ms:03d} milliseconds before timing out.")
IB_ERR = ("NET/IB : Got completion from peer 10.0.{a}.{b}<{port}> with error 12, opcode 0, len 0, "
          "vendor err 129 (Recv) localGid ::ffff:10.0.{c}.{d} remoteGids ::ffff:10.0.{a}.{b}")
IB_STATUS = ("NET/IB : Got completion from peer 10.0.{a}.{b}<{port}> with status=12 opcode=0 "
             "len=0 vendor err 129 (Recv)")
IB_STATUS_NAME = ("NET/IB : Got completion from peer 10.0.{a}.{b}<{port}> with "
                  "status=IBV_WC_RETRY_EXC_ERR(12) opcode=0 len=0 vendor err 129 (Recv)")
REMOTE = ("[Rank {rank}] NCCL WARN NET/IB : remote process exited or there was a network error "
          "(ncclRemoteError)")


class Scenario:
    def __init__(self, name: str, description: str, *, seed: int, leaves: int = 2,
                 per_leaf: int = 4, prefix: str = "gpu", minutes: int = 10) -> None:
        self.name, self.description = name, description
        self.rng = random.Random(seed)
        self.start = datetime(2026, 11, 1 + seed % 27, 9 + seed % 10, 0, tzinfo=UTC)
        self.minutes = minutes
        width = 3 if prefix.endswith("-") else 4
        base = self.rng.randrange(1, 400)
        names = [f"{prefix}{base + i:0{width}d}" for i in range(leaves * per_leaf)]
        letters = "abcdefgh"
        self.topology = {f"leaf-{letters[i]}{self.rng.randrange(1, 9)}":
                         names[i * per_leaf:(i + 1) * per_leaf] for i in range(leaves)}
        self.nodes = names
        self.jobs: list[dict[str, Any]] = []
        self.signals: list[tuple[float, int, dict[str, Any]]] = []
        self.expect: list[dict[str, Any]] = []
        self._seq = 0
        self.recovery_baseline: dict[str, int] = {}

    # --- raw signals -----------------------------------------------------------------------

    def add(self, t: float, source: str, **fields: Any) -> Scenario:
        self._seq += 1
        self.signals.append((t, self._seq, {"source": source, **fields}))
        return self

    def kernel(self, t: float, node: str, message: str) -> Scenario:
        return self.add(t, "kernel", node=node, message=message)

    def dcgm(self, t: float, node: str, gpu: int, metric: str, value: float) -> Scenario:
        return self.add(t, "dcgm", node=node, gpu=gpu, metric=metric, value=value)

    def nic_state(self, t: float, node: str, state: str, device: str = "mlx5_0") -> Scenario:
        return self.add(t, "nic", node=node, device=device, port=1, state=state)

    def nic_counter(self, t: float, node: str, counter: str, value: int,
                    device: str = "mlx5_0") -> Scenario:
        return self.add(t, "nic", node=node, device=device, port=1, counter=counter, value=value)

    def slurm_node(self, t: float, node: str, state: Any, reason: str = "") -> Scenario:
        fields: dict[str, Any] = {"node": node, "node_state": state}
        if reason:
            fields["reason"] = reason
        return self.add(t, "slurm", **fields)

    def slurm_job(self, t: float, job: str, state: Any, nodes: Iterable[str],
                  **extra: Any) -> Scenario:
        return self.add(t, "slurm", job=job, job_state=state, nodes=list(nodes), **extra)

    def k8s_condition(self, t: float, node: str, status: str, reason: str) -> Scenario:
        return self.add(t, "kubernetes", node=node, condition="Ready", status=status,
                        reason=reason)

    def k8s_event(self, t: float, node: str, reason: str, message: str) -> Scenario:
        return self.add(t, "kubernetes", node=node, event_reason=reason, message=message)

    def log(self, t: float, job: str, node: str, message: str) -> Scenario:
        return self.add(t, "job_log", job=job, node=node, message=message)

    def collector(self, t: float, name: str, healthy: bool, error: str = "") -> Scenario:
        fields: dict[str, Any] = {"name": name, "healthy": healthy}
        if error:
            fields["error"] = error
        return self.add(t, "collector", **fields)

    # --- building blocks -------------------------------------------------------------------

    def job(self, job_id: str, user: str, nodes: list[str], started: float | None = -600) -> str:
        self.jobs.append({"id": job_id, "user": user, "nodes": nodes})
        if started is not None and started >= 0:
            self.slurm_job(started, job_id, "RUNNING", nodes)
        return job_id

    def noise(self, *, hot: dict[str, float] | None = None, idle_after: dict[str, float]
              | None = None) -> Scenario:
        """What a healthy fleet says all the time."""
        rng, span = self.rng, self.minutes * 60
        for node in self.nodes:
            for gpu in rng.sample(range(8), 1):
                t = rng.uniform(0, 15)
                while t < span:
                    idle = idle_after and node in idle_after and t > idle_after[node]
                    temp = (hot or {}).get(node) or rng.uniform(48, 74)
                    self.dcgm(t, node, gpu, "DCGM_FI_DEV_GPU_TEMP", round(temp))
                    self.dcgm(t + 0.2, node, gpu, "DCGM_FI_DEV_GPU_UTIL",
                              0 if idle else rng.randrange(86, 101))
                    t += rng.choice((30, 45))
            baseline = rng.choice((0, 0, 0, 1, 2, 5))
            for t in (rng.uniform(0, 30), rng.uniform(span / 2, span / 2 + 30)):
                self.nic_counter(t, node, "link_downed", baseline)
            self.recovery_baseline[node] = rng.choice((0, 3, 11))
            self.nic_counter(rng.uniform(0, 30), node, "link_error_recovery",
                             self.recovery_baseline[node])
            # Kubernetes reports condition transitions; a fresh watch lists each node once.
            self.k8s_condition(rng.uniform(0, 40), node, "True", "KubeletReady")
        for node in rng.sample(self.nodes, min(3, len(self.nodes))):
            self.slurm_node(rng.uniform(0, 60), node, ["ALLOCATED"])
        return self

    def peers_time_out(self, t: float, job: str, culprit: str | None, *,
                       style: str = "watchdog") -> Scenario:
        """The other ranks of a job notice a peer is gone: the symptoms, not the fault."""
        nodes = next(j["nodes"] for j in self.jobs if j["id"] == job)
        seq = self.rng.randrange(1000, 90000)
        for i, node in enumerate(nodes):
            if node == culprit:
                continue
            rank = i * 8
            a, b = self.rng.randrange(1, 9), self.rng.randrange(2, 250)
            when = t + self.rng.uniform(0, 3)
            if style == "watchdog":
                self.log(when, job, node, WATCHDOG.format(rank=rank, seq=seq,
                                                          ms=self.rng.randrange(999)))
            elif style == "ib":
                tpl = self.rng.choice((IB_ERR, IB_STATUS, IB_STATUS_NAME))
                self.log(when, job, node, tpl.format(a=a, b=b, c=a, d=b + 1,
                                                     port=self.rng.randrange(30000, 60000)))
            else:
                self.log(when, job, node, REMOTE.format(rank=rank))
        return self

    def job_dies(self, t: float, job: str, state: str = "FAILED", **extra: Any) -> Scenario:
        nodes = next(j["nodes"] for j in self.jobs if j["id"] == job)
        return self.slurm_job(t, job, state, nodes, **extra)

    def expects(self, root_cause: str, nodes: Iterable[str] = (), *, switch: str | None = None,
                job: str | None = None) -> Scenario:
        item: dict[str, Any] = {"root_cause": root_cause, "nodes": sorted(nodes)}
        if switch:
            item["switch"] = switch
        if job:
            item["job"] = job
        self.expect.append(item)
        return self

    def leaf(self, index: int) -> tuple[str, list[str]]:
        name = list(self.topology)[index]
        return name, self.topology[name]

    def document(self) -> dict[str, Any]:
        signals = []
        for t, _, fields in sorted(self.signals, key=lambda s: (s[0], s[1])):
            at = self.start + timedelta(seconds=round(t, 3))
            signals.append({"at": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                            **fields})
        return {"format": "fleetwatch-replay/1", "name": self.name,
                "description": self.description, "topology": self.topology, "jobs": self.jobs,
                "signals": signals, "expect": self.expect}


SCENARIOS: list[Callable[[], Scenario]] = []


def scenario(fn: Callable[[], Scenario]) -> Callable[[], Scenario]:
    SCENARIOS.append(fn)
    return fn


def _xid(code: int, bus: str, text: str, pid: str = "'<unknown>'", name: str = "<unknown>") -> str:
    return f"NVRM: Xid (PCI:0000:{bus}:00): {code}, pid={pid}, name={name}, {text}"


# --- rule 1: hardware XIDs blame the node that logged them ----------------------------------


@scenario
def xid79_kernel_peers_time_out() -> Scenario:
    s = Scenario("xid79-kernel-peers-time-out", "XID 79 in one node's kernel log; the job's "
                 "seven other ranks time out in NCCL ten minutes later and Slurm marks the job "
                 "NODE_FAIL. Only the XID node is at fault.", seed=1, per_leaf=4)
    j = s.job("71001", "alice", s.nodes[:8])
    s.noise().kernel(120, s.nodes[5], XID79.format(bus="9b"))
    s.peers_time_out(720, j, s.nodes[5]).job_dies(740, j, "NODE_FAIL", state_reason="NodeDown")
    return s.expects("gpu_hardware", [s.nodes[5]])


@scenario
def xid79_dcgm_gauge_repeats() -> Scenario:
    s = Scenario("xid79-dcgm-gauge-repeats", "DCGM_FI_DEV_XID_ERRORS reads 79 on every scrape "
                 "after the fault (it is the last XID, not a count); the peers print IB "
                 "completion errors. One fault on one node.", seed=2, prefix="dgx-a-")
    j = s.job("88213", "bob", s.nodes[1:5])
    s.noise()
    for k in range(12):
        s.dcgm(60 + 15 * k, s.nodes[2], 3, "DCGM_FI_DEV_XID_ERRORS", 0 if k < 2 else 79)
    s.peers_time_out(200, j, s.nodes[2], style="ib")
    return s.expects("gpu_hardware", [s.nodes[2]])


@scenario
def xid62_peers_remote_error() -> Scenario:
    s = Scenario("xid62-peers-remote-error", "XID 62 (micro-controller halt); the other ranks "
                 "report 'remote process exited or there was a network error'.", seed=3)
    j = s.job("5521", "carol", s.nodes[:4])
    s.noise().kernel(90, s.nodes[0], _xid(62, "1b", "Internal micro-controller halt"))
    s.peers_time_out(150, j, s.nodes[0], style="remote")
    return s.expects("gpu_hardware", [s.nodes[0]])


@scenario
def xid143_init_failure() -> Scenario:
    s = Scenario("xid143-gpu-init-failure", "A GPU fails to initialize (XID 143) on one node; "
                 "its Kubernetes node stays Ready.", seed=4, leaves=3, per_leaf=3)
    s.noise().kernel(200, s.nodes[7], _xid(143, "c3", "GPU Initialization Failure"))
    return s.expects("gpu_hardware", [s.nodes[7]])


@scenario
def xid119_repeated() -> Scenario:
    s = Scenario("xid119-gsp-timeouts-repeat", "GSP RPC timeouts (XID 119) three times on one "
                 "GPU: the GPU is failing. The job's peers time out.", seed=5)
    j = s.job("612", "dan", s.nodes[4:8])
    s.noise()
    for t in (60, 180, 300):
        s.kernel(t, s.nodes[6], _xid(119, "4e", "Timeout after 6s of waiting for RPC response "
                                     "from GPU0 GSP!", pid="2231", name="python"))
    s.peers_time_out(320, j, s.nodes[6])
    return s.expects("gpu_hardware", [s.nodes[6]])


@scenario
def xid119_once() -> Scenario:
    s = Scenario("xid119-once-recovers", "One GSP RPC timeout (XID 119) that the driver recovers "
                 "from; the job keeps running. Not an incident.", seed=6)
    s.job("613", "dan", s.nodes[:4])
    s.noise().kernel(240, s.nodes[1], _xid(119, "4e", "Timeout after 6s of waiting for RPC "
                                           "response from GPU2 GSP!", pid="991", name="python"))
    return s


@scenario
def xid154_reboot_required() -> Scenario:
    s = Scenario("xid154-node-reboot-required", "XID 154: the driver now asks for a node "
                 "reboot. The node is at fault.", seed=7, prefix="h100-rc-")
    j = s.job("90001", "erin", s.nodes[2:6])
    s.noise().kernel(300, s.nodes[3], _xid(154, "3b", "GPU recovery action changed from 0x0 "
                                           "(None) to 0x2 (Node Reboot Required)"))
    s.peers_time_out(420, j, s.nodes[3])
    return s.expects("gpu_hardware", [s.nodes[3]])


@scenario
def xid154_back_to_none() -> Scenario:
    s = Scenario("xid154-recovered-to-none", "XID 154 saying the recovery action went back to "
                 "None after a GPU reset that an operator did: nothing to do.", seed=8)
    s.noise().kernel(100, s.nodes[2], _xid(154, "3b", "GPU recovery action changed from 0x1 "
                                           "(GPU Reset Required) to 0x0 (None)"))
    return s


@scenario
def xid79_then_unreachable() -> Scenario:
    s = Scenario("xid79-then-node-not-ready", "XID 79, then the node stops answering Kubernetes "
                 "and Slurm. The GPU fault is the cause, not an unreachable node.", seed=9)
    j = s.job("7702", "frank", s.nodes[:6])
    n = s.nodes[4]
    s.noise().kernel(60, n, XID79.format(bus="ab"))
    s.k8s_condition(110, n, "Unknown", "NodeStatusUnknown")
    s.k8s_event(111, n, "NodeNotReady", f"Node {n} status is now: NodeNotReady")
    s.slurm_node(130, n, ["DOWN", "NOT_RESPONDING"], "Not responding")
    s.peers_time_out(200, j, n).job_dies(230, j, "NODE_FAIL")
    return s.expects("gpu_hardware", [n])


# --- rule 2: memory and NVLink XIDs ------------------------------------------------------


@scenario
def xid48_then_45() -> Scenario:
    s = Scenario("xid48-dbe-then-xid45", "A double-bit ECC error (XID 48), then XID 45 "
                 "(preemptive cleanup) on the same GPU; the peers time out.", seed=10)
    j = s.job("3100", "gina", s.nodes[:4])
    n = s.nodes[1]
    s.noise().kernel(100, n, _xid(48, "3b", "An uncorrectable double bit error (DBE) has been "
                                  "detected on GPU in the framebuffer at partition 1, subpartition "
                                  "0.", pid="1234", name="python3"))
    s.kernel(101, n, _xid(45, "3b", "Ch 00000010, engmask 00000101, intr 10000000",
                          pid="1234", name="python3"))
    s.peers_time_out(400, j, n)
    return s.expects("gpu_memory", [n])


@scenario
def xid95_uncontained() -> Scenario:
    s = Scenario("xid95-uncontained-ecc", "Uncontained ECC error (XID 95) reported through "
                 "DCGM; the job's ranks on other nodes print IB errors.", seed=11, per_leaf=3)
    j = s.job("3101", "hank", s.nodes[:6])
    s.noise()
    for k in range(6):
        s.dcgm(200 + 15 * k, s.nodes[4], 6, "DCGM_FI_DEV_XID_ERRORS", 95)
    s.peers_time_out(260, j, s.nodes[4], style="ib")
    return s.expects("gpu_memory", [s.nodes[4]])


@scenario
def row_remap_failure() -> Scenario:
    s = Scenario("dcgm-row-remap-failure", "DCGM reports a row-remap failure on one GPU: its "
                 "memory cannot be repaired in place.", seed=12)
    s.noise()
    for k in range(8):
        s.dcgm(30 * k, s.nodes[3], 2, "DCGM_FI_DEV_ROW_REMAP_FAILURE", 0 if k < 3 else 1)
    return s.expects("gpu_memory", [s.nodes[3]])


@scenario
def xid63_remap_recorded() -> Scenario:
    s = Scenario("xid63-row-remap-recorded", "XID 63: a row was marked for remapping; the GPU "
                 "needs a reset for it to take effect.", seed=13)
    s.noise().kernel(50, s.nodes[6], _xid(63, "10", "Row Remapper: New row marked for remapping, "
                                          "reset gpu to activate.", pid="1896", name="python"))
    return s.expects("gpu_memory", [s.nodes[6]])


@scenario
def xid74_nvlink() -> Scenario:
    s = Scenario("xid74-nvlink-error", "An NVLink error (XID 74) on one node; its job's other "
                 "ranks time out.", seed=14)
    j = s.job("4410", "ivan", s.nodes[:8])
    s.noise().kernel(150, s.nodes[7], _xid(74, "c3", "NVLINK: Link 4 (0x00000000 0x00000000 "
                                           "0x00000000 0x00000000 0x00000000)"))
    s.peers_time_out(300, j, s.nodes[7])
    return s.expects("nvlink", [s.nodes[7]])


@scenario
def xid145_nvlink5() -> Scenario:
    s = Scenario("xid145-nvlink-rlw", "NVLink5 RLW error (XID 145) on a Blackwell node, through "
                 "the DCGM XID gauge.", seed=15, prefix="gb200-")
    s.noise()
    for k in range(5):
        s.dcgm(90 + 15 * k, s.nodes[0], 1, "DCGM_FI_DEV_XID_ERRORS", 145)
    return s.expects("nvlink", [s.nodes[0]])


# --- rule 3: application XIDs blame the job -----------------------------------------------


@scenario
def xid13_in_one_job() -> Scenario:
    s = Scenario("xid13-one-job", "XID 13 (graphics engine exception) from a job's own kernel; "
                 "the job fails. The job, not the node.", seed=16)
    j = s.job("2201", "judy", s.nodes[2:4])
    s.noise().kernel(200, s.nodes[2], _xid(13, "9b", "Graphics Exception: ESR 0x404600=0x80000002",
                                          pid="4411", name="python3"))
    s.log(205, j, s.nodes[2], "RuntimeError: CUDA error: an illegal instruction was encountered")
    s.job_dies(230, j, exit_code={"status": ["FAILED"], "return_code": {"set": True,
                                  "infinite": False, "number": 1}})
    return s.expects("application_error", job=j)


@scenario
def xid31_every_gpu_of_a_job() -> Scenario:
    s = Scenario("xid31-every-gpu-of-job", "XID 31 on every GPU of a four-node job at once: the "
                 "job's code faults, not 32 GPUs.", seed=17)
    j = s.job("2202", "ken", s.nodes[:4])
    s.noise()
    for node in s.nodes[:4]:
        for gpu in range(8):
            s.dcgm(300 + gpu * 0.1, node, gpu, "DCGM_FI_DEV_XID_ERRORS", 31)
    s.job_dies(320, j, exit_code=1)
    return s.expects("application_error", job=j)


@scenario
def xid43_then_45() -> Scenario:
    s = Scenario("xid43-and-45-one-job", "XID 43 then XID 45 from one job's process: a user "
                 "fault and its cleanup.", seed=18)
    j = s.job("2203", "lena", s.nodes[5:7])
    s.noise().kernel(100, s.nodes[5], _xid(43, "1b", "Ch 00000008", pid="7781", name="train.py"))
    s.kernel(100.5, s.nodes[5], _xid(45, "1b", "Ch 00000008", pid="7781", name="train.py"))
    return s.expects("application_error", job=j)


@scenario
def xid13_same_gpu_two_jobs() -> Scenario:
    s = Scenario("xid13-same-gpu-two-jobs", "The same GPU logs XID 13 under two different jobs: "
                 "the GPU, not the code.", seed=19)
    n = s.nodes[3]
    a = s.job("3301", "mike", [n], started=None)
    b = s.job("3302", "nina", [n], started=None)
    s.noise()
    s.slurm_job(10, a, "RUNNING", [n])
    s.kernel(100, n, _xid(13, "86", "Graphics Exception: ESR 0x405840=0x1", pid="111",
                          name="python"))
    s.slurm_job(110, a, "FAILED", [n], exit_code=1)
    s.slurm_job(200, b, "RUNNING", [n])
    s.kernel(400, n, _xid(13, "86", "Graphics Exception: ESR 0x405840=0x1", pid="222",
                          name="python"))
    s.slurm_job(410, b, "FAILED", [n], exit_code=1)
    return s.expects("gpu_hardware", [n])


# --- rule 4: one node's link flapping -----------------------------------------------------


@scenario
def link_flap_one_node() -> Scenario:
    s = Scenario("link-flap-one-node", "One node's HCA port goes DOWN and back ACTIVE, "
                 "link_downed rises; the job's other ranks print IB errors.", seed=20)
    j = s.job("6001", "omar", s.nodes[:8])
    n = s.nodes[2]
    s.noise()
    s.nic_counter(100, n, "link_downed", 7)
    s.nic_state(200, n, "DOWN").nic_counter(200.5, n, "link_downed", 8)
    s.nic_state(212, n, "ACTIVE")
    s.peers_time_out(215, j, n, style="ib")
    return s.expects("network_flap", [n])


@scenario
def netdev_link_down_up() -> Scenario:
    s = Scenario("netdev-link-down-up", "mlx5_core prints Link down / Link up on one node; the "
                 "job's other ranks time out.", seed=21, prefix="node")
    j = s.job("6002", "pia", s.nodes[3:7])
    n = s.nodes[4]
    s.noise().kernel(300, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link down")
    s.kernel(309, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link up")
    s.peers_time_out(320, j, n, style="remote")
    return s.expects("network_flap", [n])


@scenario
def link_error_recovery_tick() -> Scenario:
    s = Scenario("link-error-recovery-single-tick", "link_error_recovery rises by one on one "
                 "node and nothing else happens: not an incident.", seed=22)
    n = s.nodes[1]
    s.noise().nic_counter(400, n, "link_error_recovery", s.recovery_baseline[n] + 1)
    return s


@scenario
def quiet_fleet() -> Scenario:
    s = Scenario("quiet-fleet-non-zero-counters", "A healthy fleet whose NIC counters have "
                 "non-zero totals from long ago. Nothing happens.", seed=23, leaves=3)
    s.job("6003", "quinn", s.nodes[:6])
    return s.noise()


@scenario
def flap_while_other_job_ooms() -> Scenario:
    s = Scenario("flap-and-oom-at-once", "A link flaps on one node while an unrelated job dies "
                 "of CUDA OOM: two diagnoses.", seed=24)
    a = s.job("6101", "rosa", s.nodes[:4])
    b = s.job("6102", "sam", s.nodes[4:8])
    n = s.nodes[1]
    s.noise().nic_state(100, n, "DOWN").nic_state(104, n, "ACTIVE")
    s.peers_time_out(110, a, n, style="ib")
    s.log(130, b, s.nodes[6], "Traceback (most recent call last):")
    s.log(130.1, b, s.nodes[6], "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
          "2.00 GiB. GPU 3 has a total capacity of 79.10 GiB of which 1.21 GiB is free.")
    s.job_dies(140, b, exit_code={"status": "FAILED", "return_code": 1})
    return s.expects("network_flap", [n]).expects("application_error", job=b)


# --- rule 5: a leaf switch ------------------------------------------------------------


@scenario
def leaf_down_three_of_four() -> Scenario:
    s = Scenario("leaf-down-three-of-four", "Three of four nodes under one leaf lose their link "
                 "within two seconds; jobs on them print NCCL errors. The switch.", seed=25)
    leaf, members = s.leaf(0)
    j = s.job("7001", "tara", members + s.leaf(1)[1][:2])
    s.noise()
    for k, n in enumerate(members[:3]):
        s.nic_state(300 + k * 0.7, n, "DOWN")
        s.nic_state(340 + k, n, "ACTIVE")
    s.peers_time_out(330, j, None, style="ib")
    s.job_dies(360, j, "FAILED", exit_code=1)
    return s.expects("switch_failure", members[:3], switch=leaf)


@scenario
def leaf_down_nodes_not_ready() -> Scenario:
    s = Scenario("leaf-down-nodes-not-ready", "A leaf dies: its nodes lose their links and then "
                 "Kubernetes marks them NotReady. The switch, not the nodes.", seed=26,
                 per_leaf=5)
    leaf, members = s.leaf(1)
    s.noise()
    for k, n in enumerate(members):
        s.kernel(200 + k * 0.3, n, f"mlx5_core 0000:{k + 12:02x}:00.0 ibp{k}s0: Link down")
        s.k8s_condition(245 + k, n, "False", "NodeNotReady")
    return s.expects("switch_failure", members, switch=leaf)


@scenario
def two_nodes_different_leaves() -> Scenario:
    s = Scenario("two-flaps-different-leaves", "Two nodes on different leaves flap at the same "
                 "time: two node faults, not a switch.", seed=27)
    a, b = s.leaf(0)[1][0], s.leaf(1)[1][2]
    s.noise()
    for n in (a, b):
        s.nic_state(120, n, "DOWN").nic_state(125, n, "ACTIVE")
    return s.expects("network_flap", [a]).expects("network_flap", [b])


@scenario
def two_of_six_on_a_leaf() -> Scenario:
    s = Scenario("two-of-six-on-a-leaf", "Two of six nodes under one leaf flap together: a "
                 "minority, so the nodes, not the switch.", seed=28, per_leaf=6)
    members = s.leaf(0)[1]
    s.noise()
    for n in members[:2]:
        s.nic_counter(10, n, "link_downed", 1)
        s.nic_counter(130, n, "link_downed", 2)
    return s.expects("network_flap", members[:2])


# --- rule 6: thermal -------------------------------------------------------------------


def _thermal(s: Scenario, node: str, gpu: int, start: float, samples: int, mask: int,
             temp: float) -> None:
    for k in range(samples):
        t = start + 15 * k
        s.dcgm(t, node, gpu, "DCGM_FI_DEV_GPU_TEMP", temp + s.rng.uniform(-1, 1))
        s.dcgm(t + 0.1, node, gpu, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", mask)


@scenario
def thermal_sustained() -> Scenario:
    s = Scenario("thermal-sustained-hw-slowdown", "Two GPUs of one node held back by hardware "
                 "thermal slowdown for five minutes at 91-93 C.", seed=29)
    s.noise()
    _thermal(s, s.nodes[5], 2, 60, 20, 0x40 | 0x8, 92)
    _thermal(s, s.nodes[5], 3, 65, 20, 0x20, 91)
    return s.expects("thermal", [s.nodes[5]])


@scenario
def warm_not_throttling() -> Scenario:
    s = Scenario("warm-gpu-not-throttling", "A GPU runs at 83 C for ten minutes at full clocks: "
                 "warm, not a fault.", seed=30)
    s.noise()
    _thermal(s, s.nodes[0], 4, 0, 40, 0x0, 83)
    return s


@scenario
def power_brake_normal_temp() -> Scenario:
    s = Scenario("power-brake-normal-temperature", "Power brake slowdown (0x80) at 60 C: a "
                 "power event, not heat.", seed=31)
    s.noise()
    _thermal(s, s.nodes[2], 1, 100, 20, 0x80, 60)
    return s


@scenario
def thermal_blip() -> Scenario:
    s = Scenario("thermal-blip-one-scrape", "One scrape shows software thermal slowdown at 86 C, "
                 "the next ones are normal.", seed=32)
    s.noise()
    _thermal(s, s.nodes[3], 0, 100, 1, 0x20, 86)
    _thermal(s, s.nodes[3], 0, 115, 10, 0x0, 75)
    return s


# --- rule 7: a node stops answering ----------------------------------------------------


@scenario
def node_unreachable_both_sources() -> Scenario:
    s = Scenario("node-unreachable-k8s-and-slurm", "A node stops answering: Kubernetes Ready "
                 "goes Unknown and Slurm marks it DOWN, Not responding. No GPU or NIC "
                 "evidence.", seed=33)
    j = s.job("8001", "uma", s.nodes[:4])
    n = s.nodes[3]
    s.noise()
    s.k8s_condition(300, n, "Unknown", "NodeStatusUnknown")
    s.slurm_node(330, n, ["DOWN", "NOT_RESPONDING"], "Not responding")
    s.peers_time_out(360, j, n).job_dies(380, j, "NODE_FAIL")
    return s.expects("node_unreachable", [n])


@scenario
def node_unreachable_slurm_22_05() -> Scenario:
    s = Scenario("node-unreachable-slurm-22-05", "Slurm 22.05 shape: the node state is a string "
                 "with state_flags; the node stopped responding.", seed=34)
    n = s.nodes[6]
    s.noise().add(200, "slurm", node=n, node_state="down", state_flags=["NOT_RESPONDING"],
                  reason="Not responding")
    return s.expects("node_unreachable", [n])


@scenario
def unreachable_after_link_loss() -> Scenario:
    s = Scenario("unreachable-after-link-loss", "A node's link goes down and stays down; then "
                 "Slurm says it is not responding. The link, not an unreachable node.", seed=35)
    n = s.nodes[0]
    s.noise().nic_state(100, n, "DOWN").slurm_node(160, n, ["DOWN", "NOT_RESPONDING"],
                                                   "Not responding")
    return s.expects("network_flap", [n])


# --- rule 8: a source outage is not a fleet failure ------------------------------------


@scenario
def slurmctld_restart() -> Scenario:
    s = Scenario("slurmctld-restart-all-not-responding", "slurmctld restarts: Slurm briefly says "
                 "every node is NOT_RESPONDING, while Kubernetes and DCGM carry on.", seed=36)
    s.job("9001", "vic", s.nodes[:8])
    s.noise()
    for k, n in enumerate(s.nodes):
        s.slurm_node(200 + k * 0.2, n, ["ALLOCATED", "NOT_RESPONDING"])
        s.slurm_node(290 + k * 0.2, n, ["ALLOCATED"])
    return s


@scenario
def collector_unhealthy() -> Scenario:
    s = Scenario("slurm-collector-unhealthy", "The Slurm collector cannot reach slurmctld and "
                 "says so; the node states it read around the outage are stale.", seed=37)
    s.noise().collector(100, "slurm", False, "slurmctld unreachable: connection refused")
    for n in s.nodes[:3]:
        s.slurm_node(130, n, ["DOWN"], "Not responding")
    s.collector(400, "slurm", True)
    return s


@scenario
def kubernetes_alone_says_all_unknown() -> Scenario:
    s = Scenario("kubernetes-alone-all-unknown", "The Kubernetes API server lags and every node "
                 "goes Ready=Unknown at once; Slurm and DCGM see the nodes working.", seed=38,
                 leaves=3, per_leaf=3)
    s.noise()
    for k, n in enumerate(s.nodes):
        s.k8s_condition(250 + k * 0.5, n, "Unknown", "NodeStatusUnknown")
    return s


# --- rule 9: things that are not incidents ---------------------------------------------


@scenario
def admin_down_with_reason() -> Scenario:
    s = Scenario("admin-down-for-maintenance", "An administrator drains a node and later takes "
                 "it down for a firmware flash; its link and Kubernetes status drop as it "
                 "reboots. Maintenance, not a fault.", seed=39)
    n = s.nodes[4]
    s.noise().slurm_node(60, n, ["IDLE", "DRAIN"], "maint: BMC firmware (ticket OPS-4411)")
    s.slurm_node(300, n, ["DOWN", "DRAIN"], "maint: BMC firmware (ticket OPS-4411)")
    s.nic_state(320, n, "DOWN").k8s_condition(360, n, "Unknown", "NodeStatusUnknown")
    return s


@scenario
def job_completes_gpus_idle() -> Scenario:
    s = Scenario("job-completes-gpus-idle", "A job completes; its GPUs go to 0% utilisation. "
                 "Nothing failed.", seed=40)
    j = s.job("9101", "wes", s.nodes[:4])
    s.noise(idle_after={n: 300 for n in s.nodes[:4]}).job_dies(300, j, "COMPLETED", exit_code=0)
    return s


@scenario
def job_cancelled_prints_traceback() -> Scenario:
    s = Scenario("job-cancelled-with-traceback", "A user cancels a job; its ranks print "
                 "KeyboardInterrupt tracebacks as they stop.", seed=41)
    j = s.job("9102", "xena", s.nodes[2:6])
    s.noise().slurm_job(200, j, "CANCELLED", s.nodes[2:6])
    for n in s.nodes[2:6]:
        s.log(201, j, n, "Traceback (most recent call last):")
        s.log(201.1, j, n, "KeyboardInterrupt")
    return s


# --- rule 10: several faults at once ---------------------------------------------------


@scenario
def leaf_and_xid79_elsewhere() -> Scenario:
    s = Scenario("leaf-down-and-xid79-elsewhere", "A leaf fails while a GPU on the other leaf "
                 "falls off the bus: two diagnoses.", seed=42)
    leaf, members = s.leaf(0)
    other = s.leaf(1)[1][1]
    j = s.job("9201", "yuri", s.leaf(1)[1])
    s.noise()
    for k, n in enumerate(members):
        s.nic_state(150 + k * 0.2, n, "DOWN").nic_state(185 + k * 0.2, n, "ACTIVE")
    s.kernel(160, other, XID79.format(bus="9b"))
    s.peers_time_out(300, j, other)
    return s.expects("switch_failure", members, switch=leaf).expects("gpu_hardware", [other])


@scenario
def xid48_and_oom_elsewhere() -> Scenario:
    s = Scenario("xid48-and-oom-elsewhere", "A DBE in one job's node while another job dies of "
                 "CUDA OOM: two diagnoses.", seed=43)
    a = s.job("9301", "zoe", s.nodes[:4])
    b = s.job("9302", "al", s.nodes[4:6])
    s.noise()
    for k in range(6):
        s.dcgm(100 + 15 * k, s.nodes[2], 5, "DCGM_FI_DEV_XID_ERRORS", 48)
    s.peers_time_out(150, a, s.nodes[2])
    s.log(200, b, s.nodes[5], "RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB")
    s.job_dies(210, b, exit_code=256)
    return s.expects("gpu_memory", [s.nodes[2]]).expects("application_error", job=b)


# --- application failures ----------------------------------------------------------------


@scenario
def cuda_oom() -> Scenario:
    s = Scenario("cuda-oom-job", "A job runs out of GPU memory and fails; its other ranks then "
                 "time out. The job's own bug.", seed=44)
    j = s.job("9401", "bea", s.nodes[:4])
    s.noise().log(120, j, s.nodes[0], "torch.OutOfMemoryError: CUDA out of memory. Tried to "
                  "allocate 20.00 GiB.")
    s.peers_time_out(200, j, s.nodes[0])
    s.job_dies(220, j, exit_code={"status": ["FAILED"], "return_code": {"set": True,
                                  "infinite": False, "number": 1}})
    return s.expects("application_error", job=j)


@scenario
def traceback_exit_code() -> Scenario:
    s = Scenario("python-exception-exit-1", "A training script raises ValueError and exits 1.",
                 seed=45)
    j = s.job("9402", "cy", s.nodes[6:8])
    s.noise().log(60, j, s.nodes[6], "Traceback (most recent call last):")
    s.log(60.1, j, s.nodes[6], "ValueError: Expected input batch_size (32) to match target "
          "batch_size (16).")
    s.log(61, j, s.nodes[6], "srun: error: " + s.nodes[6] + ": task 0: Exited with exit code 1")
    s.job_dies(62, j, exit_code="1:0")
    return s.expects("application_error", job=j)


@scenario
def xid79_job_tracebacks() -> Scenario:
    s = Scenario("xid79-ranks-crash-with-tracebacks", "XID 79; the job's ranks crash with "
                 "NCCL tracebacks and the job FAILS. The GPU, not the job's code.", seed=46)
    j = s.job("9403", "di", s.nodes[:4])
    n = s.nodes[1]
    s.noise().kernel(100, n, XID79.format(bus="1d"))
    for node in s.nodes[:4]:
        if node != n:
            s.log(180, j, node, "Traceback (most recent call last):")
            s.log(180.1, j, node, "torch.distributed.DistBackendError: NCCL error in: "
                  "ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error")
    s.job_dies(200, j, exit_code=1)
    return s.expects("gpu_hardware", [n])


@scenario
def hostlist_job_nodes() -> Scenario:
    s = Scenario("node-fail-hostlist-22-05", "Slurm 22.05 reports a job NODE_FAIL with a "
                 "hostlist and an integer exit code, after the node stopped answering "
                 "Kubernetes.", seed=47, prefix="gpu-")
    j = s.job("9404", "ed", s.nodes[:4])
    n = s.nodes[2]
    s.noise().k8s_condition(100, n, "Unknown", "NodeStatusUnknown")
    s.k8s_event(101, n, "NodeNotReady", f"Node {n} status is now: NodeNotReady")
    lo, hi = s.nodes[0].split("-")[1], s.nodes[3].split("-")[1]
    s.add(200, "slurm", job=j, job_state="NODE_FAIL", nodes=f"gpu-[{lo}-{hi}]", exit_code=0)
    s.peers_time_out(210, j, n)
    return s.expects("node_unreachable", [n])


# --- unseen-style cases: line forms, shapes and combinations the rules must still read ------
# Written against the rules in issue 3 rather than the patterns above: every GPU scraped with
# its XID gauge repeating, labels as the exporter writes them, collectors named as deployed.


def _scrape_all(s: Scenario, nodes: Iterable[str], gpus: int, *, every: float = 15,
                xid: dict[tuple[str, int], list[tuple[float, int]]] | None = None,
                labels_as_strings: bool = False) -> None:
    """dcgm-exporter as Prometheus scrapes it: every GPU, every field, every scrape; the XID
    field is a gauge holding the last XID, so after a fault it repeats on every scrape."""
    for node in nodes:
        t = s.rng.uniform(0, every)
        while t < s.minutes * 60:
            for g in range(gpus):
                code = 0
                for since, value in (xid or {}).get((node, g), []):
                    if t >= since:
                        code = value
                gpu: Any = str(g) if labels_as_strings else g
                s.add(t, "dcgm", node=node, gpu=gpu, metric="DCGM_FI_DEV_XID_ERRORS", value=code)
                s.add(t, "dcgm", node=node, gpu=gpu, metric="DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                      value=0)
            t += every


@scenario
def xid154_reboot_to_reset() -> Scenario:
    s = Scenario("xid154-reboot-to-gpu-reset", "XID 154 going from 0x2 (Node Reboot Required) to "
                 "0x1 (GPU Reset Required): the driver still wants the GPU reset.", seed=48,
                 prefix="dgx-a-")
    n = s.nodes[5]
    s.noise().kernel(240, n, _xid(154, "c1", "GPU recovery action changed from 0x2 (Node Reboot "
                                  "Required) to 0x1 (GPU Reset Required)"))
    _scrape_all(s, s.nodes[4:6], 4, xid={(n, 2): [(245, 154)]})
    return s.expects("gpu_hardware", [n])


@scenario
def xid154_drain_actions() -> Scenario:
    s = Scenario("xid154-drain-and-reset-and-drain-p2p", "XID 154 asking for 'Drain and Reset' on "
                 "one node and 'Drain P2P' on another, while a third goes back to None after a "
                 "reset: two faults, one recovery.", seed=49, prefix="hgx")
    a, b, c = s.nodes[1], s.nodes[4], s.nodes[6]
    s.noise().kernel(100, a, _xid(154, "18", "GPU recovery action changed from 0x0 (None) to 0x4 "
                                  "(Drain and Reset)"))
    s.kernel(160, b, _xid(154, "2a", "GPU recovery action changed from 0x0 (None) to 0x3 (Drain "
                          "P2P)"))
    s.kernel(170, c, _xid(154, "2a", "GPU recovery action changed from 0x1 (GPU Reset Required) "
                          "to 0x0 (None)"))
    return s.expects("gpu_hardware", [a]).expects("gpu_hardware", [b])


@scenario
def xid119_once_string_labels() -> Scenario:
    s = Scenario("xid119-once-exporter-string-labels", "One GSP timeout (XID 119) on GPU 1; the "
                 "exporter labels GPUs as strings and the gauge reads 119 on every scrape after. "
                 "Once is recoverable: no incident.", seed=50, per_leaf=3)
    n = s.nodes[2]
    s.noise().kernel(300, n, _xid(119, "5d", "Timeout after 6s of waiting for RPC response from "
                                  "GPU1 GSP!", pid="7781", name="pt_main_thread"))
    _scrape_all(s, s.nodes[:4], 4, xid={(n, 1): [(302, 119)]}, labels_as_strings=True)
    return s


@scenario
def xid13_two_jobs_placed_by_output() -> Scenario:
    s = Scenario("xid13-same-gpu-two-jobs-no-slurm", "XID 13 on the same GPU under two jobs that "
                 "Slurm says nothing about; their output places each XID in its job. The GPU, "
                 "not the code.", seed=51, minutes=40)
    n = s.nodes[3]
    first, second = s.job("a1", "ann", [n], None), s.job("a2", "ben", [n], None)
    xid = _xid(13, "3b", "Graphics SM Warp Exception on (GPC 4, TPC 2, SM 1): Out Of Range "
               "Register", pid="881", name="python")
    s.noise().log(20, first, n, "epoch 0 step 10 loss 3.11")
    s.kernel(300, n, xid).log(301, first, n, "RuntimeError: CUDA error: an illegal instruction "
                              "was encountered")
    s.log(1200, second, n, "epoch 0 step 1 loss 2.71").kernel(1800, n, xid)
    s.log(1801, second, n, "RuntimeError: CUDA error: an illegal instruction was encountered")
    return s.expects("gpu_hardware", [n])


@scenario
def xid79_then_reboot() -> Scenario:
    s = Scenario("xid79-then-node-reboots", "XID 79, then the node is rebooted: it goes NotReady, "
                 "its IB link drops and comes back. One GPU fault, not a flap too.", seed=52,
                 minutes=25)
    j = s.job("5858", "rr", s.nodes[1:4] + s.nodes[6:7])
    n = s.nodes[2]
    s.noise().kernel(200, n, XID79.format(bus="b1")).peers_time_out(230, j, n)
    s.k8s_condition(400, n, "Unknown", "NodeStatusUnknown").nic_state(401, n, "DOWN")
    s.kernel(402, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link down")
    s.slurm_node(420, n, ["DOWN", "NOT_RESPONDING"], "Not responding")
    s.nic_state(700, n, "ACTIVE").kernel(701, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link up")
    s.k8s_condition(720, n, "True", "KubeletReady")
    return s.expects("gpu_hardware", [n])


@scenario
def leaf_seen_only_as_unreachable() -> Scenario:
    s = Scenario("leaf-down-seen-only-as-unreachable", "Every node under one leaf stops answering "
                 "Kubernetes and Slurm within seconds; no NIC telemetry is collected and the "
                 "other three leaves keep answering. The switch, not four nodes.", seed=53,
                 leaves=4, per_leaf=4)
    leaf, nodes = s.leaf(2)
    s.noise()
    for i, n in enumerate(nodes):
        s.k8s_condition(400 + i, n, "Unknown", "NodeStatusUnknown")
        s.slurm_node(430 + i, n, ["DOWN", "NOT_RESPONDING"], "Not responding")
    return s.expects("switch_failure", nodes, switch=leaf)


@scenario
def leaf_four_links_five_not_ready() -> Scenario:
    s = Scenario("leaf-down-one-node-only-not-ready", "Four of a leaf's five nodes report their "
                 "link down; all five go NotReady. The fifth's link report was lost: it is "
                 "under the same dead switch, not a node of its own to recover.", seed=54,
                 per_leaf=5, leaves=3)
    leaf, nodes = s.leaf(0)
    s.noise()
    for i, n in enumerate(nodes[:2] + nodes[3:]):
        s.nic_state(300 + i * 1.5, n, "DOWN")
    for i, n in enumerate(nodes):
        s.k8s_condition(330 + i, n, "Unknown", "NodeStatusUnknown")
    return s.expects("switch_failure", nodes, switch=leaf)


@scenario
def thermal_flickering() -> Scenario:
    s = Scenario("thermal-bouncing-off-the-limit", "A GPU at 91 C is slowed by hw thermal "
                 "slowdown on every other scrape for ten minutes: sustained, not a blip.",
                 seed=55)
    s.noise()
    for k in range(40):
        _thermal(s, s.nodes[5], 1, 60 + 15 * k, 1, 0x40 if k % 2 == 0 else 0x0, 91)
    return s.expects("thermal", [s.nodes[5]])


@scenario
def hw_slowdown_hot_and_power_brake() -> Scenario:
    s = Scenario("hw-slowdown-hot-vs-power-brake", "One GPU is held by HW slowdown (0x8) at 94 C "
                 "for five minutes: heat. Another is held by HW slowdown with the power brake "
                 "(0x88) at 90 C: power, not heat.", seed=56)
    s.noise()
    _thermal(s, s.nodes[1], 0, 100, 20, 0x8, 94)
    _thermal(s, s.nodes[6], 3, 100, 20, 0x88, 90)
    return s.expects("thermal", [s.nodes[1]])


@scenario
def kube_apiserver_outage() -> Scenario:
    s = Scenario("kube-apiserver-collector-outage", "The collector named 'kube-apiserver' reports "
                 "itself unhealthy; meanwhile two nodes read Ready=Unknown. The source, not the "
                 "nodes.", seed=57)
    s.noise().collector(200, "kube-apiserver", False, "etcdserver: request timed out")
    s.k8s_condition(230, s.nodes[1], "Unknown", "NodeStatusUnknown")
    s.k8s_condition(231, s.nodes[6], "Unknown", "NodeStatusUnknown")
    s.collector(400, "kube-apiserver", True)
    return s


@scenario
def recovery_ticks_slow_drift() -> Scenario:
    s = Scenario("link-error-recovery-slow-drift", "link_error_recovery creeps up by one every "
                 "ten minutes on three nodes for an hour: a healthy, noisy link, not a flap.",
                 seed=58, minutes=60)
    s.noise()
    for n in s.nodes[1:4]:
        for k, t in enumerate(range(10, 3600, 300)):
            s.nic_counter(t, n, "link_error_recovery", 100 + k // 2, device="mlx5_1")
    return s


@scenario
def flap_peers_status_in_words() -> Scenario:
    s = Scenario("flap-peers-status-in-words", "A port goes DOWN, POLLING, then ACTIVE; the job's "
                 "other ranks print NCCL 2.23's 'status=transport retry counter exceeded(12)'.",
                 seed=59)
    j = s.job("5757", "quinn", s.nodes[1:3] + s.nodes[5:6])
    n = s.nodes[5]
    s.noise().nic_state(300, n, "DOWN", device="mlx5_4").nic_state(304, n, "POLLING",
                                                                   device="mlx5_4")
    s.nic_state(320, n, "ACTIVE", device="mlx5_4")
    for i, peer in enumerate(s.nodes[1:3]):
        s.log(301 + i, j, peer, f"{peer}:881:902 [5] transport/net_ib.cc:2101 NCCL WARN NET/IB: "
              f"Got completion from peer 10.1.0.{i + 5}<40001> with status=transport retry "
              "counter exceeded(12) opcode=Send(0) vendor_err=129  localGid ::ffff:10.1.0.2 hca "
              "mlx5_4")
    return s.expects("network_flap", [n])


@scenario
def slurmctld_restart_one_really_dead() -> Scenario:
    s = Scenario("slurmctld-restart-one-node-really-down", "slurmctld restarts and marks every "
                 "node NOT_RESPONDING; all answer again except one, which Kubernetes also says "
                 "is gone. That one node is unreachable.", seed=60, per_leaf=5)
    dead = s.nodes[7]
    s.noise()
    for i, n in enumerate(s.nodes):
        s.slurm_node(300 + i, n, ["DOWN", "NOT_RESPONDING"], "Not responding")
        if n != dead:
            s.slurm_node(420 + i, n, ["IDLE"])
    s.k8s_condition(320, dead, "Unknown", "NodeStatusUnknown")
    return s.expects("node_unreachable", [dead])


@scenario
def k8s_all_not_ready_plus_xid79() -> Scenario:
    s = Scenario("kubernetes-blip-and-xid79", "Kubernetes alone says every node NotReady for two "
                 "minutes; separately, one GPU falls off the bus. One fault.", seed=61)
    s.noise()
    for i, n in enumerate(s.nodes):
        s.k8s_condition(300 + i * 0.5, n, "Unknown", "NodeStatusUnknown")
        s.k8s_condition(420 + i * 0.5, n, "True", "KubeletReady")
    s.kernel(500, s.nodes[6], XID79.format(bus="9b"))
    return s.expects("gpu_hardware", [s.nodes[6]])


@scenario
def admin_drain_plus_xid79() -> Scenario:
    s = Scenario("admin-drain-and-xid79-elsewhere", "An administrator drains a node to swap a "
                 "PSU (it goes NotReady and NOT_RESPONDING); at the same time a GPU falls off the "
                 "bus on another node. Only the GPU node is at fault.", seed=62, prefix="hgx")
    drained, bad = s.nodes[1], s.nodes[5]
    j = s.job("910", "di", s.nodes[4:6])
    s.noise().slurm_node(100, drained, ["IDLE", "DRAIN"], "swap PSU -- ops ticket 4411")
    s.k8s_condition(200, drained, "False", "KubeletNotReady")
    s.slurm_node(205, drained, ["DOWN", "DRAIN", "NOT_RESPONDING"], "swap PSU -- ops ticket 4411")
    s.kernel(210, bad, XID79.format(bus="ad")).peers_time_out(250, j, bad)
    return s.expects("gpu_hardware", [bad])


@scenario
def xid13_then_45_one_job() -> Scenario:
    s = Scenario("xid13-then-45-job-fails", "XID 13 twice and XID 45 on one GPU inside one job, "
                 "then an illegal-memory-access exception; the peer times out. The job's bug: "
                 "XID 45 follows the 13 before it.", seed=63)
    j = s.job("9131", "pat", s.nodes[:2])
    n = s.nodes[1]
    s.noise().kernel(200, n, _xid(13, "1a", "Graphics SM Warp Exception on (GPC 1, TPC 3, SM 0): "
                                  "Out Of Range Address", pid="1414", name="python"))
    s.kernel(200.5, n, _xid(13, "1a", "Graphics Exception: ESR 0x51e730=0x20e0010",
                            pid="1414", name="python"))
    s.kernel(201, n, _xid(45, "1a", "Ch 00000008", pid="1414", name="python"))
    s.log(203, j, n, "RuntimeError: CUDA error: an illegal memory access was encountered")
    s.peers_time_out(260, j, n).job_dies(300, j, ["FAILED"], exit_code={
        "status": ["ERROR"], "return_code": {"set": True, "infinite": False, "number": 1}})
    return s.expects("application_error", job=j)


@scenario
def three_faults_at_once() -> Scenario:
    s = Scenario("thermal-flap-and-oom-at-once", "Three faults in one window: a GPU overheating "
                 "on one node, a Broadcom NIC link down and up on another, a CUDA OOM in a third "
                 "node's job.", seed=64)
    s.noise()
    _thermal(s, s.nodes[0], 0, 100, 30, 0x60, 95)
    s.kernel(300, s.nodes[4], "bnxt_en 0000:41:00.0 ens2f0np0: NIC Link is Down")
    s.kernel(330, s.nodes[4], "bnxt_en 0000:41:00.0 ens2f0np0: NIC Link is Up, 100000 Mbps full "
             "duplex, Flow control: none")
    j = s.job("8383", "xu", s.nodes[7:8])
    s.log(400, j, s.nodes[7], "RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB")
    s.job_dies(401, j, ["FAILED"], exit_code={"return_code": 1})
    return (s.expects("thermal", [s.nodes[0]]).expects("network_flap", [s.nodes[4]])
            .expects("application_error", job=j))


@scenario
def two_xid79_same_job() -> Scenario:
    s = Scenario("two-xid79-in-one-job", "Two GPUs on two nodes of one job fall off the bus a "
                 "minute apart; the other ranks print every NCCL error form. Two faults, no "
                 "victim blamed.", seed=65)
    j = s.job("7171", "uu", s.nodes[:6])
    a, b = s.nodes[1], s.nodes[3]
    s.noise().kernel(300, a, XID79.format(bus="9b")).kernel(360, b, XID79.format(bus="1b"))
    for k, style in enumerate(("ib", "remote", "watchdog")):
        s.peers_time_out(370 + 200 * k, j, a, style=style)
    return s.expects("gpu_hardware", [a]).expects("gpu_hardware", [b])


@scenario
def slurm_outage_plus_xid79() -> Scenario:
    s = Scenario("slurmrestd-outage-and-xid79", "The 'slurmrestd' collector fails and Slurm's "
                 "stale view says three nodes are down; meanwhile one GPU falls off the bus. One "
                 "fault, one source outage.", seed=66, per_leaf=6)
    s.noise().collector(200, "slurmrestd", False, "HTTP 502 from slurmrestd")
    for n in (s.nodes[0], s.nodes[4], s.nodes[9]):
        s.slurm_node(210, n, ["DOWN"], "Not responding")
    s.collector(260, "slurmrestd", True)
    bad = s.nodes[10]
    s.kernel(300, bad, XID79.format(bus="9b"))
    return s.expects("gpu_hardware", [bad])


@scenario
def xid149_nvlink5_with_reboot_request() -> Scenario:
    s = Scenario("xid149-nvlink5-asks-reboot", "NVLink5 NETIR error (XID 149), then XID 154 asking "
                 "for a node reboot: an NVLink fault on that node.", seed=67, per_leaf=6,
                 prefix="gb-")
    n = s.nodes[4]
    s.noise().kernel(100, n, _xid(149, "01", "Link 12 (0x00000000 0x00000000 0x00000000) "
                                  "NETIR_LINK_EVT Fatal XC0 i0 Link 12 (0x0004ff2d 0x00000000)"))
    s.kernel(101, n, _xid(154, "01", "GPU recovery action changed from 0x0 (None) to 0x2 (Node "
                          "Reboot Required)"))
    return s.expects("nvlink", [n])


@scenario
def unreachable_sinfo_shapes() -> Scenario:
    s = Scenario("node-unreachable-state-strings", "Slurm reports a node as 'idle*' (sinfo) and "
                 "then 'IDLE+NOT_RESPONDING'; Kubernetes agrees it is gone.", seed=68)
    n = s.nodes[2]
    s.noise().slurm_node(300, n, "idle*").slurm_node(360, n, "IDLE+NOT_RESPONDING")
    s.k8s_event(310, n, "NodeNotReady", f"Node {n} status is now: NodeNotReady")
    return s.expects("node_unreachable", [n])


# --- time, cause and consequence, shared nodes, ordinary life ---------------------------------
# Real lines: PyTorch 2.x's rank prefixes and c10d errors (pytorch/pytorch issues 113128,
# 122732), torchrun's elastic agent (torch/distributed/elastic/multiprocessing/api.py), srun's
# task exits, mlx5's netdev link lines, Slurm's node state flags (slurm/src/common/slurm_protocol_defs.c).

LINK_DOWN = "mlx5_core 0000:{bus}:00.0 ibp{bus}s0: Link down"
RANK_CUDA_LAUNCH = "[rank{rank}]: RuntimeError: CUDA error: unspecified launch failure"
RANK_ECC = "[rank{rank}]: RuntimeError: CUDA error: uncorrectable ECC error encountered"
DIST_BACKEND = ("[rank{rank}]: torch.distributed.DistBackendError: NCCL error in: "
                "../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, remote process exited or there "
                "was a network error, NCCL version 2.21.5")
PG_WATCHDOG = ("[rank{rank}]:[E1205 10:05:12.331000 4123 ProcessGroupNCCL.cpp:1595] [PG 0 "
               "(default_pg) Rank {rank}] Process group watchdog thread terminated with exception: "
               "NCCL error: remote process exited or there was a network error")
CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "
SIGTERM_WORKERS = ("[2026-12-05 10:05:20,331] torch.distributed.elastic.multiprocessing.api: "
                   "[WARNING] Sending process {pid} closing signal SIGTERM")
SIGNAL_15 = ("torch.distributed.elastic.multiprocessing.api.SignalException: Process {pid} got "
             "signal: 15")
SRUN_TASK_EXIT = "srun: error: {node}: task {task}: Exited with exit code {code}"
TIME_LIMIT = "slurmstepd: error: *** JOB {job} ON {node} CANCELLED AT 2026-12-05T10:09:00 DUE TO TIME LIMIT ***"


@scenario
def clock_skew_leaf_kernel_lines() -> Scenario:
    s = Scenario("clock-skew-leaf-down-kernel-lines", "A leaf switch dies; the NIC readings (read "
                 "centrally) see its four nodes' ports go DOWN within seconds, but the nodes' own "
                 "kernel lines are stamped by clocks up to two minutes off. The skewed lines are "
                 "the same event, not four link faults.", seed=90)
    leaf, members = s.leaf(0)
    s.noise()
    for k, (node, skew) in enumerate(zip(members, (0, 95, -130, 40), strict=True)):
        bus = f"{12 + k:02x}"
        s.nic_state(300 + k * 2.5, node, "DOWN")
        s.kernel(298 + k * 2 + skew, node, LINK_DOWN.format(bus=bus))
    return s.expects("switch_failure", members, switch=leaf)


@scenario
def dcgm_late_xid_rank_crashed_first() -> Scenario:
    s = Scenario("dcgm-late-xid-rank-crashed-first", "A GPU falls off the bus; only dcgm-exporter "
                 "reports it (no kernel agent), in a scrape 40 s after the rank on it already "
                 "crashed with a CUDA error and the other ranks lost it. The crash is the fault's, "
                 "not the job's own bug.", seed=91)
    j = s.job("51230", "olga", s.nodes[0:4])
    n = s.nodes[2]
    s.noise()
    for t in range(0, 600, 30):
        s.dcgm(t + 5, n, 3, "DCGM_FI_DEV_XID_ERRORS", 79 if t + 5 >= 360 else 0)
    s.log(320, j, n, RANK_CUDA_LAUNCH.format(rank=19))
    for i, node in enumerate(s.nodes[0:4]):
        if node != n:
            s.log(323 + i, j, node, DIST_BACKEND.format(rank=i * 8))
    s.log(330, j, s.nodes[0], CHILD_FAILED)
    s.job_dies(338, j, exit_code=1)
    return s.expects("gpu_hardware", [n])


@scenario
def slow_nic_scrapes_leaf_down() -> Scenario:
    s = Scenario("slow-nic-scrapes-leaf-down", "A leaf switch dies at 300 s; the NIC states are "
                 "scraped once a minute, each node at its own phase, so its four nodes' ports are "
                 "seen DOWN over 53 s. One event, the switch.", seed=92)
    leaf, members = s.leaf(1)
    s.noise()
    # Each node's exporter is scraped every 60 s at its own phase; the leaf's nodes' phases
    # put their first scrape after the switch died at these moments.
    seen_down = dict(zip(members, (305, 322, 341, 358), strict=True))
    for node in s.nodes:
        t = seen_down[node] % 60 if node in seen_down else s.rng.uniform(0, 60)
        while t < 600:
            down = node in seen_down and t >= seen_down[node]
            s.nic_state(t, node, "DOWN" if down else "ACTIVE")
            t += 60
    return s.expects("switch_failure", members, switch=leaf)


@scenario
def torchrun_peers_any_order() -> Scenario:
    s = Scenario("xid48-torchrun-peers-any-order", "A double-bit ECC error (XID 48) on one GPU; "
                 "the rank on it dies with a CUDA ECC error, torchrun tears the job down and the "
                 "other ranks print c10d errors, SIGTERM notices and ChildFailedError in no "
                 "particular order, one of them stamped before the XID (its clock is 10 s "
                 "behind). One GPU memory fault; no bug of the job.", seed=93)
    j = s.job("60412", "pavel", s.nodes[4:8])
    n = s.nodes[5]
    s.noise()
    s.kernel(300, n, _xid(48, "4e", "An uncorrectable double bit error (DBE) has been detected "
                                      "on GPU in the framebuffer at partition 0, subpartition 0.",
                          pid="2212", name="python"))
    s.log(300.4, j, n, RANK_ECC.format(rank=8))
    peers = [node for node in s.nodes[4:8] if node != n]
    lines = [(peers[0], DIST_BACKEND.format(rank=0)), (peers[1], PG_WATCHDOG.format(rank=16)),
             (peers[2], SIGNAL_15.format(pid=4100)), (peers[0], CHILD_FAILED),
             (peers[1], SIGTERM_WORKERS.format(pid=4123)),
             (peers[2], SRUN_TASK_EXIT.format(node=peers[2], task=3, code=143))]
    s.rng.shuffle(lines)
    for k, (node, line) in enumerate(lines):
        s.log(291 + k * 4, j, node, line)  # the first is 9 s before the XID: a clock behind
    s.job_dies(335, j, exit_code=1)
    return s.expects("gpu_memory", [n])


@scenario
def shared_node_overlapping_jobs() -> Scenario:
    s = Scenario("shared-node-xid31-follows-gpu-overlapping-jobs", "Three jobs share an 8-GPU "
                 "node (Slurm's GPU indices per job). XID 31 follows GPU 5 from job B to job C "
                 "(the GPU is at fault); job A on GPUs 0-3, running beside both, hits XID 13 on "
                 "GPU 1 with its own illegal memory access. Two faults: the node's GPU, and job "
                 "A's code.", seed=94)
    n = s.nodes[1]
    a = s.job("70001", "quinn", [n], started=None)
    b = s.job("70002", "rosa", [n], started=None)
    c = s.job("70003", "sam", [n], started=None)
    s.noise()
    s.slurm_job(5, a, "RUNNING", [n], gpus={n: [0, 1, 2, 3]})
    s.slurm_job(8, b, "RUNNING", [n], gpus={n: [4, 5, 6, 7]})
    for t in range(0, 600, 30):
        s.dcgm(t + 2, n, 5, "DCGM_FI_DEV_XID_ERRORS",
               31 if 200 <= t + 2 < 260 or t + 2 >= 450 else 0)
        s.dcgm(t + 2, n, 1, "DCGM_FI_DEV_XID_ERRORS", 13 if t + 2 >= 500 else 0)
    s.log(203, b, n, "[rank5]: RuntimeError: CUDA error: an illegal memory access was encountered")
    s.slurm_job(215, b, "FAILED", [n], exit_code=1)
    s.slurm_job(300, c, "RUNNING", [n], gpus={n: [4, 5, 6, 7]})
    s.log(453, c, n, "[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered")
    s.slurm_job(460, c, "FAILED", [n], exit_code=1)
    s.log(502, a, n, "[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered")
    s.slurm_job(510, a, "FAILED", [n], exit_code=1)
    return s.expects("gpu_hardware", [n]).expects("application_error", job=a)


@scenario
def stale_xid_gauge_job_completes() -> Scenario:
    s = Scenario("stale-xid-gauge-job-completes", "dcgm-exporter's XID gauge on one GPU still "
                 "reads 13 (the last XID since it started, from a job days ago) at every scrape; "
                 "the job on it trains and completes normally. Nothing new happened.", seed=95)
    n = s.nodes[6]
    j = s.job("80321", "tara", [n], started=None)
    s.noise()
    s.slurm_job(3, j, "RUNNING", [n])
    for t in range(0, 600, 30):
        s.dcgm(t + 1, n, 2, "DCGM_FI_DEV_XID_ERRORS", 13)
        s.log(t + 10, j, n, f"[rank2]: step {t // 30 + 1200} loss 1.{t % 97:02d}")
    s.slurm_job(590, j, "COMPLETED", [n], exit_code=0)
    return s


@scenario
def kubelet_notready_node_working() -> Scenario:
    s = Scenario("kubelet-notready-node-working", "The kubelet on one node stops posting status "
                 "for three minutes (Ready=Unknown, NodeStatusUnknown) and comes back, while "
                 "dcgm-exporter keeps scraping its GPUs, Slurm keeps it ALLOCATED and its job "
                 "keeps logging steps. Nothing is wrong with the node.", seed=96)
    n = s.nodes[3]
    j = s.job("80400", "uma", [n], started=None)
    s.noise()
    s.slurm_job(2, j, "RUNNING", [n])
    s.k8s_condition(200, n, "Unknown", "NodeStatusUnknown")
    s.k8s_event(201, n, "NodeNotReady", f"Node {n} status is now: NodeNotReady")
    for t in range(0, 600, 20):
        s.dcgm(t + 4, n, 0, "DCGM_FI_DEV_GPU_UTIL", 97)
        s.log(t + 7, j, n, f"[rank0]: step {t // 20 + 300} loss 0.8{t % 9}")
    s.slurm_node(260, n, ["ALLOCATED"])
    s.k8s_condition(380, n, "True", "KubeletReady")
    s.k8s_event(381, n, "NodeReady", f"Node {n} status is now: NodeReady")
    return s


@scenario
def scontrol_reboot_maintenance() -> Scenario:
    s = Scenario("scontrol-reboot-maintenance", "An administrator runs `scontrol reboot ASAP "
                 "nextstate=RESUME reason=kernel-upgrade`: the node drains (REBOOT_REQUESTED), "
                 "reboots (REBOOT_ISSUED): its links go down, Kubernetes loses it for two "
                 "minutes, and it comes back IDLE. Maintenance, not a fault.", seed=97)
    n = s.nodes[5]
    s.noise()
    s.slurm_node(100, n, ["IDLE", "DRAIN", "REBOOT_REQUESTED"], "kernel-upgrade")
    s.slurm_node(160, n, ["DOWN", "REBOOT_ISSUED"], "reboot issued")
    s.kernel(165, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link down")
    s.nic_state(170, n, "DOWN")
    s.k8s_condition(215, n, "Unknown", "NodeStatusUnknown")
    s.k8s_event(216, n, "NodeNotReady", f"Node {n} status is now: NodeNotReady")
    s.kernel(330, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link up")
    s.nic_state(335, n, "ACTIVE")
    s.k8s_event(338, n, "Rebooted", f"Node {n} has been rebooted, boot id: 3f1c2a9e-5b7d")
    s.k8s_condition(340, n, "True", "KubeletReady")
    s.slurm_node(350, n, ["IDLE"])
    return s


@scenario
def kured_cordon_reboot() -> Scenario:
    s = Scenario("kured-cordon-reboot-uncordon", "kured cordons a node (NodeNotSchedulable), "
                 "drains it, reboots it (NotReady for two minutes, its links down and up) and "
                 "uncordons it; Slinky's slurm-operator drains the Slurm node meanwhile. Ordinary "
                 "maintenance: no incident.", seed=98)
    n = s.nodes[0]
    s.noise()
    s.k8s_event(100, n, "NodeNotSchedulable", f"Node {n} status is now: NodeNotSchedulable")
    s.slurm_node(104, n, ["IDLE", "DRAIN"], "slurm-operator: Node cordoned")
    s.k8s_condition(190, n, "Unknown", "NodeStatusUnknown")
    s.k8s_event(191, n, "NodeNotReady", f"Node {n} status is now: NodeNotReady")
    s.nic_state(195, n, "DOWN")
    s.nic_state(320, n, "ACTIVE")
    s.k8s_event(325, n, "Rebooted", f"Node {n} has been rebooted, boot id: 9a0e7c11-44d2")
    s.k8s_condition(326, n, "True", "KubeletReady")
    s.k8s_event(400, n, "NodeSchedulable", f"Node {n} status is now: NodeSchedulable")
    s.slurm_node(405, n, ["IDLE"])
    return s


@scenario
def scancel_and_time_limit() -> Scenario:
    s = Scenario("scancel-and-time-limit", "One job is cancelled by its user (torchrun gets "
                 "SIGTERM, its tasks exit 143), another hits its time limit (slurmstepd's "
                 "message). Jobs ending the way jobs end: no incident.", seed=99)
    a = s.job("90001", "vic", s.nodes[0:2])
    b = s.job("90002", "wen", s.nodes[4:6])
    s.noise()
    s.log(200, a, s.nodes[0], SIGNAL_15.format(pid=5501))
    s.log(201, a, s.nodes[1], SRUN_TASK_EXIT.format(node=s.nodes[1], task=1, code=143))
    s.job_dies(205, a, "CANCELLED", exit_code={"status": ["SIGNALED"], "return_code": 0,
                                                 "signal": {"id": 15, "name": "TERM"}})
    s.log(400, b, s.nodes[4], TIME_LIMIT.format(job=b, node=s.nodes[4]))
    s.log(401, b, s.nodes[5], SRUN_TASK_EXIT.format(node=s.nodes[5], task=8, code=143))
    s.job_dies(402, b, "TIMEOUT")
    return s


@scenario
def root_port_fatal_then_app_xid() -> Scenario:
    s = Scenario("root-port-fatal-aer-then-xid43", "A fatal PCIe error (Data Link Protocol) on "
                 "the root port above a GPU, then XID 43 (GPU stopped processing) on that GPU "
                 "1.5 s later: the link failed under the GPU, the job's XID and death follow "
                 "from it. A GPU fault of the node, not the job's bug. Lines as Linux's aer.c "
                 "prints them.", seed=100)
    j = s.job("71020", "yan", s.nodes[4:8])
    n = s.nodes[6]
    s.noise()
    for line in ("pcieport 0000:16:01.0: AER: Uncorrected (Fatal) error received: 0000:16:01.0",
                 "pcieport 0000:16:01.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Data "
                 "Link Layer, (Receiver ID)",
                 "pcieport 0000:16:01.0:   device [1000:c030] error status/mask=00000010/00400000",
                 "pcieport 0000:16:01.0:    [ 4] DLP                    (First)"):
        s.kernel(330, n, line)
    s.kernel(331.5, n, _xid(43, "18", "Ch 00000008", pid="22871", name="python3"))
    s.log(331.7, j, n, "[rank16]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 16] Process group "
          "watchdog thread terminated with exception: CUDA error: unspecified launch failure")
    s.peers_time_out(333, j, n, style="remote")
    s.job_dies(350, j, exit_code=1)
    return s.expects("gpu_hardware", [n])


@scenario
def gres_zero_but_dcgm_reads_all() -> Scenario:
    s = Scenario("gres-zero-but-dcgm-reads-all", "A new node registers with 'gres/gpu count "
                 "reported lower than configured (0 < 8)' (slurmd built without NVML, no "
                 "gres.conf), while dcgm-exporter reads all 8 of its GPUs, idle and cool: "
                 "slurmd's configuration, not lost GPUs. No incident.", seed=101)
    n = s.nodes[4]
    s.noise()
    s.slurm_node(60, n, ["IDLE", "DRAIN", "INVALID_REG"],
                 "gres/gpu count reported lower than configured (0 < 8)")
    for t in range(5, 600, 30):
        for gpu in range(8):
            s.dcgm(t + gpu * 0.01, n, gpu, "DCGM_FI_DEV_GPU_UTIL", 0)
    return s


@scenario
def ib_flapping_condition_contradicted() -> Scenario:
    s = Scenario("npd-ib-flapping-contradicted-by-nic", "AKS's node problem detector keeps "
                 "IBLinkFlapping True on a node (flaps hours ago, its 6 h look-back), while "
                 "FleetWatch reads the node's port ACTIVE every 30 s with link_downed unchanged "
                 "and the job on it completes. The live readings outweigh the old verdict: no "
                 "incident.", seed=102)
    n = s.nodes[1]
    j = s.job("75060", "zoe", s.nodes[0:4])
    s.noise()
    for t in range(10, 600, 30):
        s.nic_state(t, n, "ACTIVE")
    s.add(60, "kubernetes", node=n, condition="IBLinkFlapping", status="True",
          reason="IBLinkFlapping", message="check_ib_link_flapping: IB link flapping detected, "
          "multiple IB link flapping events within 6 hours. FaultCode: NHC2005")
    s.job_dies(580, j, "COMPLETED", exit_code=0)
    return s


@scenario
def skewed_clock_scontrol_reboot() -> Scenario:
    s = Scenario("clock-behind-scontrol-reboot", "`scontrol reboot ASAP` on a node whose clock "
                 "is 3 minutes behind: its shutdown's 'Link down' kernel line is stamped before "
                 "slurmctld's REBOOT_REQUESTED, though the NIC readings (read centrally every "
                 "60 s) see the port go down after it. The reboot, not a link fault.", seed=103)
    n = s.nodes[3]
    s.noise()
    for t in range(15, 600, 60):
        s.nic_state(t, n, "DOWN" if 241 <= t < 330 else "ACTIVE")
    s.slurm_node(225, n, ["IDLE", "DRAIN", "REBOOT_REQUESTED"], "kernel 6.8 upgrade")
    s.slurm_node(226, n, ["DOWN", "REBOOT_ISSUED"], "kernel 6.8 upgrade")
    s.kernel(236 - 180, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link down")
    s.k8s_condition(268, n, "Unknown", "NodeStatusUnknown")
    s.kernel(325 - 180, n, "mlx5_core 0000:0c:00.0 ibp12s0: Link up")
    s.k8s_condition(330, n, "True", "KubeletReady")
    s.slurm_node(335, n, ["IDLE"])
    return s


# --- formats real fleets print (tests/fixtures/real_logs has each line's source) -------------

MIG_XID94 = ("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel "
             "(0x9). RST: No, D-RST: No")
SXID_FATAL = ("[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 "
              "LTSSM Fault Up")
SXID_DETAIL = ("[6781753.404848] nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Severity 1 "
               "Engine instance 60 Sub-engine instance 00")
SXID_NONFATAL = ("[111111111.111] nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, "
                 "Link 32 egress non-posted PRIV error (First)")
FALLEN_SPLIT = ("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n               NVRM: (PCI ID: "
                "10de:26b5) installed in this system has\n               NVRM: fallen off the bus "
                "and is not responding to commands.")
PROBE_FAILED = "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s)."
AER_CORRECTED = ("Sep 19 16:18:02 bubz kernel: [68183.615790] pcieport 0000:00:03.1: AER: "
                 "Correctable error message received from 0000:00:00.0")
AER_CORRECTED_DETAIL = ("Sep 19 16:18:02 bubz kernel: [68183.637897] pcieport 0000:00:03.1: PCIe "
                        "Bus Error: severity=Correctable, type=Data Link Layer, (Receiver ID)")
GPU_BURN_DMESG = (
    "[74785.660366] pcieport 0000:00:02.0: AER: Corrected error received: id=0010",
    "[74889.542031] pcieport 0000:00:02.0: AER: Uncorrected (Fatal) error received: id=0010",
    "[74889.542044] pcieport 0000:00:02.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
    "type=Transaction Layer, id=0010(Receiver ID)",
    "[74889.644138] NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.",
)


@scenario
def mig_xid94_one_gpu() -> Scenario:
    s = Scenario("mig-xid94-contained-one-gpu", "A contained ECC error (XID 94) in the MIG form "
                 "the driver prints, naming the GPU instance; the job's other rank times out. "
                 "The GPU's node is at fault, not the peer.", seed=69)
    j = s.job("93110", "erin", s.nodes[2:4])
    s.noise().kernel(140, s.nodes[2], MIG_XID94)
    s.peers_time_out(400, j, s.nodes[2])
    return s.expects("gpu_memory", [s.nodes[2]])


@scenario
def nvswitch_fatal_sxid() -> Scenario:
    s = Scenario("nvswitch-fatal-sxid", "A fatal NVSwitch error (SXid 20034, LTSSM Fault Up) "
                 "and its detail line on one node; a non-fatal SXid on another. Only the fatal "
                 "one is an NVLink fault.", seed=70, prefix="hgx-")
    s.noise().kernel(200, s.nodes[1], SXID_FATAL).kernel(200.2, s.nodes[1], SXID_DETAIL)
    s.kernel(260, s.nodes[6], SXID_NONFATAL)
    return s.expects("nvlink", [s.nodes[1]])


@scenario
def fallen_off_bus_without_xid() -> Scenario:
    s = Scenario("fallen-off-bus-without-xid", "The driver's three-line 'fallen off the bus' "
                 "message (no XID) and its probe failure on one node; corrected PCIe errors on "
                 "another node are noise.", seed=71)
    s.noise().kernel(90, s.nodes[5], FALLEN_SPLIT).kernel(90.1, s.nodes[5], PROBE_FAILED)
    for t in (30, 31, 200, 201, 420):
        s.kernel(t, s.nodes[0], AER_CORRECTED).kernel(t + 0.1, s.nodes[0], AER_CORRECTED_DETAIL)
    return s.expects("gpu_hardware", [s.nodes[5]])


@scenario
def root_port_fatal_aer_then_xid79() -> Scenario:
    s = Scenario("root-port-fatal-aer-then-xid79", "A corrected then a fatal PCIe error at the "
                 "root port above a GPU (Surprise Down), then XID 79 on the GPU: one GPU fault "
                 "on that node.", seed=72)
    j = s.job("40777", "fay", s.nodes[4:8])
    s.noise()
    for k, line in enumerate(GPU_BURN_DMESG):
        s.kernel(100 + (0 if k == 0 else 100 + k * 0.1), s.nodes[6], line)
    s.peers_time_out(800, j, s.nodes[6])
    return s.expects("gpu_hardware", [s.nodes[6]])


@scenario
def slurm_gres_gpu_count_drain() -> Scenario:
    s = Scenario("slurm-gres-gpu-count-drain", "slurmctld drains a node whose slurmd registers "
                 "fewer GPUs than configured ('gres/gpu count reported lower than configured'); "
                 "another node is drained for a failed task kill. Only the first lost GPUs.",
                 seed=73)
    s.noise()
    s.slurm_node(150, s.nodes[3], ["IDLE", "DRAIN", "INVALID_REG"],
                 "gres/gpu count reported lower than configured (0 < 8)")
    s.slurm_node(240, s.nodes[7], ["IDLE", "DRAIN"], "Kill task failed")
    return s.expects("gpu_hardware", [s.nodes[3]])

# --- other health tools' verdicts (NVSentinel, gpud, Node Problem Detector) ------------------
# Strings as the tools write them: NVSentinel's platform connector (condition type = check name,
# reason = check name + IsNotHealthy/IsHealthy, message "ErrorCode:.. PCI:.. GPU_UUID:.. ..
# Recommended Action=..;", "No Health Failures" once healthy), gpud's /v1/events (component,
# name, type, message), node-problem-detector's config/*.json and AKS's GPU conditions.
NVS_XID79 = ("ErrorCode:79 PCI:0000:{bus}:00 GPU_UUID:GPU-b5f21324-f1f9-f1a4-1a37-1166234f6e4f "
             "MESSAGE=NVRM: Xid (PCI:0000:{bus}:00): 79, pid=0, name=<unknown>, GPU has fallen "
             "off the bus. Recommended Action=RESTART_BM;")
GPUD_XID79 = ("XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS GPU has fallen off the bus "
              "detected on GPU PCI:0000:{bus}:00")


def _tool_condition(s: Scenario, t: float, node: str, condition: str, status: str, reason: str,
                    message: str) -> Scenario:
    return s.add(t, "kubernetes", node=node, condition=condition, status=status, reason=reason,
                 message=message)


@scenario
def nvsentinel_xid79_and_kernel_line() -> Scenario:
    s = Scenario("nvsentinel-xid79-and-kernel-line", "The kernel logs XID 79 and NVSentinel's "
                 "syslog monitor sets SysLogsXIDError on the same node for the same GPU; the "
                 "job's other ranks time out. One fault, one node, not two incidents.", seed=91)
    j = s.job("91001", "ana", s.nodes[:8])
    n = s.nodes[2]
    s.noise().kernel(120, n, XID79.format(bus="ef"))
    _tool_condition(s, 124, n, "SysLogsXIDError", "True", "SysLogsXIDErrorIsNotHealthy",
                    NVS_XID79.format(bus="ef"))
    s.peers_time_out(700, j, n).job_dies(720, j, "NODE_FAIL", state_reason="NodeDown")
    return s.expects("gpu_hardware", [n])


@scenario
def nvsentinel_xid119_once_with_kernel_line() -> Scenario:
    s = Scenario("nvsentinel-xid119-once-and-kernel-line", "One GSP RPC timeout (XID 119), which "
                 "counts only when it repeats: the kernel logs it and NVSentinel's condition "
                 "repeats it seconds later. One XID seen by two programs, not two: no incident.",
                 seed=97)
    s.job("91101", "ana", s.nodes[:4])
    n = s.nodes[1]
    line = ("NVRM: Xid (PCI:0002:00:00): 119, pid=1582259, name=nvc:[driver], Timeout after 6s "
            "of waiting for RPC response from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL) "
            "(0x20802a02 0x8).")
    s.noise().kernel(200, n, line)
    _tool_condition(s, 203, n, "SysLogsXIDError", "True", "SysLogsXIDErrorIsNotHealthy",
                    "ErrorCode:119 PCI:0002:00:00 GPU_UUID:GPU-b5f21324-f1f9-f1a4-1a37-"
                    f"1166234f6e4f kernel: [16450076.435595] {line} Recommended "
                    "Action=COMPONENT_RESET;")
    return s


@scenario
def nvsentinel_xid79_alone() -> Scenario:
    s = Scenario("nvsentinel-xid79-condition-alone", "Only NVSentinel reports the XID 79 (the "
                 "node agent is not installed): its condition names the code and the GPU, and "
                 "counts as that XID.", seed=92)
    n = s.nodes[5]
    s.noise()
    _tool_condition(s, 200, n, "SysLogsXIDError", "True", "SysLogsXIDErrorIsNotHealthy",
                    NVS_XID79.format(bus="9b"))
    # The condition rewritten with the same fault (NVSentinel re-lists what it holds).
    _tool_condition(s, 260, n, "SysLogsXIDError", "True", "SysLogsXIDErrorIsNotHealthy",
                    NVS_XID79.format(bus="9b"))
    return s.expects("gpu_hardware", [n])


@scenario
def nvsentinel_nvlink_no_code() -> Scenario:
    s = Scenario("nvsentinel-nvlink-watch-no-xid", "NVSentinel's DCGM NVLink watch sets "
                 "GpuNvlinkWatch True with a DCGM health code and no XID; nothing else sees a "
                 "fault. An NVLink diagnosis that waits for a person.", seed=93)
    n = s.nodes[1]
    s.noise()
    _tool_condition(s, 150, n, "GpuNvlinkWatch", "True", "GpuNvlinkWatchIsNotHealthy",
                    "ErrorCode:DCGM_FR_NVLINK_DOWN GPU:3 Recommended Action=RESTART_VM;")
    return s.expects("nvlink", [n])


@scenario
def aks_ib_link_flapping() -> Scenario:
    s = Scenario("aks-npd-ib-link-flapping", "AKS's node problem detector sets IBLinkFlapping "
                 "on one node; no NIC counter is collected there. A network flap of that node, "
                 "below automatic repair.", seed=94)
    n = s.nodes[6]
    s.noise()
    # Its NIC is not read by FleetWatch (no exporter there): the tool's word is all there is.
    # Where the ports are read and stay up, the verdict is not acted on (see the rules).
    s.signals = [sig for sig in s.signals
                 if not (sig[2]["source"] == "nic" and sig[2].get("node") == n)]
    _tool_condition(s, 240, n, "IBLinkFlapping", "True", "IBLinkFlapping", "")
    return s.expects("network_flap", [n])


@scenario
def tool_lookalikes_open_nothing() -> Scenario:
    s = Scenario("health-tool-lookalikes", "Verdicts that must open nothing: NPD's KernelDeadlock "
                 "(DockerHung), ReadonlyFilesystem and FrequentKubeletRestart (node problems, not "
                 "GPU faults); NVSentinel's SysLogsXIDError cleared ('No Health Failures'); a "
                 "non-fatal GpuThermalWatch event; a GpuMemWatch condition that NVSentinel clears "
                 "a minute later; gpud's XID component reporting an Info event; MemoryPressure "
                 "from the kubelet.", seed=95)
    a, b, c, d, e, f = s.nodes[:6]
    s.noise()
    _tool_condition(s, 100, a, "KernelDeadlock", "True", "DockerHung",
                    "task docker:7 blocked for more than 300 seconds.")
    _tool_condition(s, 130, b, "ReadonlyFilesystem", "True", "FilesystemIsReadOnly",
                    "Remounting filesystem read-only")
    _tool_condition(s, 160, c, "FrequentKubeletRestart", "True", "FrequentKubeletRestart",
                    "Found 5 matching logs, which meets the threshold of 5")
    _tool_condition(s, 190, d, "SysLogsXIDError", "False", "SysLogsXIDErrorIsHealthy",
                    "No Health Failures")
    s.k8s_event(220, d, "GpuThermalWatchIsNotHealthy",
                "ErrorCode:DCGM_FR_CLOCK_THROTTLE_THERMAL GPU:0 Recommended Action=NONE;")
    _tool_condition(s, 250, e, "GpuMemWatch", "True", "GpuMemWatchIsNotHealthy",
                    "ErrorCode:DCGM_FR_VOLATILE_DBE_DETECTED GPU:1 Recommended Action=RESTART_VM;")
    _tool_condition(s, 310, e, "GpuMemWatch", "False", "GpuMemWatchIsHealthy",
                    "No Health Failures")
    s.add(340, "gpud", node=f, component="accelerator-nvidia-error-xid", name="error_xid",
          type="Info", message="XID 13 ROBUST_CHANNEL_GR_EXCEPTION /\nROBUST_CHANNEL_GR_ERROR_SW_NOTIFY "
          "Graphics Engine Exception detected on GPU PCI:0000:1b:00")
    _tool_condition(s, 370, f, "MemoryPressure", "True", "KubeletHasInsufficientMemory",
                    "kubelet has insufficient memory available")
    return s


@scenario
def gpud_xid79_source_outage_elsewhere() -> Scenario:
    s = Scenario("gpud-xid79-and-gpud-down-elsewhere", "gpud on one node reports XID 79 through "
                 "the node agent; on another node the agent cannot reach gpud. The first node is "
                 "at fault; a gpud that is down is a source outage, never a failed node.", seed=96)
    n, other = s.nodes[4], s.nodes[0]
    s.noise()
    s.add(180, "gpud", node=n, component="accelerator-nvidia-error-xid", name="error_xid",
          type="Fatal", message=GPUD_XID79.format(bus="9b"))
    s.collector(200, "gpud", False, f"gpud on {other}: connection refused")
    return s.expects("gpu_hardware", [n])


# --- fail-slow: a node alive but slower than its job's peers (issue 21) -----------------------
# Every GPU of the job scraped (SM clock, power, utilisation, and what a case needs), with the
# jitter of a healthy job; the straggler's effect on its peers too (they wait for it at every
# collective, so their utilisation drops while its stays high), and rank 0's iteration time.

SM, POWER, UTIL = "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL"
REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
LINK_GEN, LINK_WIDTH = "DCGM_FI_DEV_PCIE_LINK_GEN", "DCGM_FI_DEV_PCIE_LINK_WIDTH"
MAX_GEN, MAX_WIDTH = "DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"
NVLINK_TOTAL, DRAM = "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_PROF_DRAM_ACTIVE"
MEGATRON = (" iteration {it:8d}/  500000 | consumed samples: {samples:12d} | elapsed time per "
            "iteration (ms): {ms:.1f} | learning rate: 1.500E-04 | global batch size:  1024 | "
            "lm loss: {loss:.6E} | loss scale: 1.0 |")
# What a straggler does to one GPU at time t: multipliers and overrides of its readings.
Effect = Callable[[str, int, float], dict[str, float]]


def _training(s: Scenario, nodes: list[str], *, gpus: int = 4, every: float = 60.0,
              start: float = 0.0, end: float | None = None, effect: Effect | None = None,
              fields: Iterable[str] = (SM, POWER, UTIL), wait: float = 0.0,
              slow_from: float = 0.0) -> None:
    """A job's GPUs as dcgm-exporter reports them. ``effect`` changes a GPU's readings
    (``clock``/``power``/``dram``/``nvlink`` multipliers, ``util`` points, ``reasons`` bits,
    ``gen``/``width`` link); ``wait``: utilisation points the other GPUs lose from
    ``slow_from`` on (they wait for the straggler)."""
    end = s.minutes * 60 if end is None else end
    wanted = set(fields)
    nvlink_total: dict[tuple[str, int], float] = {}
    for node in nodes:
        t = start + s.rng.uniform(0, every)
        while t < end:
            for g in range(gpus):
                fx = effect(node, g, t) if effect is not None else {}
                mine = bool(fx)
                clock = s.rng.choice((1935, 1950, 1965, 1980, 1980, 1980)) * fx.get("clock", 1.0)
                power = s.rng.uniform(655, 715) * fx.get("power", 1.0)
                util = s.rng.uniform(93, 99.5) + fx.get("util", 0.0)
                if not mine and t >= slow_from:
                    util -= wait
                values = {SM: round(clock / 15) * 15, POWER: round(power, 1),
                          UTIL: max(0, min(100, round(util))),
                          REASONS: int(fx.get("reasons", 0)),
                          LINK_GEN: int(fx.get("gen", 5)), LINK_WIDTH: int(fx.get("width", 16)),
                          MAX_GEN: 5, MAX_WIDTH: 16,
                          DRAM: round(s.rng.uniform(0.55, 0.62) * fx.get("dram", 1.0), 3)}
                rate = s.rng.uniform(0.95, 1.05) * 180e9 * fx.get("nvlink", 1.0)
                total = nvlink_total.get((node, g), s.rng.uniform(1e12, 9e12)) + rate * every
                nvlink_total[(node, g)] = total
                values[NVLINK_TOTAL] = round(total)
                for metric in (SM, POWER, UTIL, REASONS, LINK_GEN, LINK_WIDTH, MAX_GEN,
                               MAX_WIDTH, DRAM, NVLINK_TOTAL):
                    if metric in wanted:
                        s.dcgm(t, node, g, metric, values[metric])
            t += every


def _iterations(s: Scenario, job: str, node: str, *, ms: float = 1020.0, every: float = 40.0,
                slower: Callable[[float], float] = lambda t: 1.0, start: float = 5.0) -> None:
    """Rank 0's Megatron-LM iteration lines (the job's own pace, for the whole job)."""
    it = 40000 + s.rng.randrange(0, 5000)
    t = start
    while t < s.minutes * 60:
        it += 40
        s.log(t, job, node, MEGATRON.format(it=it, samples=it * 1024, ms=ms * slower(t)
                                            * s.rng.uniform(0.99, 1.01),
                                            loss=2.1 + s.rng.uniform(-0.05, 0.05)))
        t += every


def _gpu(node: str, gpu: int, since: float, **fx: float) -> Effect:
    def effect(n: str, g: int, t: float) -> dict[str, float]:
        return dict(fx) if n == node and (gpu < 0 or g == gpu) and t >= since else {}
    return effect


@scenario
def fail_slow_sm_clock_one_gpu() -> Scenario:
    s = Scenario("fail-slow-sm-clock-one-gpu", "One GPU of one node of an 8-node job runs its SM "
                 "clock 30% below its peers' from minute 2, with no clock-event reason (clocks "
                 "held by a setting or a failing GPU). The job's other ranks wait for it (their "
                 "utilisation drops) and rank 0's iteration time rises 25%. No XID, nothing "
                 "fails: fail_slow on that node alone.", seed=201)
    j = s.job("91001", "erin", s.nodes[:8])
    n = s.nodes[3]
    s.noise()
    _training(s, s.nodes[:8], effect=_gpu(n, 2, 120, clock=0.7, power=0.8, util=2),
              fields=(SM, POWER, UTIL, REASONS), wait=12, slow_from=120)
    _iterations(s, j, s.nodes[0], slower=lambda t: 1.25 if t >= 120 else 1.0)
    return s.expects("fail_slow", [n])


@scenario
def fail_slow_power_capped_node() -> Scenario:
    s = Scenario("fail-slow-power-capped-node", "Every GPU of one node held at a power cap (clock-"
                 "event reason sw power cap): power 40% and SM clock 22% below the other nodes' "
                 "from minute 3. The job runs at that node's pace.", seed=202)
    j = s.job("91002", "frank", s.nodes[:6])
    n = s.nodes[5]
    s.noise()
    _training(s, s.nodes[:6], effect=_gpu(n, -1, 180, clock=0.78, power=0.6, util=3,
                                          reasons=0x4),
              fields=(SM, POWER, UTIL, REASONS), wait=10, slow_from=180)
    _iterations(s, j, s.nodes[0], slower=lambda t: 1.2 if t >= 180 else 1.0)
    return s.expects("fail_slow", [n])


@scenario
def fail_slow_pcie_gen3() -> Scenario:
    s = Scenario("fail-slow-pcie-gen3", "One GPU's PCIe link trained at Gen3 x16 (max Gen5 x16) "
                 "and stays there while it works; its rank holds the job back: it is the busiest "
                 "GPU while the others wait, and rank 0's iteration time rises 18%. Clocks and "
                 "power look normal.", seed=203)
    j = s.job("91003", "gina", s.nodes[:8])
    n = s.nodes[6]
    s.noise()
    _training(s, s.nodes[:8], effect=_gpu(n, 1, 0, gen=3, util=4),
              fields=(SM, POWER, UTIL, LINK_GEN, LINK_WIDTH, MAX_GEN, MAX_WIDTH), wait=15)
    _iterations(s, j, s.nodes[0], slower=lambda t: 1.18 if t >= 60 else 1.0)
    return s.expects("fail_slow", [n])


@scenario
def fail_slow_pcie_x8_kernel_line() -> Scenario:
    s = Scenario("fail-slow-pcie-x8-kernel-line", "A node rejoins after maintenance; the kernel "
                 "says its GPU 0's link is 'limited by 32.0 GT/s PCIe x8 link (capable of ... x16)' "
                 "and DCGM reads width 8 on it while the others read 16. Its GPU works at full "
                 "utilisation while its peers wait; the job's throughput (torchtitan's tps) drops "
                 "15%.", seed=204)
    j = s.job("91004", "hank", s.nodes[:4])
    n = s.nodes[2]
    s.noise()
    s.kernel(30, n, "[   12.345678] nvidia 0000:1b:00.0: 252.048 Gb/s available PCIe bandwidth, "
             "limited by 32.0 GT/s PCIe x8 link at 0000:1a:01.0 (capable of 504.112 Gb/s with "
             "32.0 GT/s PCIe x16 link)")
    _training(s, s.nodes[:4], effect=_gpu(n, 0, 0, width=8, util=5),
              fields=(SM, POWER, UTIL, LINK_WIDTH), wait=16)
    t = 15.0
    step = 1200
    while t < s.minutes * 60:
        step += 10
        tps = 5213 * (0.85 if t >= 40 else 1.0) * s.rng.uniform(0.99, 1.01)
        s.log(t, j, s.nodes[0], f"[rank0]:[titan] step: {step:5d}  loss:  3.1{s.rng.randrange(10)}"
              f"  memory: 61.2GiB(77.3%)  tps: {tps:,.0f}  tflops: 402.1  mfu: 40.6%")
        t += 30
    return s.expects("fail_slow", [n])


@scenario
def fail_slow_nvlink_low() -> Scenario:
    s = Scenario("fail-slow-nvlink-low", "Two GPUs of one node move 45% less over NVLink than "
                 "every other GPU of the job (DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL, a counter: its "
                 "rate), from minute 2.", seed=205)
    j = s.job("91005", "ivy", s.nodes[:6])
    n = s.nodes[1]
    s.noise()

    def effect(node: str, g: int, t: float) -> dict[str, float]:
        return {"nvlink": 0.55, "util": 2} if node == n and g in (0, 1) and t >= 120 else {}
    _training(s, s.nodes[:6], effect=effect, fields=(SM, UTIL, NVLINK_TOTAL), wait=8,
              slow_from=120)
    _iterations(s, j, s.nodes[0], slower=lambda t: 1.15 if t >= 120 else 1.0)
    return s.expects("fail_slow", [n])


@scenario
def fail_slow_node_step_times() -> Scenario:
    s = Scenario("fail-slow-node-step-times", "A job that logs each node's own compute time per "
                 "step (a one-line log per node: 'step 120 took 1.18 s'): one node takes 15% "
                 "longer than the others for the whole window; no GPU figure is read.", seed=206)
    j = s.job("91006", "jack", s.nodes[:6])
    n = s.nodes[4]
    s.noise()
    for node in s.nodes[:6]:
        t, step = s.rng.uniform(0, 10), 300
        while t < s.minutes * 60:
            step += 20
            took = 1.02 * (1.15 if node == n else 1.0) * s.rng.uniform(0.98, 1.02)
            s.log(t, j, node, f"[rank{s.nodes.index(node) * 8}] step {step} took {took:.3f} s")
            t += 30
    return s.expects("fail_slow", [n])


@scenario
def fail_slow_one_node_job_gpu() -> Scenario:
    s = Scenario("fail-slow-one-node-job-gpu", "An 8-GPU job on one node: GPU 5 runs its SM "
                 "clock 25% below its seven node-mates (clock-event reason: hw slowdown, at a "
                 "normal 61 C: not heat).", seed=207, leaves=1, per_leaf=4)
    j = s.job("91007", "kate", [s.nodes[1]])
    n = s.nodes[1]
    s.noise()
    _training(s, [n], gpus=8, effect=_gpu(n, 5, 90, clock=0.75, power=0.85, reasons=0x8),
              fields=(SM, POWER, UTIL, REASONS), wait=10, slow_from=90)
    del j
    return s.expects("fail_slow", [n])


@scenario
def fail_slow_straggler_report() -> Scenario:
    s = Scenario("fail-slow-straggler-report", "The job prints nvidia-resiliency-ext's straggler "
                 "report every 2 minutes, one rank per line: the worst five ranks are all on "
                 "one node (scores 0.62-0.66). Its GPUs' SM clocks read 12% below the others'.",
                 seed=208)
    j = s.job("91008", "liam", s.nodes[:8])
    n = s.nodes[7]
    s.noise()
    _training(s, s.nodes[:8], effect=_gpu(n, -1, 60, clock=0.88, util=2),
              fields=(SM, UTIL), wait=6, slow_from=60)
    base = s.nodes.index(n) * 8
    for t in (150, 270, 390, 510):
        s.log(t, j, s.nodes[0], "GPU relative performance:")
        s.log(t, j, s.nodes[0], " Worst performing 5/64 ranks:")
        for k in range(5):
            s.log(t + 0.01 * k, j, s.nodes[0], f"  Rank={base + k} Node={n} "
                  f"Score={0.62 + 0.01 * k:.2f}")
        s.log(t + 0.1, j, s.nodes[0], " Best performing 5/64 ranks:")
        for k in range(5):
            s.log(t + 0.1 + 0.01 * k, j, s.nodes[0], f"  Rank={k} Node={s.nodes[0]} "
                  f"Score={0.99 - 0.01 * k:.2f}")
    return s.expects("fail_slow", [n])


@scenario
def whole_job_power_capped() -> Scenario:
    s = Scenario("healthy-whole-job-power-capped", "The data centre caps a rack's power: every "
                 "GPU of the job drops its SM clock 25% and its power 35% at once, and the job's "
                 "iteration time rises. Slow, but nobody is slower than the job's peers: no "
                 "straggler, no incident.", seed=209)
    j = s.job("91009", "mona", s.nodes[:8])
    s.noise()

    def effect(node: str, g: int, t: float) -> dict[str, float]:
        return {"clock": 0.75, "power": 0.65, "reasons": 0x4} if t >= 200 else {}
    _training(s, s.nodes[:8], effect=effect, fields=(SM, POWER, UTIL, REASONS))
    _iterations(s, j, s.nodes[0], slower=lambda t: 1.3 if t >= 200 else 1.0)
    return s


@scenario
def job_phases_eval_and_checkpoint() -> Scenario:
    s = Scenario("healthy-job-phases-eval-checkpoint", "A job evaluates every 4 minutes (every "
                 "GPU's utilisation falls to about 30% and clocks vary for a minute) and saves a "
                 "checkpoint (GPUs idle, clocks at idle for a minute), with ordinary jitter. "
                 "Phases every rank goes through together: no straggler.", seed=210)
    j = s.job("91010", "nina", s.nodes[:6])
    s.noise()

    def effect(node: str, g: int, t: float) -> dict[str, float]:
        phase = t % 240
        if 180 <= phase < 240:  # eval: less to compute, clocks wander
            return {"util": -65, "clock": s.rng.uniform(0.7, 1.0), "power": 0.5}
        if 150 <= phase < 180:  # checkpoint save: idle
            return {"util": -95, "clock": 0.18, "power": 0.12}
        return {}
    _training(s, s.nodes[:6], effect=effect, fields=(SM, POWER, UTIL))
    _iterations(s, j, s.nodes[0])
    s.log(160, j, s.nodes[0], " successfully saved checkpoint from iteration   41000 to /ckpt")
    return s


@scenario
def job_ending_ranks_finish_unevenly() -> Scenario:
    s = Scenario("healthy-job-ending-unevenly", "A job finishes: its nodes go idle one after the "
                 "other over two minutes (clocks and power at idle on the ones done) and Slurm "
                 "says COMPLETED. Idle is not slow.", seed=211)
    j = s.job("91011", "omar", s.nodes[:6])
    s.noise()
    ends = {n: 300 + 25 * i for i, n in enumerate(s.nodes[:6])}

    def effect(node: str, g: int, t: float) -> dict[str, float]:
        return {"util": -97, "clock": 0.17, "power": 0.11} if t >= ends[node] else {}
    _training(s, s.nodes[:6], effect=effect, fields=(SM, POWER, UTIL))
    s.job_dies(450, j, "COMPLETED", exit_code=0)
    return s


@scenario
def pcie_gen1_while_idle() -> Scenario:
    s = Scenario("healthy-pcie-gen1-idle", "GPUs lower their PCIe link to Gen1 when idle (power "
                 "saving): two nodes of a job read Gen1 between phases of work, at 0% "
                 "utilisation, and Gen5 while working. Not a narrow link.", seed=212)
    s.job("91012", "pia", s.nodes[:4])
    s.noise()
    idle = {s.nodes[0], s.nodes[3]}

    def effect(node: str, g: int, t: float) -> dict[str, float]:
        return {"util": -97, "gen": 1, "clock": 0.17} if node in idle and 200 <= t < 320 else {}
    _training(s, s.nodes[:4], effect=effect, fields=(SM, UTIL, LINK_GEN, MAX_GEN))
    return s


@scenario
def clock_blip_two_minutes() -> Scenario:
    s = Scenario("healthy-clock-blip", "One GPU dips 30% in SM clock for two minutes (a brief "
                 "power excursion) and recovers: not sustained, not a straggler.", seed=213)
    s.job("91013", "quinn", s.nodes[:8])
    s.noise()
    _training(s, s.nodes[:8], effect=lambda n, g, t: {"clock": 0.7}
              if n == s.nodes[2] and g == 0 and 200 <= t < 320 else {},
              fields=(SM, POWER, UTIL))
    return s


@scenario
def pipeline_stages_differ() -> Scenario:
    s = Scenario("healthy-pipeline-stages", "A pipeline-parallel job: each node holds one stage, "
                 "and stages do different work, so their power and memory traffic differ by up "
                 "to 12% all the time (the first and last stages most). Same clocks. Different "
                 "work, not slower.", seed=214)
    s.job("91014", "rosa", s.nodes[:8])
    s.noise()
    stage = {n: (0.88, 0.86) if i in (0, 7) else (1.0 + 0.02 * (i % 3), 1.0)
             for i, n in enumerate(s.nodes[:8])}

    def effect(node: str, g: int, t: float) -> dict[str, float]:
        power, dram = stage[node]
        return {"power": power, "dram": dram}
    _training(s, s.nodes[:8], effect=effect, fields=(SM, POWER, UTIL, DRAM))
    return s


@scenario
def slow_node_with_xid79() -> Scenario:
    s = Scenario("fail-slow-explained-by-xid", "One node's GPU reads 40% lower SM clock than its "
                 "peers for four minutes, then falls off the bus (XID 79). The XID is the fault; "
                 "the slowness before it is a symptom of the dying GPU, not a second incident.",
                 seed=215)
    j = s.job("91015", "sam", s.nodes[:6])
    n = s.nodes[4]
    s.noise()
    _training(s, s.nodes[:6], effect=_gpu(n, 3, 60, clock=0.6), fields=(SM, UTIL), end=360)
    s.kernel(360, n, XID79.format(bus="9d"))
    s.peers_time_out(400, j, n)
    return s.expects("gpu_hardware", [n])


@scenario
def thermal_not_fail_slow() -> Scenario:
    s = Scenario("thermal-slowdown-not-fail-slow", "One node's GPUs slow down for heat (hw "
                 "thermal slowdown at 91 C) and run 30% below their peers' clocks: heat is the "
                 "cause (thermal), not a second fail_slow incident.", seed=216)
    s.job("91016", "tara", s.nodes[:4])
    n = s.nodes[1]
    s.noise()
    _training(s, s.nodes[:4], effect=_gpu(n, -1, 60, clock=0.7, reasons=0x40 | 0x8),
              fields=(SM, UTIL, REASONS), every=15)
    for t in range(60, 600, 15):
        for g in range(4):
            s.dcgm(t + 0.3, n, g, "DCGM_FI_DEV_GPU_TEMP", 91 + s.rng.uniform(-1, 1))
    return s.expects("thermal", [n])


@scenario
def narrow_link_alone() -> Scenario:
    s = Scenario("fail-slow-narrow-link-alone", "One GPU's link reads x8 (max x16) all along "
                 "while it works, and nothing else differs: its utilisation, clocks and power "
                 "are its peers', the job's iteration time is steady (it hardly uses PCIe). A "
                 "link trained below its width is direct evidence: fail_slow, at a confidence "
                 "that waits for a person.", seed=217)
    j = s.job("91017", "uma", s.nodes[:4])
    s.noise()
    _training(s, s.nodes[:4], effect=_gpu(s.nodes[3], 2, 0, width=8),
              fields=(SM, POWER, UTIL, LINK_WIDTH, MAX_WIDTH))
    _iterations(s, j, s.nodes[0])
    return s.expects("fail_slow", [s.nodes[3]])


@scenario
def individual_scores_low_everywhere() -> Scenario:
    s = Scenario("healthy-individual-scores-low", "nvidia-resiliency-ext's 'GPU individual "
                 "performance' (each rank against its own best) falls to 0.6-0.7 on ranks of "
                 "every node as the whole job slows (a data-loading stall); its relative scores "
                 "stay near 1. Nobody is a straggler.", seed=218)
    j = s.job("91018", "vera", s.nodes[:4])
    s.noise()
    _training(s, s.nodes[:4], fields=(SM, UTIL))
    for t in (200, 400):
        s.log(t, j, s.nodes[0], "GPU individual performance:")
        s.log(t, j, s.nodes[0], " Worst performing 4/32 ranks:")
        for k, node in enumerate(s.nodes[:4]):
            s.log(t + 0.01 * k, j, s.nodes[0], f"  Rank={k * 8} Node={node} "
                  f"Score={0.6 + 0.03 * k:.2f}")
        s.log(t + 1, j, s.nodes[0], "GPU relative performance:")
        s.log(t + 1, j, s.nodes[0], " Worst performing 2/32 ranks:")
        for k, node in enumerate(s.nodes[:2]):
            s.log(t + 1.01 + 0.01 * k, j, s.nodes[0], f"  Rank={k * 8 + 3} Node={node} "
                  f"Score={0.96 + 0.01 * k:.2f}")
    return s


@scenario
def single_gpu_jobs_differ() -> Scenario:
    s = Scenario("healthy-single-gpu-jobs", "Eight one-GPU jobs on one node, each its own work: "
                 "clocks and power differ by up to 30% between them. Different jobs are not "
                 "peers.", seed=219, leaves=1, per_leaf=4)
    n = s.nodes[0]
    s.noise()
    for g in range(8):
        s.jobs.append({"id": f"9102{g}", "user": "wen", "nodes": [n], "gpus": {n: [g]}})
    _training(s, [n], gpus=8, effect=lambda node, g, t: {"clock": 1.0 - 0.04 * g,
                                                         "power": 1.0 - 0.04 * g},
              fields=(SM, POWER, UTIL))
    return s


def dump(doc: dict[str, Any]) -> str:
    """Readable and diff-friendly: the header indented, one signal per line."""
    head = {k: v for k, v in doc.items() if k != "signals"}
    text = json.dumps(head, indent=1)[:-2]
    signals = ",\n  ".join(json.dumps(sig) for sig in doc["signals"])
    return f'{text},\n "signals": [\n  {signals}\n ]\n}}\n'


def main(out: Path = HERE) -> list[Path]:
    written = []
    for build in SCENARIOS:
        s = build()
        path = out / f"{s.name}.json"
        path.write_text(dump(s.document()))
        written.append(path)
    return written


if __name__ == "__main__":
    files = main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
    print(f"wrote {len(files)} scenarios")
