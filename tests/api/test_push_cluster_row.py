"""A push reads its cluster's row once per process (collectors.services._push_nodes): the
row is made once and never changes. A kept row that is not the cluster's any more (deleted, as
a test's rollback leaves it, or its id given to another cluster, as SQLite may after a
rollback) is noticed by the push's node look-up, made by the cluster's name, and read again:
the push is stored on the cluster as it is now, never on another one."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from collectors import services as collectors
from collectors.models import Cluster, Node, Signal
from collectors.sim.fleet import SimFleet
from incidents.tokens import agent_token_create

pytestmark = pytest.mark.django_db

LINE = "NVRM: GPU at PCI:0000:8a:00: GPU-1e2f3a4b-0000-1111-2222-333344445555"


def push(token: str) -> Any:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return api.post("/api/v1/signals/", {"signals": [
        {"at": "2026-12-05T10:00:00Z", "source": "kernel", "node": "gpu-001",
         "message": LINE}]}, format="json")


def test_a_push_reads_the_cluster_once_and_again_when_its_row_is_gone(
        sim_fleet: SimFleet) -> None:
    collectors.collect_source("slurm")
    token = agent_token_create("gpu-001")[1]
    assert push(token).status_code == 201
    with CaptureQueriesContext(connection) as queries:
        assert push(token).status_code == 201
    # The node look-up joins the cluster by name; no statement reads the cluster's row.
    assert not any('FROM "collectors_cluster"' in q["sql"] for q in queries.captured_queries)
    assert any('JOIN "collectors_cluster"' in q["sql"] for q in queries.captured_queries)

    old = Cluster.objects.get()
    Cluster.objects.all().delete()  # its nodes and signals with it
    collectors.collect_source("slurm")  # the cluster and its nodes, made again
    new = Cluster.objects.get()
    assert new.pk != old.pk and Node.objects.filter(name="gpu-001", cluster=new).exists()
    answer = push(token)
    assert answer.status_code == 201, answer.content
    assert list(Signal.objects.filter(message=LINE).values_list("cluster_id", flat=True)) == [
        new.pk]


def test_a_kept_row_whose_id_is_another_clusters_is_read_again(sim_fleet: SimFleet) -> None:
    collectors.collect_source("slurm")
    token = agent_token_create("gpu-001")[1]
    assert push(token).status_code == 201
    mine = Cluster.objects.get()
    other = Cluster.objects.create(name="other")
    Node.objects.create(cluster=other, name="gpu-001")  # the same node names, as sims have
    # The kept row now says the default cluster is the other one's id.
    collectors._push_clusters[mine.name] = Cluster(pk=other.pk, name=mine.name)
    answer = push(token)
    assert answer.status_code == 201, answer.content
    assert not Signal.objects.filter(cluster=other).exists()
    assert Signal.objects.filter(cluster=mine, message=LINE).count() == 2
    assert collectors._push_clusters[mine.name].pk == mine.pk


def test_a_push_naming_an_unknown_node_is_still_refused(sim_fleet: SimFleet) -> None:
    collectors.collect_source("slurm")
    token = agent_token_create("gpu-404")[1]
    answer = push(token)  # the agent of a node FleetWatch does not know pushes for gpu-001
    assert answer.status_code == 403, answer.content
    result = collectors.signals_ingest(collectors.cluster_default().name, [
        {"at": "2026-12-05T10:00:00Z", "source": "kernel", "node": "gpu-001",
         "message": LINE}])
    assert result.stored == 1
    with pytest.raises(collectors.IngestRejected, match=r"unknown node.*gpu-404"):
        collectors.signals_ingest(collectors.cluster_default().name, [
            {"at": "2026-12-05T10:00:00Z", "source": "kernel", "node": "gpu-404",
             "message": LINE}])
