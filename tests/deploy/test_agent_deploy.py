"""The node agent as a platform team installs it: the Kubernetes manifests (rendered with
kubectl kustomize, checked against the Kubernetes schemas offline, and read for what a
reviewer would ask), the systemd unit (systemd-analyze verify), and the image (built with
deploy/agent/build-image.sh and run with podman under the DaemonSet's restrictions)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import render  # kubectl kustomize, parsed
from tests.harness.parallel import machine_lock

ROOT = Path(__file__).resolve().parent.parent.parent
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes" / "agent"
UNIT = ROOT / "deploy" / "agent" / "fleetwatch-agent.service"
BUILD = ROOT / "deploy" / "agent" / "build-image.sh"
PACKAGE = ROOT / "collectors" / "agent" / "pyproject.toml"
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests are checked against
IMAGE = "localhost/fleetwatch-agent"
# The image's agent reads the real /dev/kmsg, and a test writes to it: under xdist the kernel
# log's tests run on one worker, one at a time (another's lines would reach this agent).
pytestmark = pytest.mark.xdist_group("kmsg")


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(KUSTOMIZE_DIR)


@pytest.fixture(scope="module")
def daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    return ds


def pod_spec(ds: dict[str, Any]) -> dict[str, Any]:
    return ds["spec"]["template"]["spec"]


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (agent,) = pod_spec(ds)["containers"]
    return agent


def mount(ds: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The volumeMount at ``path`` and its volume."""
    (m,) = [m for m in container(ds)["volumeMounts"] if m["mountPath"] == path]
    (v,) = [v for v in pod_spec(ds)["volumes"] if v["name"] == m["name"]]
    return m, v


# --- Kubernetes -------------------------------------------------------------------------------


