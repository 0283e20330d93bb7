"""How the API pages its lists.

Most lists are small and change slowly: limit/offset, with a total ``count``. Signals and the
audit trail grow without end and are read by programs that follow them: cursor pagination,
whose pages stay stable while rows are appended and whose cost does not grow with the offset.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import CursorPagination, LimitOffsetPagination
from rest_framework.request import Request

# The most rows one page may ask for (?limit= / ?page_size=): a bigger value is cut to this.
MAX_PAGE = 1000


class LimitOffset(LimitOffsetPagination):
    # A bad ?limit= or ?offset= (negative, not a number) falls back to the default: DRF
    # already does that; only the cap is ours.
    max_limit = MAX_PAGE


class _Cursor(CursorPagination):
    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = MAX_PAGE
    invalid_cursor_message = "invalid cursor: pass back the `next` or `previous` link as given"

    def decode_cursor(self, request: Request) -> Any:
        # DRF answers a bad cursor with 404, which reads as "no such list"; it is bad input.
        try:
            return super().decode_cursor(request)
        except NotFound:
            raise ValidationError({self.cursor_query_param: [self.invalid_cursor_message]}) from None

    def paginate_queryset(self, queryset: QuerySet[Any], request: Request,
                          view: Any = None) -> list[Any] | None:
        # A cursor that decodes but carries a position of the wrong type (edited by hand)
        # fails only when the page's query runs.
        try:
            return super().paginate_queryset(queryset, request, view)
        except (DjangoValidationError, ValueError, TypeError, OverflowError):
            raise ValidationError({self.cursor_query_param: [self.invalid_cursor_message]}) from None


class SignalCursor(_Cursor):
    # Oldest first, as they were observed: a program follows the `next` link to the tail.
    ordering = ("observed_at", "id")


class AuditCursor(_Cursor):
    # The chain's own order.
    ordering = ("id",)
