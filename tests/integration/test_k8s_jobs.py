"""batch/v1 Jobs on the Kubernetes test server, checked with the real ``kubectl``: the job
controller, scheduler and kubelet stand-in (``run_pods=True``, tests/harness/k8s_workloads.py)
run a Job's pod as a local process, and kubectl sees what it would see on a cluster.

FleetWatch's acceptance checks run as a Job pinned to one node; these are the behaviours
they rely on: completion, failure, logs, a tainted or cordoned node holding the pod Pending,
the deadline, and deleting the Job.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"

pytestmark = pytest.mark.integration

SEED: dict[str, Any] = {"nodes": [
    {"name": "gpu-001", "labels": {"fleetwatch.io/pool": "gpu"}},
    {"name": "gpu-002", "labels": {"fleetwatch.io/pool": "gpu"}},
]}


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[Any]:
    """A test API server that runs Jobs' pods, and its kubeconfig."""
    module = importlib.import_module("tests.harness.k8s_server")
    server = module.K8sTestServer(SEED, bookmark_interval=0.3, run_pods=True,
                                  kubeconfig_path=tmp_path / "kubeconfig.yaml")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def kubectl(k8s: Any, *args: str, check: bool = True, stdin: str | None = None,
            ) -> subprocess.CompletedProcess[str]:
    cache = Path(k8s.kubeconfig_path).parent / "kube-cache"
    result = subprocess.run(
        [KUBECTL, "--kubeconfig", str(k8s.kubeconfig_path), "--cache-dir", str(cache), *args],
        capture_output=True, text=True, timeout=90, check=False, input=stdin,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cache)})
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result


def job_manifest(name: str, script: str, *, node: str | None = None, **spec: Any) -> str:
    """A Job as FleetWatch would write it: one container running ``sh -c script``, pinned to
    ``node`` through required node affinity on metadata.name."""
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": "check", "image": "busybox:1.36",
                        "command": ["sh", "-c", script]}]}
    if node is not None:
        pod_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    pod_spec.update(spec.pop("pod", {}))
    return json.dumps({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                       "spec": {**spec, "template": {"spec": pod_spec}}})


def create_from(k8s: Any, manifest: str, check: bool = True,
                ) -> subprocess.CompletedProcess[str]:
    """``kubectl create -f -`` with the manifest on stdin (kubectl's default validation:
    it finds the fieldValidation parameter in the server's OpenAPI v3 and leaves the
    checks to the server)."""
    return kubectl(k8s, "create", "-f", "-", stdin=manifest, check=check)


def job_pods(k8s: Any, job: str) -> list[dict[str, Any]]:
    out = kubectl(k8s, "get", "pods", "-l", f"job-name={job}", "-o", "json").stdout
    return list(json.loads(out)["items"])


def scheduled_condition(pod: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in pod["status"].get("conditions") or []
                 if c["type"] == "PodScheduled"), {})


def test_kubectl_create_job_completes_and_shows_its_logs(k8s: Any) -> None:
    kubectl(k8s, "create", "job", "hello", "--image=busybox", "--",
            "sh", "-c", "echo hello from $HOSTNAME; exit 0")
    kubectl(k8s, "wait", "--for=condition=complete", "job/hello", "--timeout=30s")
    logs = kubectl(k8s, "logs", "job/hello").stdout
    pod = job_pods(k8s, "hello")[0]
    assert logs == f"hello from {pod['metadata']['name']}\n"
    assert pod["metadata"]["name"].startswith("hello-")
    assert pod["spec"]["nodeName"] in ("gpu-001", "gpu-002")
    assert pod["status"]["phase"] == "Succeeded"
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Job", "hello", True)

    table = kubectl(k8s, "get", "jobs").stdout.splitlines()
    assert table[0].split() == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]
    assert table[1].split()[:3] == ["hello", "Complete", "1/1"]
    pods = kubectl(k8s, "get", "pods").stdout.splitlines()
    assert pods[1].split()[1:3] == ["0/1", "Completed"]
    job = json.loads(kubectl(k8s, "get", "job", "hello", "-o", "json").stdout)
    assert job["status"]["succeeded"] == 1 and job["status"]["completionTime"]
    assert [c["type"] for c in job["status"]["conditions"]] == ["SuccessCriteriaMet",
                                                                "Complete"]
    # tail and byte limits of the log subresource, through kubectl's flags.
    kubectl(k8s, "create", "job", "lines", "--image=busybox", "--",
            "sh", "-c", "for i in 1 2 3 4; do echo line $i; done")
    kubectl(k8s, "wait", "--for=condition=complete", "job/lines", "--timeout=30s")
    assert kubectl(k8s, "logs", "job/lines", "--tail=2").stdout == "line 3\nline 4\n"
    assert kubectl(k8s, "logs", "job/lines", "--limit-bytes=6").stdout == "line 1"
    wrong = kubectl(k8s, "logs", "job/lines", "-c", "nope", check=False)
    assert wrong.returncode != 0
    assert "container nope is not valid for pod lines-" in wrong.stderr