def test_kustomize_renders_the_agent_objects(objects: list[dict[str, Any]]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    assert kinds == [("ConfigMap", "fleetwatch-agent"), ("DaemonSet", "fleetwatch-agent"),
                     ("ServiceAccount", "fleetwatch-agent")]
    assert {o["metadata"]["namespace"] for o in objects} == {"fleetwatch"}
    # No RBAC: the agent never calls the Kubernetes API.
    assert not [o for o in objects if o["apiVersion"].startswith("rbac.")]


@pytest.mark.parametrize("with_journal", [False, True], ids=["base", "journal-component"])
def test_every_object_validates_against_the_kubernetes_schemas(with_journal: bool,
                                                               tmp_path: Path) -> None:
    import kubernetes_validate

    if with_journal:  # the opt-in component, as kustomization.yaml's comment turns it on
        overlay = tmp_path / "overlay"
        shutil.copytree(KUSTOMIZE_DIR, overlay)
        text = (overlay / "kustomization.yaml").read_text()
        text = text.replace("# components:\n#   - journal", "components:\n  - journal")
        assert "components:\n  - journal" in text
        (overlay / "kustomization.yaml").write_text(text)
        objects = render(overlay)
        ds = next(o for o in objects if o["kind"] == "DaemonSet")
        assert {"/var/log/journal", "/run/log/journal", "/etc/machine-id"} <= {
            m["mountPath"] for m in container(ds)["volumeMounts"] if m.get("readOnly")}
    else:
        objects = render(KUSTOMIZE_DIR)
    # Strict: a misspelt or misplaced field is an error, not silently ignored.
    for obj in [*objects, *yaml.safe_load_all((KUSTOMIZE_DIR / "secret.example.yaml").read_text())]:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_daemonset_takes_one_capability_and_no_privilege(daemonset: dict[str, Any]) -> None:
    spec, sc = pod_spec(daemonset), container(daemonset)["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for shared in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(shared), shared
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == "fleetwatch-agent"
    assert spec["priorityClassName"] == "system-node-critical"
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    resources = container(daemonset)["resources"]
    assert resources["limits"] == {"cpu": "200m", "memory": "128Mi"}


def test_kernel_log_and_sys_are_mounted_read_only(daemonset: dict[str, Any]) -> None:
    kmsg, kmsg_volume = mount(daemonset, "/dev/kmsg")
    assert kmsg["readOnly"] is True
    assert kmsg_volume["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    sys_mount, sys_volume = mount(daemonset, "/sys")
    assert sys_mount["readOnly"] is True
    assert sys_volume["hostPath"]["path"] == "/sys"
    # The only writable mount is the state directory, on the host so the spool survives.
    _, state_volume = mount(daemonset, "/var/lib/fleetwatch-agent")
    assert state_volume["hostPath"] == {"path": "/var/lib/fleetwatch-agent",
                                        "type": "DirectoryOrCreate"}
    writable = [m["mountPath"] for m in container(daemonset)["volumeMounts"] if not m.get("readOnly")]
    assert writable == ["/var/lib/fleetwatch-agent"]


def test_token_comes_from_the_secret_and_node_from_the_downward_api(
        daemonset: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    env = {e["name"]: e for e in container(daemonset)["env"]}
    assert env["FLEETWATCH_AGENT_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["FLEETWATCH_AGENT_TOKEN_FILE"]["value"] == "/etc/fleetwatch-agent/tokens/{node}"
    tokens, tokens_volume = mount(daemonset, "/etc/fleetwatch-agent/tokens")
    assert tokens["readOnly"] is True
    assert tokens_volume["secret"]["secretName"] == "fleetwatch-agent-tokens"
    assert tokens_volume["secret"]["defaultMode"] == 0o400
    # FLEETWATCH_URL from the ConfigMap the kustomization renders.
    (source,) = container(daemonset)["envFrom"]
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert source == {"configMapRef": {"name": config["metadata"]["name"]}}
    assert config["data"]["FLEETWATCH_URL"].startswith(("http://", "https://"))
    # NVML through the NVIDIA runtime, without taking a GPU from the jobs.
    assert pod_spec(daemonset)["runtimeClassName"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert "nvidia.com/gpu" not in json.dumps(container(daemonset)["resources"])


def tolerated(tolerations: list[dict[str, Any]], key: str, effect: str) -> bool:
    for t in tolerations:
        key_ok = (t.get("operator") == "Exists" and not t.get("key")) or t.get("key") == key
        if key_ok and t.get("effect") in (None, "", effect) and "tolerationSeconds" not in t:
            return True
    return False


def test_runs_on_gpu_nodes_even_cordoned_or_tainted(daemonset: dict[str, Any]) -> None:
    spec = pod_spec(daemonset)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in [
        e for term in terms["nodeSelectorTerms"] for e in term["matchExpressions"]]
    for key, effect in [("node.kubernetes.io/unschedulable", "NoSchedule"),  # cordoned
                        ("nvidia.com/gpu", "NoSchedule"),
                        ("fleetwatch.io/quarantine", "NoExecute"),
                        ("node.kubernetes.io/unreachable", "NoExecute")]:
        assert tolerated(spec["tolerations"], key, effect), (key, effect)


# --- systemd ----------------------------------------------------------------------------------


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    text = UNIT.read_text()
    for line in ("AmbientCapabilities=CAP_SYSLOG", "CapabilityBoundingSet=CAP_SYSLOG",
                 "DynamicUser=yes", "NoNewPrivileges=yes", "DevicePolicy=closed",
                 "DeviceAllow=/dev/kmsg r", "ProtectSystem=strict", "StateDirectory=fleetwatch-agent",
                 "EnvironmentFile=-/etc/fleetwatch-agent/env", "Restart=always"):
        assert f"\n{line}\n" in text, line
    # verify checks that ExecStart is executable: point it at a stand-in for the installed one.
    agent = tmp_path / "opt" / "fleetwatch-agent" / "bin" / "fleetwatch-agent"
    agent.parent.mkdir(parents=True)
    agent.write_text("#!/bin/sh\n")
    agent.chmod(0o755)
    assert "ExecStart=/opt/fleetwatch-agent/bin/fleetwatch-agent\n" in text
    rendered = tmp_path / "fleetwatch-agent.service"
    rendered.write_text(text.replace("/opt/fleetwatch-agent/bin/fleetwatch-agent", str(agent)))
    done = subprocess.run([analyze, "verify", str(rendered)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    ours = [line for line in done.stderr.splitlines() if rendered.name in line]
    assert not ours, ours


# --- the image --------------------------------------------------------------------------------


def podman_or_skip() -> None:
    if not PACKAGE.exists():
        pytest.skip(f"{PACKAGE.relative_to(ROOT)} is missing: the installable agent package has "
                    "not landed in this checkout, so there is no image to build")
    if os.geteuid() != 0:
        pytest.skip("building and running the image needs root (mmdebstrap, rootful podman)")
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        pytest.skip("podman is not installed and apt-get cannot install it here")


PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]


def limits() -> list[str]:
    import resource

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=16384:16384"]


@pytest.fixture(scope="module")
def image() -> str:
    podman_or_skip()
    started = time.monotonic()
    # One image build at a time on this machine (the server's shares the base image).
    with machine_lock("image-build"):
        done = subprocess.run([str(BUILD)], cwd=ROOT, capture_output=True, text=True,
                              timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(f"build-image.sh: {time.monotonic() - started:.1f} s; {done.stdout.splitlines()[-1]}")
    return f"{IMAGE}:latest"


def version_of_checkout() -> str:
    import re

    text = (ROOT / "collectors" / "agent" / "__init__.py").read_text()
    found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
    assert found, "collectors/agent/__init__.py has no __version__"
    return found.group(1)


@pytest.mark.image
@pytest.mark.timeout(1200)
def test_image_says_its_version(image: str) -> None:
    done = subprocess.run([*PODMAN, "run", "--rm", "--network", "none", *limits(), image,
                           "--version"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert version_of_checkout() in done.stdout
    inspect = subprocess.run([*PODMAN, "image", "inspect", image], capture_output=True, text=True,
                             timeout=60, check=True)
    (meta,) = json.loads(inspect.stdout)
    labels = meta["Config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == version_of_checkout()
    assert meta["Config"]["Entrypoint"][-1] == "/opt/venv/bin/fleetwatch-agent"
    # Nothing to build or install with at run time.
    for tool in ("/opt/venv/bin/pip", "/usr/bin/gcc"):
        probe = subprocess.run([*PODMAN, "run", "--rm", "--network", "none", *limits(),
                                "--entrypoint", "test", image, "-e", tool], timeout=60, check=False)
        assert probe.returncode == 1, f"{tool} is in the image"


KMSG_TEST_LINE = "fleetwatch-image-test: test0: Link is Down (written by tests/deploy, no real NIC)"


@pytest.mark.image
@pytest.mark.timeout(1200)
def test_image_runs_as_the_daemonset_runs_it(image: str, tmp_path: Path) -> None:
    """The DaemonSet's restrictions mirrored: read-only root, every capability dropped but
    SYSLOG, no new privileges, /dev/kmsg and /sys read-only, the token from a read-only mount,
    the state on a mounted directory; FleetWatch unreachable. The agent starts, reads
    /dev/kmsg, spools what it read and stops on SIGTERM."""
    state, tokens = tmp_path / "state", tmp_path / "tokens"
    state.mkdir()
    tokens.mkdir()
    (tokens / "gpu-test-1").write_text("not-a-real-token\n")
    (tokens / "gpu-test-1").chmod(0o400)
    name = f"fleetwatch-agent-test-{os.getpid()}"
    run = [*PODMAN, "run", "-d", "--name", name, *limits(),
           "--network", "none",  # FleetWatch unreachable, and no host network change
           "--read-only", "--read-only-tmpfs=false",  # no writable /tmp either, as in Kubernetes
           "--cap-drop", "ALL", "--cap-add", "SYSLOG", "--security-opt", "no-new-privileges",
           # --device, not -v: what a node that grants /dev/kmsg gives the container (the
           # device cgroup lets it open the device; a bind mount alone is refused: see
           # test_kmsg_needs_the_device_granted).
           "--device", "/dev/kmsg:/dev/kmsg:r",
           "-v", "/sys:/sys:ro",
           "-v", f"{state}:/var/lib/fleetwatch-agent",
           "-v", f"{tokens}:/etc/fleetwatch-agent/tokens:ro",
           "-e", "FLEETWATCH_URL=http://fleetwatch.invalid:8000",
           "-e", "FLEETWATCH_AGENT_NODE=gpu-test-1",
           "-e", "FLEETWATCH_AGENT_TOKEN_FILE=/etc/fleetwatch-agent/tokens/{node}",
           image, "--no-nvml", "--interval", "1"]
    started = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    assert started.returncode == 0, started.stderr
    try:
        logs = wait_for_log(name, "kernel log:", timeout=30)
        assert "reading /dev/kmsg" in logs, logs
        # A line the agent sends (a NIC link change, tagged as this test's), into the host's
        # kernel log: it must come out of /dev/kmsg into the spool, FleetWatch being away.
        Path("/dev/kmsg").write_text(f"<5>{KMSG_TEST_LINE}\n")
        spool = state / "spool.jsonl"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and KMSG_TEST_LINE not in read(spool):
            time.sleep(0.5)
        assert KMSG_TEST_LINE in read(spool), (read(spool), podman_logs(name))
        (record,) = [json.loads(line) for line in read(spool).splitlines()
                     if KMSG_TEST_LINE in line and line.startswith("{")]
        assert record.get("node") == "gpu-test-1", record
        assert running(name), podman_logs(name)
        logs = podman_logs(name)
        assert "Traceback" not in logs, logs
        assert "kernel log not read" not in logs, logs
        stopped = time.monotonic()
        subprocess.run([*PODMAN, "stop", "-t", "20", name], capture_output=True, timeout=60,
                       check=True)
        took = time.monotonic() - stopped
        code = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.ExitCode}}", name],
                              capture_output=True, text=True, timeout=60, check=True).stdout
        assert code.strip() == "0", podman_logs(name)
        assert took < 15, f"podman stop took {took:.1f} s: SIGTERM did not stop the agent"
        assert (state / "state.json").exists()
    finally:
        subprocess.run([*PODMAN, "rm", "-f", name], capture_output=True, timeout=60, check=False)


@pytest.mark.image
@pytest.mark.timeout(1200)
def test_kmsg_needs_the_device_granted(image: str) -> None:
    """What the DaemonSet's comment warns of: the device bind-mounted as a hostPath gives
    (without the device cgroup's permission) cannot be opened, even with CAP_SYSLOG; and the
    granted device cannot be opened without CAP_SYSLOG where kernel.dmesg_restrict=1."""
    probe = ("import os\ntry:\n    os.close(os.open('/dev/kmsg', os.O_RDONLY | os.O_NONBLOCK))\n"
             "    print('opened')\nexcept OSError as exc:\n    print(exc.errno)\n")
    base = [*PODMAN, "run", "--rm", "--network", "none", *limits(), "--read-only",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--entrypoint", "python3"]
    bind_only = subprocess.run([*base, "--cap-add", "SYSLOG", "-v", "/dev/kmsg:/dev/kmsg:ro",
                                image, "-c", probe], capture_output=True, text=True, timeout=60,
                               check=True).stdout.strip()
    granted = subprocess.run([*base, "--cap-add", "SYSLOG", "--device", "/dev/kmsg:/dev/kmsg:r",
                              image, "-c", probe], capture_output=True, text=True, timeout=60,
                             check=True).stdout.strip()
    assert granted == "opened"
    if bind_only == "opened":
        pytest.skip("this machine's container runtime enforces no device cgroup")
    assert bind_only == "1"  # EPERM
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1":
        no_syslog = subprocess.run([*base, "--device", "/dev/kmsg:/dev/kmsg:r", image, "-c", probe],
                                   capture_output=True, text=True, timeout=60, check=True)
        assert no_syslog.stdout.strip() == "1"


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def podman_logs(name: str) -> str:
    done = subprocess.run([*PODMAN, "logs", name], capture_output=True, text=True, timeout=60,
                          check=False)
    return done.stdout + done.stderr


def running(name: str) -> bool:
    done = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.Running}}", name],
                          capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.strip() == "true"


def wait_for_log(name: str, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = podman_logs(name)
        if text in logs:
            return logs
        if not running(name):
            raise AssertionError(f"the agent stopped: {logs}")
        time.sleep(0.5)
    raise AssertionError(f"no '{text}' in the agent's log after {timeout} s: {podman_logs(name)}")
