"""Several clusters in one FleetWatch (FLEETWATCH_CLUSTERS): each cluster's settings read and
checked; each collected, diagnosed and repaired through its own sources; the rails counted
per cluster; pushes, pages and the API naming the cluster. Two simulated clusters whose
nodes have the same names ("gpu-003" in both), so nothing can pass by matching names alone.
(tests/integration/test_several_clusters.py runs a real and a simulated cluster in one
worker.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.models import Node, Signal, SourceHealth
from collectors.sim import faults
from collectors.sim.fleet import SimFleet
from collectors.sources import PER_CLUSTER, clusters_load
from incidents import diagnosing
from incidents.models import Incident, Remediation
from tests.api.world import signal_body
from tests.conftest import token_for
from tests.unit.test_remediation import diag, drive, open_incident

SOURCES = ("slurm", "kubernetes", "telemetry")


def load(raw: Any, env: dict[str, str] | None = None, data_dir: Path = Path("/data")) -> Any:
    return clusters_load(raw if isinstance(raw, str) else json.dumps(raw), env or {},
                         data_dir=data_dir)


# --- the configuration ------------------------------------------------------------------------


def test_each_cluster_reads_its_own_settings_over_the_environments() -> None:
    env = {"FLEETWATCH_FLEET": "real", "FLEETWATCH_SLURM_TIMEOUT": "9",
           "FLEETWATCH_PROMETHEUS_URL": "http://thanos:9090"}
    got = load({"east": {"FLEETWATCH_SLURM_TRANSPORT": "rest",
                         "FLEETWATCH_SLURMRESTD_URL": "http://slurm-restapi.east:6820",
                         "FLEETWATCH_SLURM_JWT_FILE": "/etc/fleetwatch/east/jwt",
                         "FLEETWATCH_PROMETHEUS_MATCHERS": 'cluster="east"'},
                "west": {"FLEETWATCH_KUBECONFIG": "/etc/fleetwatch/west/kubeconfig",
                         "FLEETWATCH_SLURM_TIMEOUT": 30, "FLEETWATCH_STORE_GPU_SAMPLES": True},
                "lab": {"FLEETWATCH_FLEET": "sim"}}, env)
    assert list(got) == ["east", "west", "lab"]  # the file's order
    east, west, lab = got["east"], got["west"], got["lab"]
    assert (east.fleet, east.slurm_transport, east.slurmrestd_url) == (
        "real", "rest", "http://slurm-restapi.east:6820")
    assert east.prometheus_matchers == 'cluster="east"' and west.prometheus_matchers == ""
    # What an entry leaves out comes from the environment; numbers and booleans are read
    # as the environment's strings would be.
    assert east.slurm_timeout == 9.0 and west.slurm_timeout == 30.0
    assert west.store_gpu_samples is True and east.store_gpu_samples is False
    assert west.kubeconfig == "/etc/fleetwatch/west/kubeconfig" and east.kubeconfig is None
    assert west.prometheus_url == east.prometheus_url == "http://thanos:9090"
    # A simulated cluster among them: its own provider default and its own state file.
    assert (lab.fleet, lab.provider) == ("sim", "sim")
    assert lab.sim_state == Path("/data/sim-fleet-lab.json")


def test_two_simulated_clusters_never_share_a_state_file(tmp_path: Path) -> None:
    env = {"FLEETWATCH_SIM_STATE": "/srv/one-fleet.json"}
    got = load({"a": None, "b": {}}, env, data_dir=tmp_path)
    assert got["a"].sim_state != got["b"].sim_state
    assert got["a"].sim_state == tmp_path / "sim-fleet-a.json"
    # One cluster alone keeps the embedded default's file.
    assert load({"a": {}}, data_dir=tmp_path)["a"].sim_state == tmp_path / "sim-fleet.json"


def test_a_yaml_file_names_the_clusters(tmp_path: Path) -> None:
    path = tmp_path / "clusters.yaml"
    path.write_text("# two clusters\neast:\n  FLEETWATCH_FLEET: sim\nwest:\n"
                    "  FLEETWATCH_FLEET: sim\n  FLEETWATCH_SIM_SPEED: 5\n")
    got = load(str(path))
    assert list(got) == ["east", "west"] and got["west"].sim_speed == 5.0


@pytest.mark.parametrize(("raw", "says"), [
    ({"east": {"FLEETWATCH_SLURM_TRANSPORT": "rest"}},
     "cluster east: FLEETWATCH_SLURM_TRANSPORT=rest needs FLEETWATCH_SLURMRESTD_URL"),
    ({"east": {}, "west": {"FLEETWATCH_FLEET": "real"}},
     "cluster west: FLEETWATCH_FLEET=real collects telemetry from Prometheus"),
    ({"east": {"FLEETWATCH_SLURM_TIMEOUT": "soon"}},
     "cluster east: FLEETWATCH_SLURM_TIMEOUT='soon' is not a number"),
    ({"east": {"FLEETWATCH_POLICY_MODE": "auto"}},
     "cluster east: 'FLEETWATCH_POLICY_MODE' is not a per-cluster setting"),
    ({"east": {"FLEETWATCH_SOURCES": ["slurm"]}},
     "cluster east: FLEETWATCH_SOURCES must be a string, number or boolean"),
    ({"east west": {}}, "cluster name 'east west' must be 1-64 letters"),
    ({"east": "sim"}, "cluster east: expected a mapping of settings, got str"),
    (["east"], "expected a mapping of cluster names to their settings"),
    ("{not json", "not YAML or JSON"),
    ("/nowhere/clusters.yaml", "cannot read it"),
])
def test_a_mistake_names_the_cluster_and_the_setting(raw: Any, says: str) -> None:
    with pytest.raises(ImproperlyConfigured) as caught:
        load(raw)
    assert says in str(caught.value) and str(caught.value).startswith("FLEETWATCH_CLUSTERS")


def test_every_per_cluster_setting_is_documented() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Several clusters", 1)[1].split("\n## ", 1)[0]
    assert [name for name in PER_CLUSTER if name not in section] == []


def test_settings_refuse_a_default_cluster_that_is_not_listed(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "FLEETWATCH_DATA_DIR": str(tmp_path),
           "DJANGO_SETTINGS_MODULE": "fleetwatch.settings",
           "FLEETWATCH_CLUSTERS": '{"east": {}, "west": {}}', "FLEETWATCH_CLUSTER": "north"}
    run = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode != 0
    assert "FLEETWATCH_CLUSTER='north' is not one of FLEETWATCH_CLUSTERS' clusters (east, west)" \
        in run.stderr


# --- two simulated clusters in one FleetWatch -----------------------------------------------


@pytest.fixture
def two(settings: Any, tmp_path: Path, db: None) -> dict[str, Any]:
    """Clusters east and west, each a simulated fleet of its own with the same node names,
    collected once."""
    settings.FLEETWATCH_CLUSTERS = load(
        {name: {"FLEETWATCH_FLEET": "sim", "FLEETWATCH_SIM_SPEED": 400} for name in
         ("east", "west")}, data_dir=tmp_path)
    settings.FLEETWATCH_CLUSTER = "east"
    for name, config in settings.FLEETWATCH_CLUSTERS.items():
        SimFleet(config.sim_state, config.sim_speed).seed()
        for source in SOURCES:
            assert collectors.collect_source(source, name).healthy
    return {name: collectors.cluster_get(name) for name in ("east", "west")}


def fleet_of(name: str) -> Any:
    return faults.fleet_snapshot(name)


def test_each_cluster_is_collected_from_its_own_fleet(two: dict[str, Any]) -> None:
    for cluster in two.values():
        assert Node.objects.filter(cluster=cluster).count() == 16
        assert sorted(SourceHealth.objects.filter(cluster=cluster, healthy=True)
                      .values_list("name", flat=True)) == sorted(SOURCES)
    faults.fault_inject("xid", node="gpu-003", gpu=2, code=79, cluster="west")
    collectors.collect_source("telemetry", "west")
    collectors.collect_source("telemetry", "east")
    west = Node.objects.get(cluster=two["west"], name="gpu-003")
    east = Node.objects.get(cluster=two["east"], name="gpu-003")
    assert (west.health, east.health) == ("failed", "healthy")
    assert west.gpus.get(index=2).last_xid == 79 and east.gpus.get(index=2).last_xid == 0
    # Diagnosis of each cluster sees only its own signals.
    assert diagnosing.diagnosis_run(two["east"].pk) == []
    [incident] = diagnosing.diagnosis_run(two["west"].pk)
    assert (incident.cluster, list(incident.nodes)) == (two["west"], ["gpu-003"])


def test_a_repair_acts_on_its_own_cluster_only(two: dict[str, Any],
                                               django_capture_on_commit_callbacks: Any) -> None:
    incident = open_incident(two["west"], diag("gpu_hardware", ("gpu-003",)),
                             django_capture_on_commit_callbacks)
    rem = drive(incident.remediations.get(), django_capture_on_commit_callbacks)
    assert rem.status == "succeeded", [(s.kind, s.status, s.error) for s in rem.steps.all()]
    west, east = fleet_of("west")["nodes"], fleet_of("east")["nodes"]
    # West's gpu-003 was drained, cordoned and sent to RMA, and a spare of west's joined.
    reason = f"fleetwatch: incident {incident.pk} gpu_hardware"
    assert (west["gpu-003"]["drained"], west["gpu-003"]["unschedulable"],
            west["gpu-003"]["pool"], west["gpu-003"]["reason"]) == (True, True, "rma", reason)
    # East's gpu-003, same name, another cluster: untouched, and no spare of east's moved.
    assert (east["gpu-003"]["drained"], east["gpu-003"]["unschedulable"],
            east["gpu-003"]["pool"], east["gpu-003"]["reason"]) == (False, False, "gpu", "")
    assert sum(n["pool"] == "gpu" for n in west.values()) == sum(
        n["pool"] == "gpu" for n in east.values())
    assert all(not n["drained"] and not n["annotations"] for n in east.values())


def test_the_rails_count_per_cluster(two: dict[str, Any], settings: Any,
                                     django_capture_on_commit_callbacks: Any) -> None:
    settings.FLEETWATCH_STORM_INCIDENTS, settings.FLEETWATCH_BUDGET_MAX_PERCENT = 2, 100
    capture = django_capture_on_commit_callbacks

    def remediation(cluster: str, node: str, cause: str = "thermal") -> Remediation:
        return open_incident(two[cluster], diag(cause, (node,)), capture).remediations.get()

    east = [remediation("east", f"gpu-00{n}") for n in (1, 2, 3)]
    assert [r.status for r in east] == ["running", "running", "awaiting_approval"]
    assert east[2].hold_reason.startswith("storm brake: 3 incidents opened in the last 10 min "
                                          "in this cluster")
    # West: the same node names, busy in east, and a storm in east: none of it holds west.
    first = remediation("west", "gpu-001")
    assert (first.status, first.hold_reason) == ("running", "")
    # East's gpu-002, repaired a minute ago, is no cooldown for west's.
    Remediation.objects.filter(pk=east[1].pk).update(status="succeeded",
                                                     finished_at=east[1].created_at)
    second = remediation("west", "gpu-002")
    assert (second.status, second.hold_reason) == ("running", "")
    # The budget: two nodes in remediation in each cluster is within a limit of two.
    settings.FLEETWATCH_STORM_INCIDENTS, settings.FLEETWATCH_BUDGET_MAX_NODES = 100, 2
    third = remediation("west", "gpu-005")
    assert third.status == "awaiting_approval" and "fleet budget: 3 nodes" in third.hold_reason
    # And west's own storm count is its three incidents, not six.
    from incidents.remediation import policy

    assert policy.storm_count(two["west"].pk) == 3 and policy.storm_count(two["east"].pk) == 3


def test_pushes_name_their_cluster(two: dict[str, Any], operator: Any) -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator)}")
    body = signal_body("gpu-003")
    assert api.post("/api/v1/signals/", {**body, "cluster": "west"}, format="json"
                    ).status_code == 201
    assert api.post("/api/v1/signals/", body, format="json").status_code == 201  # default: east
    pushed = Signal.objects.filter(source="kernel", node_name="gpu-003")
    assert sorted(pushed.values_list("cluster__name", flat=True)) == ["east", "west"]
    assert {s.node.cluster.name for s in pushed if s.node} == {"east", "west"}
    unknown = api.post("/api/v1/signals/", {**body, "cluster": "north"}, format="json")
    assert unknown.status_code == 400
    assert unknown.json() == {"cluster": ["unknown cluster 'north'; this FleetWatch watches "
                                          "east, west"]}
    assert pushed.count() == 2  # nothing stored for it
    from incidents.models import AuditEntry

    # Accepted pushes are intake (in the access log, and stored as signals), not audited
    # actions; the refused one is audited.
    calls = AuditEntry.objects.filter(verb="api.call", target="POST /api/v1/signals/")
    assert list(calls.values_list("result", flat=True)) == ["400"]


def test_pages_and_api_filter_by_cluster(two: dict[str, Any], operator: Any,
                                         django_capture_on_commit_callbacks: Any) -> None:
    faults.fault_inject("xid", node="gpu-003", gpu=2, code=79, cluster="west")
    collectors.collect_source("telemetry", "west")
    diagnosing.diagnosis_run(two["west"].pk)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token_for(operator)}")
    west = api.get("/api/v1/incidents/?cluster=west").json()
    assert west["count"] == 1 and west["results"][0]["nodes"] == ["gpu-003"]
    assert api.get("/api/v1/incidents/?cluster=east").json()["count"] == 0
    nodes = api.get("/api/v1/nodes/?cluster=west&name=gpu-003").json()["results"]
    assert [n["health"] for n in nodes] == ["failed"]
    assert api.get("/api/v1/nodes/?cluster=east&health=failed").json()["count"] == 0

    client = Client()
    client.force_login(operator)
    page = client.get("/?cluster=west").content.decode()
    assert 'data-testid="cluster-chooser"' in page and 'data-testid="cluster-east"' in page
    url = f"/incidents/{Incident.objects.get().pk}/"
    assert url in page and url not in client.get("/?cluster=east").content.decode()
    # The same node name, two pages: each cluster's own node.
    health = 'data-testid="node-health">'
    assert health + "failed" in client.get("/nodes/gpu-003/?cluster=west").content.decode()
    assert health + "healthy" in client.get("/nodes/gpu-003/?cluster=east").content.decode()
    row = 'data-testid="node-row-gpu-003"'
    assert row in client.get("/nodes/?cluster=west&health=failed").content.decode()
    assert row not in client.get("/nodes/?cluster=east&health=failed").content.decode()
    incident_page = client.get(url).content.decode()
    assert 'href="/nodes/gpu-003/?cluster=west"' in incident_page


def test_the_beat_collects_every_cluster(two: dict[str, Any]) -> None:
    from fleetwatch.celery import _beat_schedule, app

    before = dict(app.conf.beat_schedule or {})
    try:
        _beat_schedule(app)
        collect = {name: entry["args"] for name, entry in app.conf.beat_schedule.items()
                   if name.startswith("collect-")}
    finally:
        app.conf.beat_schedule = before
    assert collect == {f"collect-{c}-{s}": [s, c] for c in ("east", "west") for s in SOURCES}


def test_the_node_agent_names_its_cluster(two: dict[str, Any], transactional_db: None,
                                          live_server: Any, operator: Any) -> None:
    from collectors.agent.cli import parser
    from collectors.agent.push import Pusher

    assert parser().parse_args(["--cluster", "west"]).cluster == "west"
    record = signal_body("gpu-003")["signals"][0]
    Pusher(live_server.url, token_for(operator), cluster="west").push([record])
    Pusher(live_server.url, token_for(operator)).push([record])
    pushed = Signal.objects.filter(source="kernel", node_name="gpu-003")
    assert sorted(pushed.values_list("node__cluster__name", flat=True)) == ["east", "west"]
