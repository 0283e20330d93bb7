"""The audit trail: append-only and hash-chained.

Each entry's ``hash`` is sha256 over a canonical JSON form of its fields and ``prev_hash``, the
hash of the entry before it (by id). Changing an entry breaks its own hash; removing or
reordering one breaks the next entry's link. ``audit_verify`` walks the chain;
``manage.py fleetwatch audit verify`` runs it.

Appends are serialized so two writers never chain off the same predecessor:

- PostgreSQL: ``pg_advisory_xact_lock`` before reading the last hash. The lock lasts until the
  *outermost* transaction ends, because our row is invisible to other writers until then and
  the next writer must chain off it; under READ COMMITTED (Django's default) the next writer's
  lookup runs after our commit and sees our row. The cost: a transaction that audits holds the
  audit lock until it commits, so never audit and then wait on something slow inside the
  same transaction.

  Lock order. A transaction that audited holds the audit lock while it goes on to lock or
  update rows (the next step, the incident); another that locked one of those rows first and
  then audits waits for the audit lock: a deadlock, which PostgreSQL breaks by aborting one of
  them. So every transaction that locks rows *and* may audit calls ``audit_lock()`` first,
  before any row lock (then the policy lock, then remediation, step and incident rows): all
  such transactions queue on one lock and none holds a row another is waiting for. An audit
  row's foreign keys also take a share lock on the incident, remediation and step it names;
  that is why a transaction that audits alone (an outside call recorded by a running step)
  is safe too: whoever holds those rows for update holds the audit lock already. Transactions
  that still lose a deadlock (or a serialization failure) are run again by
  ``incidents.retry.retry_transient``.
- SQLite (the embedded demo): settings open every transaction with BEGIN IMMEDIATE, so the
  database's single write lock is held from the start of the transaction to its end: a second
  writer waits at BEGIN and reads the last hash only after the first has committed.

Entries are only ever inserted: the model refuses save-after-insert, update and delete, and on
PostgreSQL a trigger (migration 0002) refuses UPDATE and DELETE from any SQL session.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connections, router, transaction
from django.db.models import Count, Max
from django.utils import timezone

from collectors.request_id import current_request_id
from collectors.roles import SYSTEM
from incidents.models import AuditEntry, Incident, Remediation, Step

# pg_advisory_xact_lock key for "appending to the audit trail" (any fixed bigint works; this
# one is b"fwaudit1" read as an integer, unlikely to collide with another app's key).
AUDIT_LOCK_KEY = int.from_bytes(b"fwaudit1", "big", signed=True)

# Bumped if the canonical form ever changes, so old and new entries stay verifiable.
HASH_VERSION = 1

# The columns the hash covers, in the order audit_verify reads them.
_HASHED = ("at", "actor", "request_id", "verb", "target", "call", "ok", "result",
           "duration_ms", "data", "incident_id", "remediation_id", "step_id")


def _json_canonical(value: Any) -> Any:
    """``value`` as it reads back from the database. PostgreSQL's jsonb keeps numbers as
    decimals: a float such as 1e16 comes back as the integer 10000000000000000, so integral
    floats hash as integers, or a faithfully stored entry would fail to verify."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _json_canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_canonical(v) for v in value]
    return value


def entry_hash(fields: dict[str, Any], prev_hash: str) -> str:
    """sha256 of one entry: sorted-key JSON of its ``_HASHED`` fields and ``prev_hash``."""
    at: datetime = fields["at"]
    body = {name: fields[name] for name in _HASHED}
    body["at"] = at.astimezone(UTC).isoformat(timespec="microseconds")
    body["prev_hash"] = prev_hash
    body["v"] = HASH_VERSION
    canonical = json.dumps(_json_canonical(body), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def audit_lock(using: str | None = None) -> None:
    """Take the audit trail's append lock now, for the rest of the transaction (PostgreSQL;
    on SQLite the transaction's write lock already serializes writers). Call it first in any
    transaction that locks rows and may audit: see "Lock order" above. Taking it again in
    the same transaction (``audit_record`` does) is free."""
    alias = using or router.db_for_write(AuditEntry)
    connection = connections[alias]
    if connection.vendor == "postgresql":
        if not connection.in_atomic_block:
            raise RuntimeError("audit_lock() outside a transaction would be released at once")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [AUDIT_LOCK_KEY])


