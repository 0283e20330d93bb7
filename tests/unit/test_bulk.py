"""collectors.bulk: the COPY-based writes the collectors use for a whole fleet's rows."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from collectors.bulk import append_rows, insert_missing, update_columns
from collectors.models import Cluster, Gpu, GpuSample, Node

pytestmark = pytest.mark.django_db


def test_new_rows_are_the_template_with_their_keys_and_existing_ones_are_left_alone() -> None:
    cluster = Cluster.objects.create(name="bulk")
    Node.objects.create(cluster=cluster, name="gpu-002", slurm_reason="kept", health="failed")
    sent = insert_missing(Node(cluster=cluster), ["name"], [("gpu-001",), ("gpu-002",)])
    assert sent == 2
    nodes = {n.name: n for n in Node.objects.filter(cluster=cluster)}
    assert sorted(nodes) == ["gpu-001", "gpu-002"]
    new = nodes["gpu-001"]
    # The model's defaults, JSON included, as Node(...).save() would have written them.
    assert (new.slurm_flags, new.k8s_annotations, new.nic_ports) == ([], {}, {})
    assert (new.in_service, new.health, new.k8s_ready, new.updated_at is not None) == \
        (True, Node.Health.UNKNOWN, None, True)
    assert (nodes["gpu-002"].slurm_reason, nodes["gpu-002"].health) == ("kept", "failed")


def test_new_gpus_carry_their_values_and_readings_update_alone() -> None:
    node = Node.objects.create(cluster=Cluster.objects.create(name="bulk"), name="gpu-001")
    template = Gpu()
    insert_missing(template, ["node_id", "index", "uuid", "utilization", "temperature"],
                   [(node.pk, 0, "GPU-a", 12.5, None), (node.pk, 1, "GPU-b", None, 40.0)])
    gpus = {g.index: g for g in Gpu.objects.filter(node=node)}
    assert (gpus[0].uuid, gpus[0].utilization, gpus[0].temperature) == ("GPU-a", 12.5, None)
    assert (gpus[1].uuid, gpus[1].utilization, gpus[1].temperature) == ("GPU-b", None, 40.0)
    assert (gpus[0].last_xid, gpus[0].row_remap_failure, gpus[0].health) == \
        (0, False, Node.Health.UNKNOWN)
    update_columns(Gpu, ["utilization", "temperature", "updated_at"],
                   [(gpus[1].pk, 99.0, 41.0, gpus[1].updated_at)])
    gpus[1].refresh_from_db()
    assert (gpus[1].uuid, gpus[1].utilization, gpus[1].temperature) == ("GPU-b", 99.0, 41.0)
    assert insert_missing(template, ["node_id", "index"], []) == 0


def test_a_row_that_breaks_another_constraint_is_refused_not_skipped() -> None:
    # Only a duplicate is skipped (a concurrent collector made it); a NULL where the column
    # takes none is an error, and nothing of the batch is stored. (SQLite's path is
    # Django's INSERT OR IGNORE, which skips such a row too: PostgreSQL's is the one
    # FleetWatch's own COPY and savepoint make.)
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's path")
    cluster = Cluster.objects.create(name="bulk")
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_missing(Node(cluster=cluster), ["name"], [("gpu-001",), (None,)])
    assert not Node.objects.filter(cluster=cluster).exists()


def test_deleting_a_node_deletes_its_gpus() -> None:
    # The GPU table has no foreign key constraint in the database (the first poll's
    # inserts); the ORM's cascade still holds.
    cluster = Cluster.objects.create(name="bulk")
    gone, kept = (Node.objects.create(cluster=cluster, name=n) for n in ("gpu-001", "gpu-002"))
    insert_missing(Gpu(), ["node_id", "index"], [(gone.pk, 0), (gone.pk, 1), (kept.pk, 0)])
    gone.delete()
    assert list(Gpu.objects.values_list("node__name", "index")) == [("gpu-002", 0)]


def test_appended_samples_read_back_as_written_times_and_gaps_included() -> None:
    node = Node.objects.create(cluster=Cluster.objects.create(name="bulk"), name="gpu-001")
    at = timezone.now().replace(microsecond=123456)
    written = append_rows(GpuSample, ["node_id", "gpu_index", "at", "utilization", "temperature"],
                          [(node.pk, 0, at, 55.5, 61.0), (node.pk, 1, at, None, 40.0)])
    assert written == 2
    samples = {s.gpu_index: s for s in GpuSample.objects.filter(node=node)}
    assert (samples[0].at, samples[0].utilization, samples[0].temperature) == (at, 55.5, 61.0)
    assert (samples[1].utilization, samples[1].temperature) == (None, 40.0)
    assert append_rows(GpuSample, ["node_id", "gpu_index", "at"], []) == 0


def test_an_appended_row_for_a_node_that_does_not_exist_is_refused() -> None:
    def append() -> None:
        with transaction.atomic():
            append_rows(GpuSample, ["node_id", "gpu_index", "at"], [(999_999, 0, timezone.now())])
            connection.check_constraints()  # SQLite checks foreign keys only at commit

    with pytest.raises(IntegrityError):
        append()
    assert not GpuSample.objects.exists()
