"""What a pushed signal may say, and pushed data that must never break anything.

- Who may push what: an agent's token, its own node's hardware and kernel; another monitor's
  ingest token, that and job logs for known nodes; nobody, a source's health (``collector``)
  or Slurm/Kubernetes state. Refusals are 403s naming the record, and audited. The issue's
  example: two pushed ``collector`` records no longer hide another node's failure.
- An Idempotency-Key makes a retried push store once, also when both copies arrive at once.
- The documented largest batch fits the request size limit; a bigger body is a JSON 413.
- What is already stored (NUL, lone surrogates, NaN, infinities) breaks no reader.

The readers' tests run on PostgreSQL and again on SQLite (which keeps more of such values:
see test_the_same_on_sqlite)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.conf import settings as django_settings
from django.db import connection
from django.test import Client
from django.utils import timezone

from collectors import services as collectors
from collectors.models import Gpu, Node, PushReceipt, Signal
from collectors.normalize import SignalDraft
from collectors.roles import OPERATOR, user_with_role
from incidents import diagnosing
from incidents.models import AuditEntry, Incident
from incidents.tokens import agent_token_create
from tests.conftest import rerun_on_sqlite, token_for

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.django_db
NODES = ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2231, name=python, GPU has fallen off the bus."


@pytest.fixture
def fleet(db: None) -> None:
    cluster = collectors.cluster_default()
    for name in NODES:
        Node.objects.create(cluster=cluster, name=name, leaf_switch="leaf-a", slurm_state="IDLE",
                            k8s_ready=True, k8s_ready_status="True")


def _at(seconds_ago: float = 0) -> str:
    return (timezone.now() - timedelta(seconds=seconds_ago)).isoformat()


def _push(client: Client, token: str, signals: Any, **headers: str) -> Any:
    extra = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()}
    return client.post("/api/v1/signals/", json.dumps({"signals": signals}),
                       content_type="application/json", HTTP_AUTHORIZATION=f"Token {token}",
                       **extra)


# --- who may push what ------------------------------------------------------------------------


def test_an_agent_token_cannot_push_source_health_and_the_refusal_is_audited(
        fleet: None, client: Client) -> None:
    # The example: the agent of gpu-001 says Slurm and Kubernetes are down.
    token = agent_token_create("gpu-001")[1]
    claims = [{"at": _at(), "source": "collector", "node": "gpu-001", "name": name,
               "healthy": False} for name in ("slurm", "kubernetes")]
    response = _push(client, token, claims)
    assert response.status_code == 403
    detail = response.json()["detail"]
    assert "signals[0].source" in detail and "signals[1].source" in detail
    assert "'collector'" in detail and "nothing stored" in detail
    assert not Signal.objects.exists()
    refused = AuditEntry.objects.get(verb="signals.refused")
    assert refused.actor == "token:agent-gpu-001" and not refused.ok
    assert "signals[0].source" in refused.result
    assert refused.data["status"] == 403 and len(refused.data["records"]) == 2
    # The middleware's entry for the call itself is there too.
    assert AuditEntry.objects.filter(verb="api.call", actor="token:agent-gpu-001",
                                     result="403").exists()


@pytest.mark.parametrize(("record", "field"), [
    ({"source": "slurm", "node": "gpu-001", "node_state": ["IDLE"]}, "signals[0].source"),
    ({"source": "kubernetes", "node": "gpu-001", "condition": "Ready", "status": "True"},
     "signals[0].source"),
    ({"source": "job_log", "node": "gpu-001", "job": "7", "message": "step 1"},
     "signals[0].source"),
    ({"source": "kernel", "node": "gpu-002", "message": XID79}, "signals[0].node"),
    ({"source": "kernel", "message": XID79}, "signals[0].node"),
])
def test_an_agent_token_pushes_its_own_nodes_hardware_and_kernel_only(
        fleet: None, client: Client, record: dict[str, Any], field: str) -> None:
    token = agent_token_create("gpu-001")[1]
    response = _push(client, token, [{"at": _at(), **record}])
    assert response.status_code == 403 and field in response.json()["detail"]
    assert not Signal.objects.exists()
    own = [{"at": _at(), "source": "kernel", "node": "gpu-001", "message": XID79},
           {"at": _at(), "source": "dcgm", "node": "gpu-001", "gpu": 3, "via": "nvml",
            "metric": "DCGM_FI_DEV_XID_ERRORS", "value": 79},
           {"at": _at(), "source": "nic", "node": "gpu-001", "device": "mlx5_0", "port": 1,
            "state": "DOWN"}]
    response = _push(client, token, own)
    assert response.status_code == 201 and response.json() == {"stored": 3}


def test_an_ingest_token_pushes_evidence_for_known_nodes_but_never_source_health(
        fleet: None, client: Client, operator: Any) -> None:
    token = token_for(operator, ("ingest",), name="nvsentinel")
    evidence = [{"at": _at(), "source": "kernel", "node": "gpu-002", "message": XID79},
                {"at": _at(), "source": "dcgm", "node": "gpu-003", "gpu": 1,
                 "metric": "DCGM_FI_DEV_XID_ERRORS", "value": 48},
                {"at": _at(), "source": "nic", "node": "gpu-004", "device": "mlx5_0", "port": 1,
                 "counter": "link_downed", "value": 3},
                {"at": _at(), "source": "job_log", "node": "gpu-002", "job": "17",
                 "message": "step 100 loss 2.1"}]
    response = _push(client, token, evidence)
    assert response.status_code == 201 and response.json() == {"stored": 4}
    for source in ("collector", "slurm", "kubernetes"):
        response = _push(client, token, [*evidence, {"at": _at(), "source": source,
                                                     "node": "gpu-002", "name": "slurm",
                                                     "healthy": False}])
        assert response.status_code == 403, source
        assert f"signals[4].source: an ingest token may not push '{source}'" in \
            response.json()["detail"]
    assert Signal.objects.count() == 4
    assert AuditEntry.objects.filter(verb="signals.refused", actor="token:nvsentinel").count() == 3


def test_the_ingest_service_refuses_collector_records_whoever_calls_it(fleet: None) -> None:
    record = {"at": timezone.now(), "source": "collector", "node": "gpu-001", "name": "slurm",
              "healthy": False}
    with pytest.raises(collectors.IngestRejected) as refused:
        collectors.signals_ingest(collectors.cluster_default(), [record])
    assert refused.value.status == 403 and "signals[0].source" in str(refused.value)
    assert not Signal.objects.exists()


def _unreachable(node: str) -> list[SignalDraft]:
    """What the collectors store when a node stops answering."""
    return [SignalDraft("slurm", "slurm_node_state", node=node, value="DOWN+NOT_RESPONDING",
                        message=f"{node} is DOWN+NOT_RESPONDING (Not responding)",
                        data={"node_state": ["DOWN", "NOT_RESPONDING"],
                              "reason": "Not responding", "previous": "IDLE"}),
            SignalDraft("kubernetes", "k8s_condition", node=node, value="Unknown",
                        message="Ready=Unknown (NodeStatusUnknown)",
                        data={"condition": "Ready", "status": "Unknown",
                              "reason": "NodeStatusUnknown"})]


@pytest.mark.parametrize("kind", ["pushed_collector", "collector_health"])
def test_pushed_source_health_already_stored_hides_no_other_nodes_failure(
        fleet: None, kind: str) -> None:
    # Two records saying Slurm and Kubernetes are down, stored before the door refused them
    # (pushed_collector), or observed by FleetWatch's own collectors (collector_health).
    cluster = collectors.cluster_default()
    now = timezone.now()
    if kind == "pushed_collector":  # today the agent of gpu-001 cannot push them at all
        pushed = _push(Client(), agent_token_create("gpu-001")[1], [
            {"at": _at(30), "source": "collector", "node": "gpu-001", "name": name,
             "healthy": False} for name in ("slurm", "kubernetes")])
        assert pushed.status_code == 403 and not Signal.objects.exists()
    ids = list(Signal.objects.bulk_create(
        Signal(cluster=cluster, source="collector", kind=kind, node_name="gpu-001",
               value="false", observed_at=now - timedelta(seconds=30),
               data={"name": name, "healthy": False, "error": "timeout"})
        for name in ("slurm", "kubernetes")))
    drafts = _unreachable("gpu-003")
    ids = [s.pk for s in ids] + collectors.signals_store(cluster, drafts, observed_at=now)
    found = [(i.root_cause, list(i.nodes)) for i in diagnosing.diagnose_signals(ids)]
    if kind == "pushed_collector":
        assert found == [("node_unreachable", ["gpu-003"])]
        incident = Incident.objects.get()
        client = Client()
        client.force_login(user_with_role("ophelia", OPERATOR)[0])
        timeline = client.get(f"/api/v1/incidents/{incident.pk}/timeline/").json()
        shown = [i["signal"]["kind"] for i in timeline if i["type"] == "signal"]
        assert "pushed_collector" not in shown and "slurm_node_state" in shown
        replay = client.get(f"/api/v1/incidents/{incident.pk}/replay/").json()
        assert [s["source"] for s in replay["signals"]] == ["slurm", "kubernetes"]
    else:
        assert found == []  # a real outage does set node states aside (the rule works)


# --- idempotency ----------------------------------------------------------------------------


def test_a_retried_push_with_its_idempotency_key_is_stored_once(
        fleet: None, client: Client) -> None:
    token = agent_token_create("gpu-001")[1]
    batch = [{"at": _at(), "source": "kernel", "node": "gpu-001", "message": XID79},
             {"at": _at(), "source": "kernel", "node": "gpu-001", "message": "mlx5: Link down"}]
    first = _push(client, token, batch, **{"Idempotency-Key": "batch-0001"})
    assert first.status_code == 201 and first.json() == {"stored": 2}
    assert "Idempotent-Replayed" not in first
    again = _push(client, token, batch, **{"Idempotency-Key": "batch-0001"})
    assert again.status_code == 201 and again.json() == {"stored": 2, "replayed": True}
    assert again["Idempotent-Replayed"] == "true"
    assert Signal.objects.count() == 2
    # The same key for another batch: refused, nothing stored.
    other = _push(client, token, batch[:1], **{"Idempotency-Key": "batch-0001"})
    assert other.status_code == 422
    assert "'batch-0001' was used" in other.json()["detail"]
    assert "different batch" in other.json()["detail"]
    assert Signal.objects.count() == 2
    # Keys are per token: another token's same key is its own.
    second_agent = agent_token_create("gpu-001")[1]
    mine = _push(client, second_agent, batch, **{"Idempotency-Key": "batch-0001"})
    assert mine.status_code == 201 and mine.json() == {"stored": 2}
    assert Signal.objects.count() == 4
    # Without a key, a push is a push.
    assert _push(client, token, batch).json() == {"stored": 2}
    assert Signal.objects.count() == 6


@pytest.mark.parametrize("key", ["", "x" * 129, "caf\u00e9", "two words"])
def test_a_malformed_idempotency_key_is_a_400(fleet: None, client: Client, key: str) -> None:
    token = agent_token_create("gpu-001")[1]
    headers = {"Idempotency-Key": key.encode().decode("latin-1")}
    response = _push(client, token, [{"at": _at(), "source": "kernel", "node": "gpu-001",
                                      "message": XID79}], **headers)
    assert response.status_code == 400 and "Idempotency-Key" in response.json()["detail"]
    assert not Signal.objects.exists()


def test_idempotency_keys_are_forgotten_after_their_hours(
        fleet: None, client: Client, settings: Any) -> None:
    token = agent_token_create("gpu-001")[1]
    batch = [{"at": _at(), "source": "kernel", "node": "gpu-001", "message": XID79}]
    assert _push(client, token, batch, **{"Idempotency-Key": "k1"}).json() == {"stored": 1}
    collectors.telemetry_prune()
    assert PushReceipt.objects.count() == 1  # still within its hours
    PushReceipt.objects.update(created_at=timezone.now() - timedelta(
        hours=settings.FLEETWATCH_INGEST_IDEMPOTENCY_HOURS, minutes=1))
    collectors.telemetry_prune()
    assert not PushReceipt.objects.exists()
    assert _push(client, token, batch, **{"Idempotency-Key": "k1"}).json() == {"stored": 1}
    assert Signal.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_identical_pushes_sent_at_once_are_stored_once(live_server: Any) -> None:
    if connection.vendor == "sqlite":
        pytest.skip("the embedded SQLite stack serves one write at a time")
    cluster = collectors.cluster_default()
    Node.objects.create(cluster=cluster, name="gpu-001")
    token = agent_token_create("gpu-001")[1]
    body = {"signals": [{"at": _at(), "source": "kernel", "node": "gpu-001",
                         "message": f"{XID79} #{i}"} for i in range(200)]}
    start = threading.Barrier(8)
    answers: list[requests.Response] = []

    def push() -> None:
        start.wait()
        answers.append(requests.post(
            f"{live_server.url}/api/v1/signals/", json=body, timeout=60,
            headers={"Authorization": f"Token {token}", "Idempotency-Key": "same-batch"}))

    threads = [threading.Thread(target=push) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.status_code for a in answers) == [201] * 8, [a.text for a in answers]
    assert all(a.json()["stored"] == 200 for a in answers)
    assert sum("replayed" in a.json() for a in answers) == 7
    assert Signal.objects.count() == 200


# --- sizes ----------------------------------------------------------------------------------


def test_the_documented_largest_batch_fits_the_request_size_limit(
        fleet: None, client: Client, operator: Any) -> None:
    # FLEETWATCH_INGEST_MAX_BATCH signals, each with a message of the most characters (every
    # one escaped by json.dumps, as requests sends it) and the most extra fields.
    token = token_for(operator, ("ingest",))
    largest = {"at": _at(), "source": "kernel", "node": "gpu-002",
               "message": "\u00e9" * django_settings.FLEETWATCH_INGEST_MESSAGE_MAX_CHARS,
               "extra": "x" * (django_settings.FLEETWATCH_INGEST_EXTRA_MAX_BYTES - 20)}
    batch = [largest] * django_settings.FLEETWATCH_INGEST_MAX_BATCH
    body = json.dumps({"signals": batch})
    assert len(body) > 2_621_440 * 10  # far over Django's default limit
    response = client.post("/api/v1/signals/", body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Token {token}")
    assert response.status_code == 201, response.content[:300]
    assert response.json() == {"stored": django_settings.FLEETWATCH_INGEST_MAX_BATCH}


def test_a_body_over_the_limit_is_a_json_413_naming_it(
        fleet: None, client: Client, operator: Any, settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 50_000
    token = token_for(operator, ("ingest",))
    body = json.dumps({"signals": [{"at": _at(), "source": "kernel", "node": "gpu-002",
                                    "message": "m" * 3000}] * 20})
    response = client.post("/api/v1/signals/", body, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Token {token}")
    assert response.status_code == 413
    assert response["Content-Type"] == "application/json"
    assert "over the limit of 50000 bytes" in response.json()["detail"]
    assert not Signal.objects.exists()


def test_extra_fields_over_their_limit_are_a_400_naming_the_largest(
        fleet: None, client: Client, operator: Any) -> None:
    token = token_for(operator, ("ingest",))
    response = _push(client, token, [{"at": _at(), "source": "kernel", "node": "gpu-002",
                                      "small": "s", "blob": "b" * 5000}])
    assert response.status_code == 400
    assert "FLEETWATCH_INGEST_EXTRA_MAX_BYTES" in response.json()["signals"]["0"]["blob"]


# --- what is stored breaks no reader --------------------------------------------------------


POISON = {"lone": "\ud800 and \udfff", "nul": "a\x00b", "nan": float("nan"),
          "inf": float("inf"), "nested": [{"deep": float("-inf"), "\ud83d": "key"}]}
# What SQLite keeps in a JSON column (its JSON_VALID check refuses NaN and Infinity).
STORED_POISON = {"lone": "\ud800 and \udfff", "nul": "a\x00b",
                 "nested": [{"deep": "\udc00", "\ud83d": "key"}]}


def _strict(text: str) -> Any:
    """JSON as a strict parser reads it (NaN and Infinity are not JSON)."""
    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_pushed_poison_is_stored_in_a_safe_form(fleet: None) -> None:
    # The service itself, whatever the door let through (another path, an older parser).
    record = {"at": timezone.now(), "source": "kernel", "node": "gpu-001",
              "message": "Xid\x00 \udc80", **POISON}
    result = collectors.signals_ingest(collectors.cluster_default(), [record])
    stored = Signal.objects.get(pk=result.ids[0])
    assert stored.message == "Xid\ufffd \ufffd"
    assert stored.data["lone"] == "\ufffd and \ufffd" and stored.data["nul"] == "a\ufffdb"
    assert stored.data["nan"] is None and stored.data["inf"] is None
    assert stored.data["nested"] == [{"deep": None, "\ufffd": "key"}]


def _poisoned_world() -> tuple[Incident, str]:
    """An incident on gpu-001 with poisoned rows beside it, written straight to the database
    (SQLite keeps them; PostgreSQL refuses them in a signal, but keeps an infinite reading)."""
    cluster = collectors.cluster_default()
    now = timezone.now()
    gpu = Gpu.objects.create(node=Node.objects.get(name="gpu-001"), index=0,
                             temperature=float("inf"), utilization=float("nan"))
    signal = Signal.objects.create(cluster=cluster, source="kernel", kind="pushed_kernel",
                                   node_name="gpu-001", message=XID79, observed_at=now)
    if connection.vendor == "sqlite":
        Signal.objects.filter(pk=signal.pk).update(message=f"{XID79}\x00")
        with connection.cursor() as cursor:  # as an older FleetWatch stored it
            cursor.execute("UPDATE collectors_signal SET data = %s WHERE id = %s",
                           [json.dumps(STORED_POISON), signal.pk])
    incident = Incident.objects.create(
        cluster=cluster, root_cause="gpu_hardware", confidence=0.95, explanation="XID 79",
        fingerprint="gpu_hardware:gpu-001", nodes=["gpu-001"], detected_at=now)
    return incident, str(gpu.pk)


def test_every_reader_survives_what_is_stored(fleet: None, client: Client) -> None:
    incident, _ = _poisoned_world()
    client.force_login(user_with_role("ophelia", OPERATOR)[0])
    for path in ["/api/v1/signals/", f"/api/v1/incidents/{incident.pk}/timeline/",
                 f"/api/v1/incidents/{incident.pk}/replay/", "/api/v1/gpus/",
                 "/api/v1/nodes/gpu-001/", f"/incidents/{incident.pk}/replay.json"]:
        response = client.get(path)
        assert response.status_code == 200, (path, response.content[:300])
        _strict(response.content.decode())
    signals = _strict(client.get("/api/v1/signals/").content.decode())["results"]
    if connection.vendor == "sqlite":
        [data] = [s["data"] for s in signals if s["data"]]
        assert data["lone"] == "\ufffd and \ufffd" and data["nul"] == "a\ufffdb"
        assert data["nested"] == [{"deep": "\ufffd", "\ufffd": "key"}]
    gpus = _strict(client.get("/api/v1/gpus/").content.decode())["results"]
    assert gpus[0]["temperature"] is None and gpus[0]["utilization"] is None
    for path in [f"/incidents/{incident.pk}/", f"/incidents/{incident.pk}/live",
                 f"/incidents/{incident.pk}/postmortem.md", "/nodes/gpu-001/",
                 f"/incidents/{incident.pk}/chart.json"]:
        response = client.get(path)
        assert response.status_code == 200, (path, response.content[:300])
    # Diagnosis reads them too: the XID beside the poison is the incident's.
    found = diagnosing.diagnose_signals(list(Signal.objects.values_list("pk", flat=True)))
    assert [i.pk for i in found] == [incident.pk]


@pytest.mark.skipif(connection.vendor == "sqlite", reason="this run is the SQLite one")
def test_the_same_on_sqlite(tmp_path: Path) -> None:
    # SQLite keeps a lone surrogate or NUL written into a JSON text: the readers' tests again,
    # and the idempotency keys' (its writes take turns differently).
    rerun_on_sqlite(__file__, tmp_path,
                    "poison or reader or idempotency or retried or pushed_source_health")


def test_an_agent_pushes_its_gpuds_events_and_diagnosis_reads_them(
        fleet: None, client: Client) -> None:
    """The agent forwards the local gpud's events (FLEETWATCH_AGENT_GPUD_URL) as ``gpud``
    records: stored as pushed, exported as replay records, read by diagnosis as that XID."""
    from incidents.diagnosis import diagnose
    from incidents.selectors import observation_from_signal, signal_as_replay

    token = agent_token_create("gpu-001")[1]
    message = ("XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS GPU has fallen off the bus "
               "detected on GPU PCI:0000:9b:00")
    record = {"at": _at(), "source": "gpud", "node": "gpu-001",
              "component": "accelerator-nvidia-error-xid", "name": "error_xid", "type": "Fatal",
              "message": message}
    response = _push(client, token, [record])
    assert response.status_code == 201 and response.json() == {"stored": 1}
    signal = Signal.objects.get(source="gpud")
    assert signal_as_replay(signal)["message"] == message
    found = diagnose([observation_from_signal(signal)])
    assert [(d.root_cause, d.nodes) for d in found] == [("gpu_hardware", ("gpu-001",))]
    # Another node's gpud is not this agent's to speak for.
    response = _push(client, token, [{**record, "node": "gpu-002"}])
    assert response.status_code == 403
