"""FleetWatch's own Kubernetes manifests (deploy/kubernetes: base, overlays/production,
overlays/dev, components/node-replace): every overlay rendered with kubectl kustomize, every
object checked against the Kubernetes 1.30 schemas offline (strict), the checkov policy linter
run on the rendered objects with every accepted finding explained in
deploy/kubernetes/checkov-skips.yaml, and what a reviewer would check by hand."""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("production", "dev")
QUEUES = ("collect", "diagnose", "remediate", "default")
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests are checked against
IMAGE = "localhost/fleetwatch:latest"
APP_UID = 10001
CHECKOV_REQUIREMENTS = Path(__file__).with_name("checkov-requirements.txt")
CHECKOV_SKIPS = KUBE / "checkov-skips.yaml"

Obj = dict[str, Any]


@cache
def _render_text(path: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def render(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(_render_text(path)) if doc]


def overlay(name: str) -> list[Obj]:
    return render(KUBE / "overlays" / name)


@pytest.fixture(params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[Obj]:
    return overlay(request.param)


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def pod(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def containers(workload: Obj) -> list[Obj]:
    spec = pod(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def fleetwatch_workloads(objects: list[Obj]) -> list[Obj]:
    """Web, workers, beat and the migration Job: the FleetWatch image's pods."""
    return [o for o in workloads(objects)
            if o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name")
            == "fleetwatch"]


def command(workload: Obj) -> list[str]:
    (only,) = pod(workload)["containers"]
    return [*only.get("command", []), *only.get("args", [])]


# --- rendering and schemas --------------------------------------------------------------------


BASE_OBJECTS = {
    ("Namespace", "fleetwatch"), ("ServiceAccount", "fleetwatch"),
    ("ClusterRole", "fleetwatch"), ("ClusterRoleBinding", "fleetwatch"),
    ("Role", "fleetwatch-gate"), ("RoleBinding", "fleetwatch-gate"),
    ("ConfigMap", "fleetwatch"), ("Deployment", "fleetwatch-web"), ("Service", "fleetwatch"),
    ("PodDisruptionBudget", "fleetwatch-web"), ("Deployment", "fleetwatch-beat"),
    ("Job", "fleetwatch-migrate"),
    *{("Deployment", f"fleetwatch-worker-{q}") for q in QUEUES},
    *{("PodDisruptionBudget", f"fleetwatch-worker-{q}") for q in QUEUES},
    *{("NetworkPolicy", n) for n in ("fleetwatch-default-deny", "fleetwatch-dns",
                                     "fleetwatch-web-ingress", "fleetwatch-datastores-egress",
                                     "fleetwatch-outside-egress", "fleetwatch-agent-egress")},
    # The node agent (deploy/kubernetes/agent, included whole).
    ("ServiceAccount", "fleetwatch-agent"), ("ConfigMap", "fleetwatch-agent"),
    ("DaemonSet", "fleetwatch-agent"),
}
DEV_OBJECTS = {
    ("Secret", "fleetwatch"), ("Secret", "fleetwatch-datastores"),
    ("Service", "postgresql"), ("StatefulSet", "postgresql"),
    ("NetworkPolicy", "postgresql-ingress"),
    ("Service", "redis"), ("StatefulSet", "redis"), ("NetworkPolicy", "redis-ingress"),
}


@pytest.mark.parametrize(("name", "expected"), [("production", BASE_OBJECTS),
                                                ("dev", BASE_OBJECTS | DEV_OBJECTS)])
def test_each_overlay_renders_its_objects(name: str, expected: set[tuple[str, str]]) -> None:
    objects = overlay(name)
    found = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(found) == len(set(found))
    assert set(found) == expected
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for o in objects:
        namespace = o["metadata"].get("namespace")
        assert namespace == (None if o["kind"] in cluster_scoped else "fleetwatch"), o["metadata"]
    # Production never ships a Secret: the placeholders would overwrite the real one.
    if name == "production":
        assert not [o for o in objects if o["kind"] == "Secret"]


def test_every_object_validates_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    docs = [*overlay("production"), *overlay("dev"),
            *yaml.safe_load_all((KUBE / "base" / "secret.example.yaml").read_text()),
            *yaml.safe_load_all((KUBE / "components" / "node-replace" / "rbac.yaml").read_text())]
    for obj in docs:
        # Strict: a misspelt or misplaced field is an error, not silently ignored.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_node_replace_component_adds_only_its_role(tmp_path: Path) -> None:
    def rel(path: Path) -> str:  # kustomize takes no absolute paths
        return os.path.relpath(path, tmp_path)

    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel(KUBE / 'overlays' / 'production')}]\n"
        f"components: [{rel(KUBE / 'components' / 'node-replace')}]\n")
    objects = render(tmp_path)
    added = {(o["kind"], o["metadata"]["name"]) for o in objects} - BASE_OBJECTS
    assert added == {("ClusterRole", "fleetwatch-node-replace"),
                     ("ClusterRoleBinding", "fleetwatch-node-replace")}
    role = find(objects, "ClusterRole", "fleetwatch-node-replace")
    assert rules(role) == {("", "nodes"): {"delete"}, ("", "events"): {"create"}}
    binding = find(objects, "ClusterRoleBinding", "fleetwatch-node-replace")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleetwatch",
                                    "namespace": "fleetwatch"}]


