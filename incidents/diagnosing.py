"""Diagnosis of stored signals: coalesced per cluster, then incidents opened or extended.

Collectors announce stored signals (collectors.services.signals_stored); ``diagnosis_request``
marks diagnosis due in that same transaction and queues at most one run per cluster;
``diagnosis_run`` (the task's body) diagnoses everything marked since the last run and hands
each diagnosis to the lifecycle (``incident_record``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.postgres.aggregates import ArrayAgg
from django.db import connection, transaction
from django.db.models import Min, Q
from django.utils import timezone

from collectors import queueing
from collectors.knowledge import RootCause
from collectors.models import Cluster, Signal
from collectors.push import DRILL_MARK
from collectors.services import gc_paused
from incidents import selectors
from incidents.diagnosis import Diagnosis, JobInfo, Observation, diagnose
from incidents.lifecycle import DRILL_FINGERPRINT, incident_record, storm_record
from incidents.models import DiagnosisState, Drill, Evidence, Incident
from incidents.remediation import policy

log = logging.getLogger(__name__)


def diagnose_signals(signal_ids: list[int]) -> list[Incident]:
    """Diagnose the window around newly ingested signals; open or extend incidents.

    The live pipeline goes through diagnosis_run (coalesced per cluster): this is the same
    window and the same verdicts for a caller holding the ids (the tests), without the queue."""
    fresh = list(Signal.objects.filter(pk__in=signal_ids).select_related("cluster"))
    if not fresh:
        return []
    while True:  # all of it, however many runs' budgets that takes
        incidents, complete = _diagnose_from(fresh[0].cluster_id,
                                             min(s.observed_at for s in fresh))
        if complete:
            return incidents


# How long one run may spend recording new incidents before it hands the rest to the next
# run (which re-diagnoses the window, cheaply, and records the rarest first). A storm of 500
# new incidents took one run 6 s, and a fault of another kind arriving meanwhile waited for
# all of it; now it waits for at most this, and is recorded before the storm's.
RECORD_BUDGET_S = 1.0


def _diagnose_from(cluster_id: int, earliest: datetime) -> tuple[list[Incident], bool]:
    """Diagnose the cluster's window from ``earliest`` (less the diagnosis window) to now.
    Returns the incidents recorded or found, and whether every diagnosis was recorded
    (False: the run's budget ran out; the next run goes on)."""
    cluster = Cluster.objects.get(pk=cluster_id)
    window = timedelta(minutes=settings.FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES)
    with gc_paused():  # a storm's window is thousands of observations, re-read every run
        observations = selectors.observations_between(cluster, earliest - window,
                                                      timezone.now())
        observations, drills = _drill_split(cluster.pk, observations)
        topology, jobs = selectors.topology(cluster), selectors.jobs_info(cluster)
        drilled = _drills_record(cluster.pk, drills, topology, jobs)
        incidents, complete = diagnoses_record(cluster, diagnose(observations, topology, jobs))
    return incidents + drilled, complete  # the fire drills' after the real ones


def diagnoses_record(cluster: Cluster, diagnoses: list[Diagnosis]) -> tuple[list[Incident], bool]:
    """Open or extend the incidents of a run's diagnoses (those of the window above, or of
    the fail-slow scan: incidents.slowness), storms grouped, the rarest kind first. Returns the
    incidents recorded or found, and whether every diagnosis was recorded (False: the run's
    budget ran out; the next run goes on)."""
    recorded = _recorded_already(cluster.pk, diagnoses)
    new = [d for d in diagnoses if d.fingerprint not in recorded]
    # The rarest kind first: in a storm of one fault on hundreds of nodes, a different fault
    # elsewhere is not queued behind it. (Within a kind, the earliest first.)
    kinds = Counter(d.root_cause for d in new)
    new.sort(key=lambda d: (kinds[d.root_cause], d.detected_at))
    alone, storms = _storm_split(cluster.pk, new)
    deadline = time.monotonic() + RECORD_BUDGET_S
    done = 0

    def record(diagnoses: list[Diagnosis]) -> bool:
        """Record these until the budget runs out (at least one a run); False if it did."""
        nonlocal done
        for diagnosis in diagnoses:
            if done and time.monotonic() > deadline:
                log.info("diagnosis of %s: %d of %d new incidents recorded in this run; the "
                         "next run records the rest", cluster.name, done, len(alone))
                return False
            recorded[diagnosis.fingerprint], _ = incident_record(cluster.pk, diagnosis)
            done += 1
        return True

    # First the incidents of a kind no storm holds, rarest first: a fault elsewhere during a
    # storm is not queued behind the storm's join (one transaction of up to thousands of
    # nodes). Then each storm's incident, what the person paged needs to see; then the
    # incidents of their own of a storm's kind (its first faults, before the brake).
    complete = record([d for d in alone if d.root_cause not in storms])
    if complete:
        for cause, members in storms.items():
            storm = storm_record(cluster.pk, cause, members)
            recorded.update((d.fingerprint, storm) for d in members)
        complete = record([d for d in alone if d.root_cause in storms])
    # In the diagnoses' order (the engine's: by time), whatever order they were recorded in.
    return [recorded[d.fingerprint] for d in diagnoses if d.fingerprint in recorded], complete


def _drill_split(cluster_id: int, observations: list[Observation]
                 ) -> tuple[list[Observation], dict[int, list[Observation]]]:
    """The real observations, and per running fire drill its synthetic fault's (marked
    ``DRILL_MARK``: "<drill id>:<nonce>", see incidents.drills). A drill's signals never reach
    the real diagnosis: they would open a real incident (and page), join a real fault on the
    canary, or count towards a storm. A mark of no running drill (a finished drill's signal
    still in the window, or one that names no drill) is left out altogether."""
    if not any(DRILL_MARK in o.fields for o in observations):
        return observations, {}
    running = dict(Drill.objects.filter(cluster_id=cluster_id, status=Drill.Status.RUNNING)
                   .values_list("pk", "nonce"))
    real: list[Observation] = []
    drills: dict[int, list[Observation]] = {}
    for o in observations:
        mark = o.fields.get(DRILL_MARK)
        if mark is None:
            real.append(o)
            continue
        drill_id, _, nonce = str(mark).partition(":")
        if drill_id.isdigit() and nonce and running.get(int(drill_id)) == nonce:
            drills.setdefault(int(drill_id), []).append(o)
    return real, drills


def _drills_record(cluster_id: int, drills: dict[int, list[Observation]],
                   topology: dict[str, list[str]], jobs: list[JobInfo]) -> list[Incident]:
    """Diagnose each running drill's synthetic fault on its own, with the same engine and
    the cluster's topology, and record what it finds as that drill's incident (lifecycle:
    the same path as a real fault's, apart from it). A run that finds the drill's incident
    already holding the evidence records nothing again."""
    out: list[Incident] = []
    for drill_id, observations in sorted(drills.items()):
        for diagnosis in diagnose(observations, topology, jobs):
            fingerprint = DRILL_FINGERPRINT.format(drill_id, diagnosis.fingerprint)
            have = Incident.objects.filter(cluster_id=cluster_id, drill_id=drill_id,
                                           fingerprint=fingerprint).first()
            if have is not None and set(diagnosis.evidence) <= set(
                    have.evidence.values_list("signal_id", flat=True)):
                out.append(have)
                continue
            out.append(incident_record(cluster_id, diagnosis, drill_id=drill_id)[0])
    return out


def _storm_split(cluster_id: int, new: list[Diagnosis]
                 ) -> tuple[list[Diagnosis], dict[str, list[Diagnosis]]]:
    """The new diagnoses that open incidents of their own, and per root cause those past the
    storm brake (policy.storm_room), which join its storm incident: of each cause, the first
    ones in ``new``'s order open alone while the brake leaves room, the rest join. A node
    FleetWatch is repairing that stops answering is its repair's evidence (incident_record),
    never a storm's."""
    room: dict[str, int | None] = {cause: policy.storm_room(cluster_id, cause)
                                   for cause in {d.root_cause for d in new}}
    repairing = (policy.nodes_in_remediation(cluster_id)
                 if any(d.root_cause == RootCause.NODE_UNREACHABLE for d in new) else set())
    alone: list[Diagnosis] = []
    storms: dict[str, list[Diagnosis]] = {}
    for d in new:
        left = room[d.root_cause]
        if left is None or (d.root_cause == RootCause.NODE_UNREACHABLE
                            and repairing.intersection(d.nodes)):
            alone.append(d)
        elif left > 0:
            room[d.root_cause] = left - 1
            alone.append(d)
        else:
            storms.setdefault(d.root_cause, []).append(d)
    return alone, storms


def _recorded_already(cluster_id: int, diagnoses: list[Diagnosis]) -> dict[str, Incident]:
    """The diagnoses that would change nothing: their incident is open (or just resolved)
    and already holds all their evidence. Each run re-diagnoses the whole window, so during a
    storm every run found every incident again and re-recorded it, one transaction under the
    audit lock each; three queries tell them apart, and only the rest are recorded. The rest
    go through ``incident_record``, which decides under its locks as before."""
    if not diagnoses:
        return {}
    recent = timezone.now() - timedelta(minutes=settings.FLEETWATCH_DEDUPE_MINUTES)
    wanted = {d.fingerprint for d in diagnoses}
    latest: dict[str, Incident] = {}
    storms: dict[str, Incident] = {}
    # The cluster's open and lately resolved incidents, picked here: a few, where a storm's
    # run has thousands of diagnoses, whose fingerprints sent as an IN list cost more than
    # these rows.
    for incident in (Incident.objects.filter(cluster_id=cluster_id)
                     .filter(~Q(status=Incident.Status.RESOLVED) | Q(resolved_at__gte=recent))
                     .order_by("opened_at")):
        if incident.fingerprint in wanted:
            latest[incident.fingerprint] = incident  # the newest wins, as incident_record picks
        # A storm incident holds diagnoses of its cause by their signals (their own
        # fingerprints opened nothing): one that brings no signal the storm lacks is
        # recorded already.
        if incident.storm and incident.status != Incident.Status.RESOLVED:
            storms[incident.root_cause] = incident
    linked = _evidence_signals([i.pk for i in (*latest.values(), *storms.values())])
    done = {d.fingerprint: latest[d.fingerprint] for d in diagnoses
            if d.fingerprint in latest
            and set(d.evidence) <= linked.get(latest[d.fingerprint].pk, set())}
    for d in diagnoses:
        storm = storms.get(d.root_cause)
        if (d.fingerprint not in done and storm is not None
                and set(d.evidence) <= linked.get(storm.pk, set())):
            done[d.fingerprint] = storm
    return done


def _evidence_signals(incident_ids: list[int]) -> dict[int, set[int]]:
    """The signal ids each incident holds as evidence. A storm's incident holds thousands, read
    by every run: on PostgreSQL one array an incident (decoded in C), not a row a signal."""
    if not incident_ids:
        return {}
    rows = Evidence.objects.filter(incident_id__in=incident_ids)
    if connection.vendor == "postgresql":
        return {incident_id: set(ids) for incident_id, ids in rows.values("incident_id").annotate(
            ids=ArrayAgg("signal_id")).order_by().values_list("incident_id", "ids")}
    linked: dict[int, set[int]] = {}
    for incident_id, signal_id in rows.values_list("incident_id", "signal_id"):
        linked.setdefault(incident_id, set()).add(signal_id)
    return linked


# --- coalesced diagnosis ----------------------------------------------------------------------
#
# One task per push let a burst starve detection: 2,000 batches queued 2,000 diagnoses, each
# re-reading the same window, and a new fault waited behind all of them. Instead each cluster
# has one DiagnosisState row, and:
#
# - storing signals marks it *in the storing transaction* (diagnosis_request, the listener of
#   collectors' signals_stored): pending_since = the earliest new observation. Committed with
#   the signals or not at all, so a stored signal is never left unannounced, whatever happens
#   to the process or the broker afterwards;
# - a task is sent only when none is queued and no run holds the row: a burst adds nothing
#   to the queue, whatever the push rate (at most one queued and one running per cluster);
# - a run (diagnosis_run) claims everything pending at once, diagnoses the window from the
#   earliest claimed observation to now (what the per-batch runs did for their earliest
#   batch: the same verdicts), and on finishing queues the next run if more arrived meanwhile.
#   A fault stored during a run is diagnosed by the next one.
#
# A database row rather than the cache: the mark must commit with the signals (a cache write
# cannot), and the embedded default's file cache has no atomic operations. Row locks
# (select_for_update; on SQLite every transaction takes the write lock up front) make the
# read-and-set steps safe with several workers. Lost messages and killed workers: a run's
# claim is a lease (the task's hard time limit), given back when the run fails; a beat entry
# (diagnosis_rescue) and the next announcement re-send a task whose message was lost or whose
# run died, and claim what the dead run had claimed.
#
# On PostgreSQL a push that finds diagnosis marked early enough and a run queued or running
# (nearly every push of a storm) does not lock the row: it holds a *shared* advisory lock on
# the cluster's claim until it commits, and a run's claim takes that lock *exclusively*. So
# pushes never wait for each other (the row lock made every push of a cluster wait for the one
# before it to commit, its WAL flush included: a ceiling of a few hundred pushes a second,
# whatever the number of web workers), and a claim still waits for every push that counted on
# the mark to commit, so the run reads their signals. Pushes that must change the row take its
# lock as before; a claim waiting for the exclusive lock holds no row lock, so nothing waits
# in a circle. (PostgreSQL queues a new shared request behind a waiting exclusive one: a
# storm cannot starve the claim.)
DIAGNOSIS_CLAIM_LOCK = 0x66776467  # pg_advisory_xact_lock's first key: b"fwdg"


def _claim_lock(cluster_id: int, *, exclusive: bool) -> None:
    """The cluster's claim lock for the rest of the transaction (PostgreSQL; SQLite's
    transactions take turns anyway)."""
    if connection.vendor != "postgresql":
        return
    function = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {function}(%s, %s)", [DIAGNOSIS_CLAIM_LOCK, cluster_id])


_MARK_SQL = ('SELECT "pending_since", "queued_at", "running_since" FROM '
             f'"{DiagnosisState._meta.db_table}" WHERE "cluster_id" = %s')


def _marked_already(cluster_id: int, at: datetime, now: datetime) -> bool:
    """True when diagnosis of the cluster is marked from ``at`` or earlier and a live run is
    queued or running, so a push observed at ``at`` changes nothing. Either way the claim
    lock is then held shared until the transaction ends; False means the row must change,
    under its row lock (which waits for no claim: see above)."""
    if connection.vendor != "postgresql":
        return False
    _claim_lock(cluster_id, exclusive=False)
    # Its own statement, after the lock's: one that waited for a claim must read what the
    # claim committed (a statement reads the rows as they were when it began). Written out:
    # the ORM compiling it took as long as running it, on every push.
    with connection.cursor() as cursor:
        cursor.execute(_MARK_SQL, [cluster_id])
        row = cursor.fetchone()
    if row is None:
        return False
    pending, queued, running = row
    stale = now - _lease()
    return (pending is not None and pending <= at
            and ((running is not None and running > stale)
                 or (queued is not None and queued >= stale)))


def _lease() -> timedelta:
    """No run outlives the task's hard time limit: past it, a run that holds the row is dead."""
    return timedelta(seconds=settings.CELERY_TASK_TIME_LIMIT + 10)


def _diagnosis_state(cluster_id: int) -> DiagnosisState:
    """The cluster's row, locked for the rest of the transaction."""
    state, _ = DiagnosisState.objects.select_for_update().get_or_create(cluster_id=cluster_id)
    return state


def _diagnosis_queue(state: DiagnosisState, now: datetime, *, force: bool = False) -> None:
    """Send a run for the (locked) state unless one is queued or running. ``force``: the
    message of the queued one may have been lost (the rescue)."""
    running = state.running_since is not None and state.running_since > now - _lease()
    if running or (state.queued_at is not None and not force):
        return
    state.queued_at = now
    queueing.enqueue(queueing.DIAGNOSE_CLUSTER, state.cluster_id)


def diagnosis_request(signal_ids: Collection[int],
                      earliest: dict[int, datetime] | None = None) -> None:
    """Mark diagnosis due for these (just stored) signals' clusters; queue a run if none is.
    ``earliest``: cluster id -> earliest observation among them, when the caller knows it."""
    if not signal_ids:
        return
    if earliest is None:
        # Rows of one bulk insert have neighbouring ids: a range reads no long IN list. Rows
        # of other pushes in the range only make the window start earlier, never later.
        earliest = dict(Signal.objects.filter(pk__range=(min(signal_ids), max(signal_ids)))
                        .values("cluster_id").annotate(at=Min("observed_at"))
                        .order_by("cluster_id").values_list("cluster_id", "at"))
    now = timezone.now()
    # No savepoint of its own inside the storing transaction (two statements a push): an
    # error here fails the whole store, as it must.
    with transaction.atomic(savepoint=False):
        for cluster_id, at in sorted(earliest.items()):  # one lock order for every caller
            if _marked_already(cluster_id, at, now):
                continue
            state = _diagnosis_state(cluster_id)
            before = (state.pending_since, state.queued_at)
            if state.pending_since is None or at < state.pending_since:
                state.pending_since = at
            _diagnosis_queue(state, now, force=state.queued_at is not None
                             and state.queued_at < now - _lease())
            if (state.pending_since, state.queued_at) != before:
                # In a storm most pushes find diagnosis marked and queued already: no write.
                state.save(update_fields=["pending_since", "queued_at"])


def signals_stored_received(sender: object, signal_ids: list[int],
                            earliest: dict[int, datetime] | None = None, **_: object) -> None:
    """collectors.services.signals_stored's listener (connected in apps.py)."""
    diagnosis_request(signal_ids, earliest)


def diagnosis_run(cluster_id: int) -> list[Incident]:
    """Diagnose everything stored for the cluster since the last run (the task's body)."""
    now = timezone.now()
    with transaction.atomic():
        _claim_lock(cluster_id, exclusive=True)  # every push that counted on the mark is in
        state = _diagnosis_state(cluster_id)
        state.queued_at = None  # this is the queued run: announcements may queue the next
        if state.running_since is not None and state.running_since > now - _lease():
            state.save()  # another worker's run holds it and will look again when done
            return []
        # A run that died (lease expired) gives back what it claimed.
        earliest = min((t for t in (state.pending_since, state.running_from) if t is not None),
                       default=None)
        state.pending_since = None
        state.running_from = earliest
        state.running_since = now if earliest is not None else None
        state.save()
    if earliest is None:
        return []
    started = time.monotonic()
    try:
        incidents, complete = _diagnose_from(cluster_id, earliest)
    except BaseException:
        _diagnosis_release(cluster_id, now, started, failed=True)
        raise
    _diagnosis_release(cluster_id, now, started, unfinished=not complete)
    return incidents


def _diagnosis_release(cluster_id: int, claimed_at: datetime, started: float, *,
                       failed: bool = False, unfinished: bool = False) -> None:
    """``unfinished``: the run's budget ran out; what it claimed is pending again, and the
    next run is queued at once."""
    with transaction.atomic():
        state = _diagnosis_state(cluster_id)
        if state.running_since != claimed_at:
            return  # our lease expired and another run took the claim over
        if unfinished and state.running_from is not None:
            state.pending_since = min(t for t in (state.pending_since, state.running_from) if t)
        if failed and state.running_from is not None:
            # Not diagnosed: pending again, for the retry or the next announcement.
            state.pending_since = min(t for t in (state.pending_since, state.running_from) if t)
        else:
            state.runs += 1
            state.last_run_at = timezone.now()
            state.last_run_ms = (time.monotonic() - started) * 1000
        state.running_since = state.running_from = None
        if state.pending_since is not None and not failed:
            _diagnosis_queue(state, timezone.now())  # what arrived during this run
        state.save()


def diagnosis_rescue() -> int:
    """Re-send runs whose message was lost (queued too long) or whose worker died (lease
    expired) while diagnosis is due; the beat runs this. Returns how many were sent."""
    now = timezone.now()
    stale = now - _lease()
    due = DiagnosisState.objects.filter(
        Q(pending_since__isnull=False) | Q(running_from__isnull=False)).filter(
        Q(queued_at__isnull=True) | Q(queued_at__lt=stale)).filter(
        Q(running_since__isnull=True) | Q(running_since__lt=stale))
    sent = 0
    for cluster_id in due.values_list("cluster_id", flat=True):
        with transaction.atomic():
            state = _diagnosis_state(cluster_id)
            if state.queued_at is None or state.queued_at < stale:
                before = state.queued_at
                _diagnosis_queue(state, now, force=True)
                if state.queued_at != before:
                    sent += 1
                    log.warning("diagnosis of cluster %s was due and nothing was queued (a lost "
                                "message or a dead worker): queued a run", cluster_id)
                state.save()
    return sent