def test_a_failing_job_reaches_failed_with_the_backoff_reason(k8s: Any) -> None:
    create_from(k8s, job_manifest("broken", "echo checking; exit 3", backoffLimit=0))
    kubectl(k8s, "wait", "--for=condition=failed", "job/broken", "--timeout=30s")
    job = json.loads(kubectl(k8s, "get", "job", "broken", "-o", "json").stdout)
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert (failed["reason"], failed["message"]) == (
        "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    assert job["status"]["failed"] == 1 and "succeeded" not in job["status"]
    pods = job_pods(k8s, "broken")
    assert len(pods) == 1  # backoffLimit 0: no second try
    terminated = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert kubectl(k8s, "logs", "job/broken").stdout == "checking\n"
    assert kubectl(k8s, "get", "jobs").stdout.splitlines()[1].split()[:3] == [
        "broken", "Failed", "0/1"]
    assert "Error" in kubectl(k8s, "get", "pods").stdout


def test_a_job_is_refused_as_the_api_server_refuses_it(k8s: Any) -> None:
    manifest = json.loads(job_manifest("always", "true"))
    manifest["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    refused = create_from(k8s, json.dumps(manifest), check=False)
    assert refused.returncode != 0
    assert ('spec.template.spec.restartPolicy: Unsupported value: "Always": supported values: '
            '"OnFailure", "Never"') in refused.stderr


def test_a_job_pinned_to_a_tainted_node_waits_until_the_taint_goes(k8s: Any) -> None:
    kubectl(k8s, "taint", "nodes", "gpu-002", "fleetwatch.io/quarantine=bad:NoSchedule")
    create_from(k8s, job_manifest("accept", "echo ok", node="gpu-002"))
    pod = wait_for(lambda: next((p for p in job_pods(k8s, "accept")
                                 if scheduled_condition(p).get("reason") == "Unschedulable"),
                                None), 30, "the pod to be unschedulable")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    assert scheduled_condition(pod)["message"] == (
        "0/2 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
        "1 node(s) had untolerated taint {fleetwatch.io/quarantine: bad}. preemption: 0/2 "
        "nodes are available: 2 Preemption is not helpful for scheduling.")
    assert "Pending" in kubectl(k8s, "get", "pods").stdout.splitlines()[1].split()
    # Not running: no log yet (the API server has no node to ask).
    assert kubectl(k8s, "logs", pod["metadata"]["name"]).stdout == ""
    job = json.loads(kubectl(k8s, "get", "job", "accept", "-o", "json").stdout)
    assert job["status"]["active"] == 1 and not job["status"].get("conditions")

    # A job that tolerates the taint runs there meanwhile.
    create_from(k8s, job_manifest(
        "tolerant", "echo ok", node="gpu-002", pod={"tolerations": [
            {"key": "fleetwatch.io/quarantine", "operator": "Exists",
             "effect": "NoSchedule"}]}))
    kubectl(k8s, "wait", "--for=condition=complete", "job/tolerant", "--timeout=30s")
    assert job_pods(k8s, "tolerant")[0]["spec"]["nodeName"] == "gpu-002"

    kubectl(k8s, "taint", "nodes", "gpu-002", "fleetwatch.io/quarantine-")
    kubectl(k8s, "wait", "--for=condition=complete", "job/accept", "--timeout=30s")
    pods = job_pods(k8s, "accept")
    assert [p["spec"]["nodeName"] for p in pods] == ["gpu-002"]
    assert scheduled_condition(pods[0])["status"] == "True"
    assert kubectl(k8s, "logs", "job/accept").stdout == "ok\n"


def test_a_job_pinned_to_a_cordoned_node_runs_once_uncordoned(k8s: Any) -> None:
    kubectl(k8s, "cordon", "gpu-001")
    create_from(k8s, job_manifest("accept", "echo ok", node="gpu-001"))
    pod = wait_for(lambda: next((p for p in job_pods(k8s, "accept")
                                 if scheduled_condition(p).get("reason") == "Unschedulable"),
                                None), 30, "the pod to be unschedulable")
    assert "1 node(s) were unschedulable" in scheduled_condition(pod)["message"]
    assert pod["status"]["phase"] == "Pending"
    kubectl(k8s, "uncordon", "gpu-001")
    kubectl(k8s, "wait", "--for=condition=complete", "job/accept", "--timeout=30s")
    assert job_pods(k8s, "accept")[0]["spec"]["nodeName"] == "gpu-001"


def test_active_deadline_ends_the_job_and_its_pod(k8s: Any) -> None:
    create_from(k8s, job_manifest(
        "slow", "echo started; sleep 60", node="gpu-001", activeDeadlineSeconds=2))
    kubectl(k8s, "wait", "--for=condition=failed", "job/slow", "--timeout=30s")
    job = json.loads(kubectl(k8s, "get", "job", "slow", "-o", "json").stdout)
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert (failed["reason"], failed["message"]) == (
        "DeadlineExceeded", "Job was active longer than specified deadline")
    assert job_pods(k8s, "slow") == []  # the controller deleted the running pod
    wait_for(lambda: not k8s.workloads.running, 10, "the process to be killed")


def test_deleting_a_job_deletes_its_pods_and_stops_them(k8s: Any) -> None:
    kubectl(k8s, "create", "job", "sleeper", "--image=busybox", "--", "sleep", "60")
    wait_for(lambda: any(p["status"]["phase"] == "Running" for p in job_pods(k8s, "sleeper")),
             30, "the pod to run")
    assert kubectl(k8s, "get", "jobs").stdout.splitlines()[1].split()[:3] == [
        "sleeper", "Running", "0/1"]
    procs = list(k8s.workloads.running.values())
    assert len(procs) == 1 and procs[0].proc.poll() is None
    kubectl(k8s, "delete", "job", "sleeper")
    assert job_pods(k8s, "sleeper") == []
    assert "No resources found" in kubectl(k8s, "get", "pods").stderr
    wait_for(lambda: procs[0].proc.poll() is not None, 10, "the process to be killed")
