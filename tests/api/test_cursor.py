"""Cursor pages of signals and of the audit trail: every row once, in order, and an end.

Agents stamp a whole pass with one time, so runs of rows sharing one ``observed_at`` longer
than a page are normal; the cursor must still move on (it carries ``id`` as a tie-breaker)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from collectors.models import Signal
from collectors.roles import OPERATOR, user_with_role
from incidents.audit import audit_record
from tests.conftest import rerun_on_sqlite, token_for


@pytest.fixture
def api(db: None, settings: Any) -> APIClient:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Token {token_for(user_with_role('cursor-op', OPERATOR)[0])}")
    return client


def _signals(times: list[Any]) -> list[int]:
    from collectors import services as collectors

    cluster = collectors.cluster_default()
    rows = Signal.objects.bulk_create([
        Signal(cluster=cluster, source="kernel", kind="pushed_kernel", node_name="gpu-001",
               message=f"line {i}", observed_at=at) for i, at in enumerate(times)])
    return [s.pk for s in rows]


def _follow(api: APIClient, url: str, link: str = "next") -> tuple[list[list[int]], Any]:
    """Every page from ``url`` on, following ``link``; stops at the end (or after 100 pages,
    which only a cursor that never ends reaches)."""
    pages: list[list[int]] = []
    body: Any = None
    while url and len(pages) < 100:
        response = api.get(url)
        assert response.status_code == 200, response.content
        body = response.json()
        pages.append([row["id"] for row in body["results"]])
        url = body[link]
    return pages, body


def test_more_than_a_page_sharing_one_time_pages_to_the_end(api: APIClient) -> None:
    at = timezone.now() - timedelta(minutes=5)
    ids = _signals([at] * 1200)
    pages, last = _follow(api, "/api/v1/signals/?page_size=100")
    assert [len(p) for p in pages] == [100] * 12
    seen = [i for page in pages for i in page]
    assert seen == sorted(ids) and len(set(seen)) == 1200
    assert last["next"] is None and last["previous"]
    # And back again from the last page: the same rows, the first page has no previous.
    back, first = _follow(api, last["previous"], "previous")
    assert [i for page in reversed(back) for i in page] == sorted(ids)[:1100]
    assert first["previous"] is None and first["next"]


def test_mixed_times_come_in_time_then_id_order(api: APIClient) -> None:
    base = timezone.now() - timedelta(hours=1)
    # Runs of equal times (longer and shorter than a page), interleaved out of id order.
    times = ([base + timedelta(seconds=30)] * 7 + [base] * 13 + [base + timedelta(seconds=10)]
             + [base + timedelta(seconds=30, microseconds=1)] * 4)
    ids = _signals(times)
    order = [i for _, i in sorted(zip(times, ids, strict=True))]
    pages, last = _follow(api, "/api/v1/signals/?page_size=5")
    assert [i for page in pages for i in page] == order
    assert [len(p) for p in pages] == [5, 5, 5, 5, 5] and last["next"] is None
    # A filter keeps applying on every page.
    since = (base + timedelta(seconds=10)).isoformat()
    later, _ = _follow(api, f"/api/v1/signals/?page_size=3&since={since.replace('+', '%2B')}")
    assert [i for page in later for i in page] == order[13:]
    # A row stamped with the same time as the last ones but added later comes after them.
    extra = _signals([base + timedelta(seconds=30, microseconds=1)])
    again, _ = _follow(api, "/api/v1/signals/?page_size=5")
    assert [i for page in again for i in page] == [*order, *extra]


def test_audit_pages_every_entry_once(api: APIClient) -> None:
    for i in range(25):
        audit_record("test.page", f"entry {i}")
    pages, last = _follow(api, "/api/v1/audit/?verb=test.page&page_size=10")
    seen = [i for page in pages for i in page]
    assert [len(p) for p in pages] == [10, 10, 5] and seen == sorted(seen)
    assert len(set(seen)) == 25 and last["next"] is None


@pytest.mark.parametrize("cursor", [
    "garbage", "cD0xMA==",  # p=10: one value for a two-part key
    "cj0xJnA9WyJ5ZXN0ZXJkYXkiLDFd",  # r=1&p=["yesterday",1]
    "cj0wJnA9WyIyMDI2LTAxLTAxVDAwOjAwOjAwKzAwOjAwIiwieCJd",  # an id that is not a number
    "cj0yJnA9W10=",  # r=2&p=[]
    "cj0wJnA9WyI5OTk5LTEyLTMxVDIzOjU5OjU5LTIzOjU5IiwxXQ==",  # an offset PostgreSQL cannot store
    "cj0wJnA9WyIyMDI2LTAxLTAxVDAwOjAwOjAwIiwxXQ==",  # a time without its offset
    # an id beyond 64 bits
    "cj0wJnA9WyIyMDI2LTAxLTAxVDAwOjAwOjAwJTJCMDA6MDAiLDEwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMF0=",
    "cj0wJnA9WyJcdTAwMDAiLDFd",  # a NUL
])
def test_tampered_cursors_answer_400(api: APIClient, cursor: str) -> None:
    response = api.get(f"/api/v1/signals/?cursor={cursor}")
    assert response.status_code == 400 and "cursor" in response.json()


@pytest.mark.skipif(connection.vendor == "sqlite", reason="this run is the SQLite one")
def test_the_same_on_sqlite(tmp_path: Path) -> None:
    # The embedded demo's database compares times as text: run this file's tests on it too.
    rerun_on_sqlite(__file__, tmp_path, "not the_same_on_sqlite")
