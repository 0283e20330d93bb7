"""Request ids: every request gets one, the audit trail records it, the response returns it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase

from fleetwatch.request_id import HEADER, request_id_clean, request_id_new, request_id_scope

GetResponse = Callable[[HttpRequest], HttpResponseBase]
AsyncGetResponse = Callable[[HttpRequest], Awaitable[HttpResponseBase]]


class RequestIdMiddleware:
    """Takes a sane incoming ``X-Request-ID`` (so one id follows a call from a proxy or a
    client through to our audit trail) or makes one, holds it in the request-id contextvar for
    the whole request and sends it back in the response.

    First in MIDDLEWARE, so everything after it, views and other middleware, sees the id.
    Sync and async capable, so an ASGI deployment does not pay for a thread hop here.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: GetResponse | AsyncGetResponse) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.is_async:
            return self._acall(request)
        value = self._request_id(request)
        with request_id_scope(value):
            response = self.get_response(request)
        response[HEADER] = value
        return response  # type: ignore[return-value]

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        value = self._request_id(request)
        with request_id_scope(value):
            response = await self.get_response(request)  # type: ignore[misc]
        response[HEADER] = value
        return response

    @staticmethod
    def _request_id(request: HttpRequest) -> str:
        value = request_id_clean(request.headers.get(HEADER)) or request_id_new()
        request.request_id = value  # type: ignore[attr-defined]  # for views and templates
        return value