def audit_record(
    verb: str,
    target: str,
    *,
    actor: str = SYSTEM,
    call: str = "",
    ok: bool = True,
    result: str = "",
    incident: Incident | None = None,
    remediation: Remediation | None = None,
    step: Step | None = None,
    data: dict[str, Any] | None = None,
    request_id: str | None = None,
    duration_ms: float | None = None,
) -> AuditEntry:
    """Append one entry to the chain. ``request_id`` defaults to the current request's or
    task's; ``duration_ms`` is how long the outside call in ``call`` took."""
    if remediation is not None and incident is None:
        incident = remediation.incident
    # Fields exactly as they will read back (lengths the columns hold, data through JSON), so
    # the hash computed here is the one audit_verify recomputes from the stored row.
    fields: dict[str, Any] = {
        "actor": actor[:150],
        "request_id": (current_request_id() if request_id is None else request_id)[:64],
        "verb": verb[:64],
        "target": target[:200],
        "call": call,
        "ok": bool(ok),
        "result": result,
        "duration_ms": None if duration_ms is None else round(float(duration_ms), 3),
        "data": json.loads(json.dumps(data or {})),
        "incident_id": incident.pk if incident is not None else None,
        "remediation_id": remediation.pk if remediation is not None else None,
        "step_id": step.pk if step is not None else None,
    }
    alias = router.db_for_write(AuditEntry)
    with transaction.atomic(using=alias):
        audit_lock(alias)
        # One backward step on the primary key index: the newest entry's hash.
        prev_hash = (AuditEntry.objects.using(alias).order_by("-id")
                     .values_list("hash", flat=True).first()) or ""
        # Taken under the lock, so "at" never goes backwards along the chain.
        fields["at"] = timezone.now()
        entry = AuditEntry(**fields, prev_hash=prev_hash, hash=entry_hash(fields, prev_hash))
        # The instance carries the objects, not just their ids, for callers that read them.
        entry.incident, entry.remediation, entry.step = incident, remediation, step
        entry.save(using=alias, force_insert=True)
    return entry


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    checked: int  # entries whose hash and link were checked
    bad_id: int | None = None  # the first entry that fails
    reason: str = ""
    unchained: int = 0  # entries written before hash chaining existed, not covered
    head: str = ""  # the last good hash: note it somewhere else to catch a cut-off tail

    def __str__(self) -> str:
        if self.ok:
            text = f"audit trail OK: {self.checked} entries"
            if self.head:
                text += f" (head {self.head})"
            if self.reason:  # what else it was checked against
                text += f"; {self.reason}"
            if self.unchained:
                text += (f"; {self.unchained} earlier entries predate the hash chain and "
                         "are not covered")
            return text
        return (f"audit trail BROKEN at entry {self.bad_id}: {self.reason} "
                f"({self.checked} entries before it verified)")


def audit_verify(using: str | None = None, chunk_size: int = 2000) -> VerifyResult:
    """Walk the chain in id order; stop at the first entry that does not verify."""
    alias = using or router.db_for_read(AuditEntry)
    rows: Iterable[tuple[Any, ...]] = (
        AuditEntry.objects.using(alias).order_by("id")
        .values_list("id", "prev_hash", "hash", *_HASHED)
        .iterator(chunk_size=chunk_size)
    )
    checked = unchained = 0
    last_id: int | None = None
    last_hash = ""
    for entry_id, prev_hash, stored, *values in rows:
        if not stored and not prev_hash and not checked:
            # Rows from before the chain (migration 0002 added the columns empty). Only a
            # leading run of them is allowed; an empty hash further on is tampering.
            unchained += 1
            last_id = entry_id
            continue
        if prev_hash != last_hash:
            where = f"entry {last_id}" if last_id is not None else "the start of the trail"
            return VerifyResult(False, checked, entry_id,
                                f"prev_hash does not match {where} (entry removed or reordered)",
                                unchained)
        if entry_hash(dict(zip(_HASHED, values, strict=True)), prev_hash) != stored:
            return VerifyResult(False, checked, entry_id, "hash mismatch (entry changed)",
                                unchained)
        checked += 1
        last_id, last_hash = entry_id, stored
    return VerifyResult(True, checked, unchained=unchained, head=last_hash)


# --- the head, kept outside the database ------------------------------------------------------
#
# The chain proves that the trail as stored is the trail as written *up to its last entry*:
# whoever can write the database can also delete the newest entries (the chain of what is left
# still verifies) or rewrite the whole chain from some entry on with fresh hashes. Only a copy
# of the head kept where that someone cannot write bounds this: the /metrics gauges (scraped
# into Prometheus) and a signed checkpoint written to the log (shipped off the machine) every
# FLEETWATCH_AUDIT_CHECKPOINT_MINUTES. ``audit_verify_checkpoint`` checks the trail against
# one: the entry the checkpoint names must still be there with the same hash, and as many
# entries up to it as there were.

CHECKPOINT_VERSION = 1


@dataclass(frozen=True)
class Head:
    count: int  # entries in the trail
    last_id: int | None
    hash: str  # the newest entry's hash ("" for none, or for a trail from before the chain)


def audit_head(using: str | None = None) -> Head:
    """The trail's newest entry and size now. The count and the newest id come from one
    statement, so they agree: read apart, an entry committed between the two reads would be
    counted without being the head, and /metrics' copy (the alert rules compare count, id and
    head from one scrape to the last) would look like a rewritten trail. An entry's hash never
    changes, so reading it after is safe."""
    alias = using or router.db_for_read(AuditEntry)
    rows = AuditEntry.objects.using(alias)
    size = rows.aggregate(count=Count("pk"), last_id=Max("pk"))
    last_id: int | None = size["last_id"]
    head = "" if last_id is None else (
        rows.filter(pk=last_id).values_list("hash", flat=True).first() or "")
    return Head(size["count"], last_id, head)


