"""The audit trail's head kept outside the database: signed checkpoints in the log and the
/metrics gauges. The chain alone cannot see its newest entries cut off, nor a chain rewritten
consistently from some entry on; against a checkpoint both show.

Tampering is done as an attacker with the database would: the append-only trigger off, raw
SQL, the trigger on (PostgreSQL); SQLite has no trigger, so raw SQL alone."""

from __future__ import annotations

import json
import logging
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from incidents.audit import (
    _HASHED,
    CheckpointError,
    audit_head,
    audit_record,
    audit_verify,
    audit_verify_checkpoint,
    checkpoint_log,
    checkpoint_make,
    checkpoint_parse,
    entry_hash,
)
from incidents.models import AuditEntry
from tests.api.test_webhooks import receiver  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db

TRIGGER = "incidents_auditentry_append_only"


def _as_owner(sql: str, params: list[Any]) -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cursor.execute(f"ALTER TABLE incidents_auditentry DISABLE TRIGGER {TRIGGER}")
        cursor.execute(sql, params)
        if connection.vendor == "postgresql":
            cursor.execute(f"ALTER TABLE incidents_auditentry ENABLE TRIGGER {TRIGGER}")
            cursor.execute("SET CONSTRAINTS ALL DEFERRED")


def _write(n: int, start: int = 0) -> list[AuditEntry]:
    return [audit_record(f"test.{i}", f"node gpu-{i:03d}", result="ok", data={"i": i})
            for i in range(start, start + n)]


def _verify_cli(*extra: str) -> tuple[int, str]:
    out, err = StringIO(), StringIO()
    try:
        call_command("fleetwatch", "audit", "verify", *extra, stdout=out, stderr=err)
    except SystemExit as exc:
        return int(exc.code or 0), err.getvalue()
    return 0, out.getvalue()


def test_a_cut_tail_is_caught_against_a_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    entries = _write(6)
    with caplog.at_level(logging.INFO, logger="fleetwatch.audit"):
        checkpoint = checkpoint_log()
    [record] = [r for r in caplog.records if r.getMessage().startswith("audit checkpoint")]
    line = json.dumps({"message": record.getMessage(), "checkpoint": record.checkpoint})
    assert checkpoint == {**checkpoint_parse(line)}
    assert (checkpoint["count"], checkpoint["last_id"], checkpoint["head"]) == (
        6, entries[-1].pk, entries[-1].hash)
    # The trail grows after the checkpoint: still fine.
    _write(3, start=6)
    assert audit_verify_checkpoint(checkpoint).ok
    assert _verify_cli("--checkpoint", line)[0] == 0

    # The last four entries (two before the checkpoint, two after) are cut off.
    _as_owner("DELETE FROM incidents_auditentry WHERE id >= %s", [entries[4].pk])
    assert audit_verify().ok  # the chain of what is left verifies...
    result = audit_verify_checkpoint(checkpoint)  # ...the checkpoint shows the cut
    assert not result.ok and result.bad_id == entries[-1].pk
    assert "entries were cut from its tail" in result.reason
    code, said = _verify_cli("--checkpoint", line)
    assert code == 1 and "cut from its tail" in said


def test_a_chain_rewritten_consistently_is_caught() -> None:
    entries = _write(5)
    checkpoint = checkpoint_make()
    # Remove the second entry and re-chain everything after it with fresh hashes: every
    # link checks out, as it would for an attacker who knows how hashes are made.
    _as_owner("DELETE FROM incidents_auditentry WHERE id = %s", [entries[1].pk])
    prev = entries[0].hash
    for entry in AuditEntry.objects.filter(pk__gt=entries[0].pk).order_by("id"):
        fields = {name: getattr(entry, name) for name in _HASHED}
        new = entry_hash(fields, prev)
        _as_owner("UPDATE incidents_auditentry SET prev_hash = %s, hash = %s WHERE id = %s",
                  [prev, new, entry.pk])
        prev = new
    assert audit_verify().ok
    result = audit_verify_checkpoint(checkpoint)
    assert not result.ok and "the chain was rewritten" in result.reason