# --- what a reviewer checks -------------------------------------------------------------------


def test_one_worker_deployment_per_queue_consuming_exactly_it(objects: list[Obj]) -> None:
    from django.conf import settings

    celery_py = (ROOT / "fleetwatch" / "celery.py").read_text()
    declared = re.findall(r'Queue\("(\w+)"\)', celery_py)
    assert sorted(declared) == sorted(QUEUES)
    # Every queue a task is routed to has its worker.
    routed = {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()}
    assert routed <= set(QUEUES)
    workers = [o for o in objects if o["kind"] == "Deployment"
               and o["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    assert sorted(w["metadata"]["name"] for w in workers) == sorted(
        f"fleetwatch-worker-{q}" for q in QUEUES)
    for worker in workers:
        queue = worker["metadata"]["name"].removeprefix("fleetwatch-worker-")
        argv = command(worker)
        assert argv[:4] == ["celery", "-A", "fleetwatch", "worker"], argv
        assert argv.count("-Q") == 1 and "--queues" not in " ".join(argv)
        assert argv[argv.index("-Q") + 1] == queue, argv
        # Its own selector and PDB: each scales and is disrupted on its own.
        labels = worker["spec"]["selector"]["matchLabels"]
        assert labels["fleetwatch.io/queue"] == queue
        pdb = find(objects, "PodDisruptionBudget", worker["metadata"]["name"])
        assert pdb["spec"]["selector"]["matchLabels"] == labels
        assert pdb["spec"]["maxUnavailable"] == 1
        # The concurrency variable it passes is defined in its own env (Kubernetes expands
        # $(VAR) only from there).
        env = {e["name"] for e in pod(worker)["containers"][0]["env"]}
        assert "FLEETWATCH_WORKER_CONCURRENCY" in env and "POD_NAME" in env


def test_beat_runs_once_and_never_overlaps(objects: list[Obj]) -> None:
    beat = find(objects, "Deployment", "fleetwatch-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    argv = command(beat)
    assert argv[:4] == ["celery", "-A", "fleetwatch", "beat"], argv
    # Its schedule file and pid file on writable volumes, not the read-only /app.
    assert argv[argv.index("--schedule") + 1].startswith("/data/")
    assert argv[argv.index("--pidfile") + 1].startswith("/tmp/")
    beats = [w for w in workloads(objects) if "beat" in command(w)[:4]]
    assert beats == [beat]


def test_the_migration_job_runs_migrate(objects: list[Obj]) -> None:
    job = find(objects, "Job", "fleetwatch-migrate")
    assert command(job) == ["python", "manage.py", "migrate", "--noinput"]
    assert pod(job)["restartPolicy"] in ("OnFailure", "Never")
    assert job["spec"]["ttlSecondsAfterFinished"] > 0


def test_the_web_serves_8000_with_healthz_probes(objects: list[Obj]) -> None:
    web = find(objects, "Deployment", "fleetwatch-web")
    argv = command(web)
    assert argv == ["gunicorn", "-c", "deploy/gunicorn.conf.py", "fleetwatch.wsgi"]
    (container,) = pod(web)["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    config = find(objects, "ConfigMap", "fleetwatch")["data"]
    allowed = config["ALLOWED_HOSTS"].split(",")
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == ("/healthz", "http"), probe
        # Django answers 400 to a Host not in ALLOWED_HOSTS, and the kubelet's default Host
        # is the pod's IP: the probe names an allowed one.
        (host,) = [h["value"] for h in get["httpHeaders"] if h["name"] == "Host"]
        assert host in allowed, (probe, host)
    assert config["GUNICORN_BIND"] == "0.0.0.0:8000"
    service = find(objects, "Service", "fleetwatch")
    assert service["spec"]["selector"] == web["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                         "protocol": "TCP"}]
    # The node agents push to this Service.
    agent_config = find(objects, "ConfigMap", "fleetwatch-agent")["data"]
    assert agent_config["FLEETWATCH_URL"] == "http://fleetwatch.fleetwatch.svc.cluster.local:8000"
    assert "fleetwatch.fleetwatch.svc.cluster.local" in allowed
    pdb = find(objects, "PodDisruptionBudget", "fleetwatch-web")
    assert pdb["spec"]["selector"]["matchLabels"] == web["spec"]["selector"]["matchLabels"]


def test_one_image_for_every_fleetwatch_container(objects: list[Obj]) -> None:
    apps = fleetwatch_workloads(objects)
    assert len(apps) == 7  # web, four workers, beat, migrate
    for workload in apps:
        for c in containers(workload):
            assert c["image"] == IMAGE, workload["metadata"]["name"]
            assert c["workingDir"] == "/app"
            sources = c["envFrom"]
            assert {"configMapRef": {"name": "fleetwatch"}} in sources
            assert {"secretRef": {"name": "fleetwatch"}} in sources


def test_every_container_is_limited_and_locked_down(objects: list[Obj]) -> None:
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        spec = pod(workload)
        for c in containers(workload):
            where = f"{name}/{c['name']}"
            resources = c["resources"]
            for kind in ("requests", "limits"):
                assert set(resources[kind]) >= {"cpu", "memory"}, where
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["privileged"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert (sc.get("seccompProfile") or spec["securityContext"]["seccompProfile"]) == {
                "type": "RuntimeDefault"}, where
            if name == "fleetwatch-agent":
                # The one exception, explained in agent/daemonset.yaml: root with CAP_SYSLOG.
                assert sc["runAsUser"] == 0 and sc["capabilities"]["add"] == ["SYSLOG"]
                continue
            assert "add" not in sc["capabilities"], where
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == APP_UID, where
            assert spec["securityContext"]["runAsNonRoot"] is True, where
            assert spec["securityContext"]["runAsUser"] == APP_UID, where
        for shared in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(shared), (name, shared)


def test_writable_paths_are_empty_dirs(objects: list[Obj]) -> None:
    for workload in fleetwatch_workloads(objects):
        spec = pod(workload)
        volumes = {v["name"]: v for v in spec["volumes"]}
        (c,) = spec["containers"]
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert set(mounts) == {"/tmp", "/data"}, workload["metadata"]["name"]
        for volume in mounts.values():
            assert "sizeLimit" in volume["emptyDir"]
    config = find(objects, "ConfigMap", "fleetwatch")["data"]
    assert config["FLEETWATCH_DATA_DIR"] == "/data"
    web = find(objects, "Deployment", "fleetwatch-web")
    env = {e["name"]: e.get("value") for e in pod(web)["containers"][0]["env"]}
    assert env["PROMETHEUS_MULTIPROC_DIR"].startswith("/tmp/")


def rules(role: Obj) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames tricks
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_the_cluster_role_grants_what_the_client_calls_and_no_more(objects: list[Obj]) -> None:
    roles = sorted((o for o in objects if o["kind"] in ("ClusterRole", "Role")),
                   key=lambda r: (r["kind"], r["metadata"]["name"]))
    assert [(r["kind"], r["metadata"]["name"]) for r in roles] == [
        ("ClusterRole", "fleetwatch"), ("Role", "fleetwatch-gate")]
    role, gate_role = roles
    text = json.dumps([role["rules"], gate_role["rules"]])
    assert "*" not in text
    granted = rules(role)
    assert not {resource for _, resource in granted} & {"secrets", "configmaps"}
    assert granted == {
        ("", "nodes"): {"get", "list", "watch", "patch"},  # read, watch, cordon/uncordon
        ("", "pods"): {"get", "list"},                      # the pods on a node, Slinky's slurmd
        ("", "pods/eviction"): {"create"},                  # drain through the Eviction API
        ("", "events"): {"list", "watch"},
        ("events.k8s.io", "events"): {"list", "watch"},
    }
    # The gate's check Jobs: in FleetWatch's namespace only (a Role), never a pod written.
    assert gate_role["metadata"]["namespace"] == "fleetwatch"
    gate_granted = rules(gate_role)
    assert gate_granted == {("batch", "jobs"): {"create", "get", "delete"},
                            ("", "pods/log"): {"get"}}
    # Every call the client makes is covered (collectors/clients/kubernetes.py).
    client = (ROOT / "collectors" / "clients" / "kubernetes.py").read_text()
    calls = set(re.findall(r"self\.(?:core|events_v1|batch)\.(\w+)", client))
    needs = {"read_node": ("", "nodes", "get"), "list_node": ("", "nodes", "list"),
             "patch_node": ("", "nodes", "patch"), "read_namespaced_pod": ("", "pods", "get"),
             "list_pod_for_all_namespaces": ("", "pods", "list"),
             "list_namespaced_pod": ("", "pods", "list"),
             "create_namespaced_pod_eviction": ("", "pods/eviction", "create"),
             "list_event_for_all_namespaces": ("", "events", "list"),
             "create_namespaced_job": ("batch", "jobs", "create"),
             "read_namespaced_job": ("batch", "jobs", "get"),
             "delete_namespaced_job": ("batch", "jobs", "delete"),
             "read_namespaced_pod_log": ("", "pods/log", "get")}
    assert calls <= set(needs), calls - set(needs)
    for call in calls:
        group, resource, verb = needs[call]
        assert verb in (granted | gate_granted)[(group, resource)], call
    gate_binding = find(objects, "RoleBinding", "fleetwatch-gate")
    assert gate_binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                       "name": "fleetwatch-gate"}
    assert gate_binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleetwatch",
                                         "namespace": "fleetwatch"}]
    binding = find(objects, "ClusterRoleBinding", "fleetwatch")
    assert binding["roleRef"]["name"] == "fleetwatch"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleetwatch",
                                    "namespace": "fleetwatch"}]
    # The token is mounted only where the API is called.
    mounted = sorted(w["metadata"]["name"] for w in workloads(objects)
                     if pod(w).get("automountServiceAccountToken") is not False)
    assert mounted == ["fleetwatch-worker-collect", "fleetwatch-worker-remediate"]
    assert find(objects, "ServiceAccount", "fleetwatch")["automountServiceAccountToken"] is False


