"""How the API pages its lists.

Most lists are small and change slowly: limit/offset, with a total ``count``. Signals and the
audit trail grow without end and are read by programs that follow them: keyset ("cursor")
pagination, whose pages stay stable while rows are appended and whose cost does not grow
with the offset.

The cursor carries the *whole* ordering key of the row it stopped at (for signals
``observed_at`` and ``id``), and the next page is the rows strictly after that key
(``observed_at > t OR (observed_at = t AND id > i)``). DRF's CursorPagination positions on the
first ordering field only and falls back to an offset capped at 1,000 rows: an agent stamps
a whole pass with one time, so a run of more than a page of rows sharing one ``observed_at``
made it repeat pages and never end. A unique key has no ties, so no offset is ever needed.
"""

from __future__ import annotations

import json
from base64 import b64decode, b64encode
from datetime import UTC, datetime
from typing import Any, cast
from urllib import parse

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Q, QuerySet
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import CursorPagination, LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.utils.urls import replace_query_param

# The most rows one page may ask for (?limit= / ?page_size=): a bigger value is cut to this.
MAX_PAGE = 1000


class LimitOffset(LimitOffsetPagination):
    # A bad ?limit= or ?offset= (negative, not a number) falls back to the default: DRF
    # already does that; only the cap is ours.
    max_limit = MAX_PAGE


def _keyset_after(ordering: tuple[str, ...], position: list[Any], *, before: bool) -> Q:
    """Rows strictly after ``position`` in ``ordering`` (strictly before with ``before``):
    (a > x) OR (a = x AND b > y) OR ... for the fields in order, each compared in its own
    direction."""
    condition = Q()
    equal: dict[str, Any] = {}
    for field, value in zip(ordering, position, strict=True):
        name = field.lstrip("-")
        descending = field.startswith("-")
        lookup = "lt" if descending != before else "gt"
        condition |= Q(**equal, **{f"{name}__{lookup}": value})
        equal[name] = value
    return condition