def _checkpoint_key() -> bytes:
    from django.conf import settings

    return str(settings.FLEETWATCH_AUDIT_CHECKPOINT_KEY).encode()


def _checkpoint_mac(body: dict[str, Any]) -> str:
    fields = {k: body[k] for k in ("v", "at", "count", "last_id", "head")}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hmac.new(_checkpoint_key(), canonical.encode(), hashlib.sha256).hexdigest()


def checkpoint_make(using: str | None = None) -> dict[str, Any]:
    """A checkpoint of the trail's head, signed (HMAC-SHA256 with
    FLEETWATCH_AUDIT_CHECKPOINT_KEY) so that one forged with the database alone is refused."""
    head = audit_head(using)
    body: dict[str, Any] = {"v": CHECKPOINT_VERSION,
                            "at": timezone.now().astimezone(UTC).isoformat(timespec="seconds"),
                            "count": head.count, "last_id": head.last_id, "head": head.hash}
    body["hmac"] = _checkpoint_mac(body)
    return body


class CheckpointError(ValueError):
    """Not a checkpoint, or not one signed with this installation's key."""


def checkpoint_parse(text: str) -> dict[str, Any]:
    """A checkpoint from what was saved: the checkpoint's JSON, or the whole JSON log line
    that carried it (its ``checkpoint`` field)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"not JSON: {exc}") from None
    if isinstance(data, dict) and "checkpoint" in data:
        data = data["checkpoint"]
        if isinstance(data, str):
            return checkpoint_parse(data)
    fields = {"v": int, "at": str, "count": int, "head": str, "hmac": str}
    if not isinstance(data, dict) or any(not isinstance(data.get(k), t) or isinstance(
            data.get(k), bool) for k, t in fields.items()) or not (
            data.get("last_id") is None or isinstance(data.get("last_id"), int)):
        raise CheckpointError("not an audit checkpoint (v, at, count, last_id, head, hmac)")
    if data["v"] != CHECKPOINT_VERSION:
        raise CheckpointError(f"checkpoint version {data['v']} is not {CHECKPOINT_VERSION}")
    if not hmac.compare_digest(_checkpoint_mac(data), data["hmac"]):
        raise CheckpointError("the checkpoint's HMAC does not match: changed, or signed with "
                              "another FLEETWATCH_AUDIT_CHECKPOINT_KEY")
    return data


def audit_verify_checkpoint(checkpoint: dict[str, Any], using: str | None = None) -> VerifyResult:
    """Verify the chain, then that it still holds the checkpoint's head: the entry it names,
    with the hash it had, and as many entries up to it. Catches a cut-off tail and a chain
    rewritten from some entry on, which the chain alone cannot."""
    alias = using or router.db_for_read(AuditEntry)
    result = audit_verify(using=alias)
    if not result.ok:
        return result
    last_id, count, head = checkpoint["last_id"], checkpoint["count"], checkpoint["head"]
    where = f"the checkpoint of {checkpoint['at']} ({count} entries, head {head or 'none'})"
    if last_id is None:
        return result  # the trail was empty then: anything since is new
    stored = AuditEntry.objects.using(alias).filter(pk=last_id).values_list("hash", flat=True).first()
    if stored is None:
        newest = AuditEntry.objects.using(alias).order_by("-id").values_list("id", flat=True).first()
        why = ("the trail ends before it: entries were cut from its tail" if newest is None
               or newest < last_id else "its head entry was removed")
        return VerifyResult(False, result.checked, last_id, f"{why} ({where})", result.unchained)
    if stored != head:
        return VerifyResult(False, result.checked, last_id,
                            f"its head entry has another hash now: the chain was rewritten "
                            f"({where})", result.unchained)
    before = AuditEntry.objects.using(alias).filter(pk__lte=last_id).count()
    if before != count:
        return VerifyResult(False, result.checked, last_id,
                            f"{before} entries up to its head, not {count}: entries were "
                            f"removed or added and the chain rewritten ({where})",
                            result.unchained)
    return VerifyResult(True, result.checked, unchained=result.unchained, head=result.head,
                        reason=f"holds {where}")


def checkpoint_log() -> dict[str, Any]:
    """Write a signed checkpoint to the log (JSON: its ``checkpoint`` field is what
    ``manage.py fleetwatch audit verify --checkpoint`` takes), for the log shipper to carry
    off the machine. The beat's task (incidents.tasks.audit_checkpoint) runs this every
    FLEETWATCH_AUDIT_CHECKPOINT_MINUTES and sends the checkpoint as an ``audit.checkpoint``
    webhook event too."""
    checkpoint = checkpoint_make()
    logging.getLogger("fleetwatch.audit").info(
        "audit checkpoint: %d entries, head %s", checkpoint["count"], checkpoint["head"] or "none",
        extra={"checkpoint": json.dumps(checkpoint, sort_keys=True, separators=(",", ":"))})
    return checkpoint