def test_network_policies_deny_by_default(objects: list[Obj]) -> None:
    deny = find(objects, "NetworkPolicy", "fleetwatch-default-deny")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    web_in = find(objects, "NetworkPolicy", "fleetwatch-web-ingress")
    assert web_in["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    stores = find(objects, "NetworkPolicy", "fleetwatch-datastores-egress")
    assert {p["port"] for p in stores["spec"]["egress"][0]["ports"]} == {5432, 6379}
    outside = find(objects, "NetworkPolicy", "fleetwatch-outside-egress")
    assert {p["port"] for p in outside["spec"]["egress"][0]["ports"]} >= {443, 6443, 6820, 9090}
    # No policy opens everything: each egress rule names its ports.
    for o in objects:
        if o["kind"] == "NetworkPolicy":
            for rule in o["spec"].get("egress", []) + o["spec"].get("ingress", []):
                assert rule.get("ports"), o["metadata"]["name"]


def readme_settings() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n### Running in production", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


# Not FleetWatch server settings, or set by the manifests another way.
NOT_IN_CONFIGMAP = {
    "FLEETWATCH_STOP_SECONDS", "FLEETWATCH_DEMO_USER", "FLEETWATCH_DEMO_PASSWORD",  # make run
    "FLEETWATCH_DEMO_ROTATE", "FLEETWATCH_READY_SECONDS",                          # make run
    "HOST", "PORT",                          # make run's bind; GUNICORN_BIND is set instead
    "FLEETWATCH_URL", "FLEETWATCH_AGENT_MAX_TRIES", "FLEETWATCH_AGENT_RETRY_BACKOFF",
    "FLEETWATCH_AGENT_TOKEN",                # the node agent's: agent/configmap.yaml, its Secret
    "FLEETWATCH_AGENT_GPUD_URL",
    "FLEETWATCH_STATIC_ROOT",                # set by the image (its ENV)
    "FLEETWATCH_MIGRATE",                    # the migration Job migrates, not the web pods
}


def test_every_readme_setting_is_in_the_configmap_or_the_secret() -> None:
    names = readme_settings()
    assert {"DATABASE_URL", "FLEETWATCH_HTTP_TIMEOUT", "GUNICORN_BIND"} <= names  # parsed
    config = set(find(overlay("production"), "ConfigMap", "fleetwatch")["data"])
    (example,) = yaml.safe_load_all((KUBE / "base" / "secret.example.yaml").read_text())
    secret = set(example["stringData"])
    assert not config & secret, config & secret
    missing = names - NOT_IN_CONFIGMAP - config - secret
    assert not missing, sorted(missing)
    assert {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL",
            "FLEETWATCH_NOTIFY_WEBHOOK_SECRET", "FLEETWATCH_SLURM_JWT",
            "FLEETWATCH_PROMETHEUS_TOKEN", "FLEETWATCH_METRICS_TOKEN"} <= secret
    # The dev overlay's Secret has the same keys as the example.
    dev_secret = find(overlay("dev"), "Secret", "fleetwatch")
    assert set(dev_secret["stringData"]) == secret


def test_the_settings_load_from_each_overlays_environment(objects: list[Obj]) -> None:
    """Every value in the ConfigMap parses: Django's settings load from exactly the environment
    the web container gets (ConfigMap, Secret, its own env), as FleetWatch starts."""
    web = find(objects, "Deployment", "fleetwatch-web")
    (container,) = pod(web)["containers"]
    config = find(objects, "ConfigMap", "fleetwatch")["data"]
    secrets = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "fleetwatch"]
    if secrets:
        secret = secrets[0]["stringData"]
    else:  # production: the example's shape, with the token its Slurm transport needs
        (example,) = yaml.safe_load_all((KUBE / "base" / "secret.example.yaml").read_text())
        secret = {**example["stringData"], "FLEETWATCH_SLURM_JWT": "test-token"}
    env = {"PATH": os.environ["PATH"], **config, **secret,
           **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
    probe = ("import django; django.setup(); from django.conf import settings as s; "
             "import json; print(json.dumps([s.FLEETWATCH_FLEET, s.ALLOWED_HOSTS, "
             "s.DATABASES['default']['ENGINE'], s.CELERY_BROKER_URL]))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**env, "DJANGO_SETTINGS_MODULE": "fleetwatch.settings"})
    assert done.returncode == 0, done.stderr[-3000:]
    fleet, allowed, engine, broker = json.loads(done.stdout.strip().splitlines()[-1])
    assert fleet == "real"
    assert "fleetwatch" in allowed
    assert "postgresql" in engine
    assert broker.startswith(("redis://", "rediss://"))


def replicas(objects: list[Obj]) -> dict[str, int]:
    return {o["metadata"]["name"]: o["spec"]["replicas"] for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")}


def test_production_scales_out_and_dev_runs_its_own_databases() -> None:
    production, dev = overlay("production"), overlay("dev")
    prod_replicas, dev_replicas = replicas(production), replicas(dev)
    for name in ("fleetwatch-web", *(f"fleetwatch-worker-{q}" for q in QUEUES)):
        assert prod_replicas[name] >= 2, name
        assert dev_replicas[name] == 1, name
    assert prod_replicas["fleetwatch-beat"] == dev_replicas["fleetwatch-beat"] == 1
    assert not [o for o in production if o["kind"] in ("StatefulSet", "PersistentVolumeClaim")]
    for name, image, port in (("postgresql", "postgres:15", 5432), ("redis", "redis:7", 6379)):
        sts = find(dev, "StatefulSet", name)
        (c,) = pod(sts)["containers"]
        assert c["image"] == image
        assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert find(dev, "Service", name)["spec"]["ports"][0]["port"] == port
    secret = find(dev, "Secret", "fleetwatch")["stringData"]
    assert secret["DATABASE_URL"].startswith("postgres://") and "@postgresql:5432/" in secret[
        "DATABASE_URL"]
    assert "@redis:6379/" in secret["REDIS_URL"]
    assert find(production, "ConfigMap", "fleetwatch")["data"]["FLEETWATCH_HTTPS"] == "true"


# --- checkov ----------------------------------------------------------------------------------


def checkov_venv() -> Path:
    """checkov in a venv of its own (its pins would move the project venv's; see
    checkov-requirements.txt), made once per content of that file and reused."""
    digest = hashlib.sha256(CHECKOV_REQUIREMENTS.read_bytes()).hexdigest()[:12]
    default = Path("/var/cache/fleetwatch")
    if not os.access(default if default.exists() else default.parent, os.W_OK):
        default = Path.home() / ".cache" / "fleetwatch"
    venv = Path(os.environ.get("FLEETWATCH_CHECKOV_VENV") or default / f"checkov-venv-{digest}")
    done = venv / ".installed"
    if done.exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time (pytest-xdist, two runs)
        if done.exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                              "--disable-pip-version-check", "-r", str(CHECKOV_REQUIREMENTS)],
                             capture_output=True, text=True, timeout=900, check=False)
        if pip.returncode != 0:
            pytest.fail(f"installing checkov into {venv} failed:\n{pip.stdout}\n{pip.stderr}")
        done.write_text(digest + "\n")
    return venv


def checkov_findings(directory: Path) -> list[tuple[str, str, str]]:
    checkov = checkov_venv() / "bin" / "checkov"
    # Offline: --skip-download (no guidelines or policies fetched from the vendor's service).
    done = subprocess.run([str(checkov), "--directory", str(directory), "--framework",
                           "kubernetes", "--output", "json", "--skip-download", "--compact",
                           "--quiet"],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "WARNING"})
    assert done.returncode in (0, 1), done.stderr  # 1: findings, read from the report below
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    findings = []
    for one in reports:
        assert one["summary"]["parsing_errors"] == 0, one["summary"]
        if "results" not in one:  # a quiet run with nothing failed
            continue
        for failed in one["results"]["failed_checks"]:
            findings.append((failed["check_id"], failed["resource"],
                             Path(failed["file_path"]).name))
    return findings