class _Cursor(CursorPagination):
    """Keyset pagination on ``ordering``, which must end in a unique field (``id``)."""

    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = MAX_PAGE
    invalid_cursor_message = "invalid cursor: pass back the `next` or `previous` link as given"
    ordering: tuple[str, ...] = ("id",)
    # Our positions are the whole ordering key (a list), not DRF's one-field string.
    next_position: list[Any] | None  # type: ignore[assignment]
    previous_position: list[Any] | None  # type: ignore[assignment]

    def _invalid(self) -> ValidationError:
        # DRF answers a bad cursor with 404, which reads as "no such list"; it is bad input.
        return ValidationError({self.cursor_query_param: [self.invalid_cursor_message]})

    # The cursor is ``(reverse, position)``, not DRF's (offset, reverse, position) Cursor:
    # every DRF method that reads or writes one is overridden here.
    def decode_cursor(  # type: ignore[override]
            self, request: Request) -> tuple[bool, list[Any] | None] | None:
        """``(reverse, position)`` from ``?cursor=``: base64 of ``r=0|1&p=<json list>``."""
        encoded = request.query_params.get(self.cursor_query_param)
        if encoded is None:
            return None
        try:
            tokens = parse.parse_qs(b64decode(encoded.encode("ascii"), validate=True)
                                    .decode("ascii"), strict_parsing=True)
            reverse = tokens.get("r", ["0"])[0]
            raw = tokens.get("p", [None])[0]
            position = None if raw is None else json.loads(raw)
        except (TypeError, ValueError, UnicodeError):
            raise self._invalid() from None
        if reverse not in ("0", "1") or not (
                position is None or (isinstance(position, list)
                                     and len(position) == len(self.ordering)
                                     and all(isinstance(v, (str, int)) for v in position))):
            raise self._invalid()
        return reverse == "1", position

    def encode_cursor(self, cursor: tuple[bool, list[Any] | None]) -> str:  # type: ignore[override]
        reverse, position = cursor
        tokens = {"r": "1" if reverse else "0"}
        if position is not None:
            tokens["p"] = json.dumps(position, separators=(",", ":"))
        encoded = b64encode(parse.urlencode(tokens).encode("ascii")).decode("ascii")
        # base_url is set by paginate_queryset, before any link is made.
        return replace_query_param(cast(str, self.base_url), self.cursor_query_param, encoded)

    def _position(self, row: Any) -> list[Any]:
        values = []
        for field in self.ordering:
            name = field.lstrip("-")
            value = row[name] if isinstance(row, dict) else getattr(row, name)
            values.append(value.isoformat() if isinstance(value, datetime) else value)
        return values

    def _typed(self, queryset: QuerySet[Any], position: list[Any]) -> list[Any]:
        """The position's values as their fields' types: times in UTC (PostgreSQL refuses an
        offset past 15:59 that ISO 8601 allows), whole numbers within 64 bits."""
        values = []
        for field_name, raw in zip(self.ordering, position, strict=True):
            value = queryset.model._meta.get_field(field_name.lstrip("-")).to_python(raw)
            if isinstance(value, datetime):
                if value.tzinfo is None:
                    raise ValueError("a time without its offset")
                value = value.astimezone(UTC)
            elif isinstance(value, int) and not -(2 ** 63) <= value < 2 ** 63:
                raise OverflowError("beyond 64 bits")
            values.append(value)
        return values

    def get_ordering(self, request: Request, queryset: QuerySet[Any],
                     view: Any = None) -> tuple[str, ...]:
        return tuple(self.ordering)  # the key is fixed: no ?ordering= for these lists

    # Querysets only (the base allows any sequence): keyset pages need ORDER BY and WHERE.
    def paginate_queryset(self, queryset: QuerySet[Any], request: Request,  # type: ignore[override]
                          view: Any = None) -> list[Any] | None:
        self.request = request
        # page_size is set above, so this is always a number.
        self.page_size = cast(int, self.get_page_size(request))
        self.base_url = request.build_absolute_uri()
        cursor = self.decode_cursor(request)
        reverse, position = cursor if cursor is not None else (False, None)
        order = [f[1:] if f.startswith("-") else f"-{f}" for f in self.ordering] if reverse \
            else list(self.ordering)
        queryset = queryset.order_by(*order)
        # A position edited by hand to the wrong type fails when it is read as the field's
        # type, when the filter is built or when the query runs.
        try:
            if position is not None:
                position = self._typed(queryset, position)
                queryset = queryset.filter(_keyset_after(self.ordering, position, before=reverse))
            rows = list(queryset[:self.page_size + 1])
        except (DjangoValidationError, ValueError, TypeError, OverflowError):
            raise self._invalid() from None
        more = len(rows) > self.page_size
        self.page = rows[:self.page_size]
        if reverse:
            self.page.reverse()
        # Forward: more rows after the page means a next page; we came from somewhere (a
        # position) means a previous one. Backward: the same, mirrored.
        self.has_next = more if not reverse else position is not None
        self.has_previous = position is not None if not reverse else more
        self.next_position = self._position(self.page[-1]) if self.page else None
        self.previous_position = self._position(self.page[0]) if self.page else None
        self.display_page_controls = self.has_next or self.has_previous
        return self.page

    def get_next_link(self) -> str | None:
        if not self.has_next:
            return None
        # An empty page reached backwards: the rows after it are the list from its start.
        return self.encode_cursor((False, self.next_position))

    def get_previous_link(self) -> str | None:
        if not self.has_previous:
            return None
        # An empty page reached forwards: the rows before it are the list's end.
        return self.encode_cursor((True, self.previous_position))

    # The stubs say the links are str; DRF's own are None when there is no page either.
    def get_html_context(self) -> dict[str, Any]:  # type: ignore[override]
        return {"previous_url": self.get_previous_link(), "next_url": self.get_next_link()}


class SignalCursor(_Cursor):
    # Oldest first, as they were observed: a program follows the `next` link to the tail.
    # ``id`` breaks ties between rows stamped with one time.
    ordering = ("observed_at", "id")


class AuditCursor(_Cursor):
    # The chain's own order (ids are unique: one field is the whole key).
    ordering = ("id",)