def test_a_forged_or_garbled_checkpoint_is_refused(settings: Any) -> None:
    _write(2)
    checkpoint = checkpoint_make()
    forged = {**checkpoint, "count": 1}
    for text in (json.dumps(forged), "{}", "not json", json.dumps([1]),
                 json.dumps({**checkpoint, "count": True})):
        with pytest.raises(CheckpointError):
            checkpoint_parse(text)
        with pytest.raises(CommandError, match="--checkpoint"):
            _verify_cli("--checkpoint", text)
    # Signed with another key (another installation, or a guess): refused.
    settings.FLEETWATCH_AUDIT_CHECKPOINT_KEY = "another key"
    with pytest.raises(CheckpointError, match="HMAC"):
        checkpoint_parse(json.dumps(checkpoint))


def test_the_command_prints_a_checkpoint_that_verifies() -> None:
    _write(3)
    out = StringIO()
    call_command("fleetwatch", "audit", "checkpoint", stdout=out)
    checkpoint = checkpoint_parse(out.getvalue())
    assert checkpoint["count"] == AuditEntry.objects.count()
    code, said = _verify_cli("--checkpoint", out.getvalue())
    assert code == 0 and "holds the checkpoint" in said


def test_metrics_carry_the_head(client: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    entries = _write(4)
    text = client.get("/metrics").content.decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    head = audit_head()
    assert head.hash == entries[-1].hash and head.last_id == entries[-1].pk
    assert samples[("fleetwatch_audit_entries", ())] == head.count == AuditEntry.objects.count()
    assert samples[("fleetwatch_audit_head_id", ())] == head.last_id
    assert samples[("fleetwatch_audit_head_info", (("head", head.hash),))] == 1
    # 52 bits: the float holds them exactly, so the value names the head.
    assert samples[("fleetwatch_audit_head", ())] == int(head.hash[:13], 16)


def test_checkpoints_are_logged_whatever_the_log_level(capsys: pytest.CaptureFixture[str],
                                                        settings: Any) -> None:
    import logging.config

    from fleetwatch.logs import logging_config

    _write(2)
    logging.config.dictConfig(logging_config(level="ERROR"))  # a site that logs errors only
    try:
        logging.getLogger("incidents").info("an ordinary info line")
        checkpoint = checkpoint_log()
    finally:
        logging.config.dictConfig(settings.LOGGING)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert [line["message"] for line in lines] == [
        f"audit checkpoint: 2 entries, head {checkpoint['head']}"]
    assert checkpoint_parse(json.dumps(lines[0])) == checkpoint


@pytest.mark.parametrize("by", ["beat", "command"])
def test_subscriptions_that_list_it_get_the_checkpoint(receiver: Any, settings: Any,  # noqa: F811
                                                       by: str) -> None:
    from unittest import mock

    from collectors.clients.notify import verify_signature
    from incidents import tasks
    from incidents.models import WebhookSubscription

    settings.FLEETWATCH_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    secret = "s" * 32
    WebhookSubscription.objects.create(name="auditor", url=f"{receiver.url}/audit",
                                       secret=secret, events=["audit.checkpoint"])
    # "No events listed" means every incident event, not this one.
    WebhookSubscription.objects.create(name="pager", url=f"{receiver.url}/pager", secret=secret)
    _write(3)
    with mock.patch.object(tasks.webhook_deliver, "apply_async",
                           side_effect=lambda args, **_: tasks.webhook_deliver.apply(args=args)):
        if by == "beat":
            checkpoint = tasks.audit_checkpoint()  # the beat's task: into the log, then to them
        else:  # `manage.py fleetwatch audit checkpoint` does the same
            out = StringIO()
            call_command("fleetwatch", "audit", "checkpoint", stdout=out)
            checkpoint = json.loads(out.getvalue())
    [hit] = receiver.hits
    assert hit.path == "/audit" and hit.headers["X-FleetWatch-Event"] == "audit.checkpoint"
    assert verify_signature(secret, hit.headers["X-FleetWatch-Timestamp"], hit.raw,
                            hit.headers["X-FleetWatch-Signature"])
    assert hit.json["checkpoint"] == checkpoint
    assert audit_verify_checkpoint(checkpoint_parse(json.dumps(hit.json["checkpoint"]))).ok