@pytest.mark.timeout(1200)  # the first run installs checkov (a few minutes); later ones: seconds
def test_checkov_finds_nothing_unexplained(tmp_path: Path) -> None:
    for name in OVERLAYS:
        _render_text(KUBE / "overlays" / name)  # skips without kubectl, before any install
        (tmp_path / f"{name}.yaml").write_text(_render_text(KUBE / "overlays" / name))
    skips = yaml.safe_load(CHECKOV_SKIPS.read_text())
    for skip in skips:
        assert set(skip) == {"check", "resources", "reason"}, skip
        assert len(skip["reason"].split()) >= 8, skip  # a reason, not a shrug
    findings = checkov_findings(tmp_path)
    assert findings, "checkov reported nothing at all: did it run?"
    used: set[int] = set()
    unexplained = []
    for check, resource, where in findings:
        matched = [i for i, s in enumerate(skips) if s["check"] == check
                   and any(fnmatch.fnmatchcase(resource, p) for p in s["resources"])]
        if matched:
            used.update(matched)
        else:
            unexplained.append(f"{check} {resource} ({where})")
    assert not unexplained, ("checkov findings with no reason in deploy/kubernetes/"
                             "checkov-skips.yaml:\n" + "\n".join(sorted(set(unexplained))))
    stale = [f"{s['check']} {s['resources']}" for i, s in enumerate(skips) if i not in used]
    assert not stale, f"skips that match no finding any more (remove them): {stale}"
