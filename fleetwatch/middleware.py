"""The edges of every request: its id (the audit trail records it, the response returns it),
input no view can use refused before any view sees it, and the pages' role check."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.deprecation import MiddlewareMixin

from collectors.request_id import HEADER, request_id_clean, request_id_new, request_id_scope
from collectors.roles import AGENT, OPERATE, READ, role_allows, role_of

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
            # A sync chain here (an async one went to _acall): its answer is a response.
            response = cast(HttpResponseBase, self.get_response(request))
        response[HEADER] = value
        return response

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


def _is_api(request: HttpRequest) -> bool:
    return request.path_info.startswith("/api/")


def _refuse(request: HttpRequest, status: int, detail: str) -> HttpResponse:
    # JSON for the API, as all its answers are; plain text for the pages. Never the value
    # itself: it is the bad input, and it could be markup.
    if _is_api(request):
        return JsonResponse({"detail": detail}, status=status)
    return HttpResponse(f"{detail}\n", status=status, content_type="text/plain; charset=utf-8")


def _has_nul(pairs: Any) -> bool:
    return any("\x00" in key or any("\x00" in v for v in values) for key, values in pairs)


class BadInputMiddleware(MiddlewareMixin):
    """Refuses what no view can use, before one tries and fails with a 500:

    - a NUL character in the path (404), the query string or a page's form fields (400):
      PostgreSQL's text cannot hold one, so any lookup with it raised;
    - a chunked body (``Transfer-Encoding: chunked``, no ``Content-Length``): Django reads a
      body only up to its Content-Length, so under gunicorn such a body arrived empty and a
      push looked like an empty batch. 411, asking for the length, instead.

    API bodies are checked by the API's JSON parser (collectors/api/parsers.py), which names
    the bad field.
    """

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        meta = request.META
        if "chunked" in meta.get("HTTP_TRANSFER_ENCODING", "").lower() and not meta.get(
                "CONTENT_LENGTH"):
            return _refuse(request, 411, "chunked request bodies are not read: send the body "
                                         "with a Content-Length header")
        if "\x00" in request.path_info:
            # 404, not 400: no resource has such a name (and the API documents 404 for every
            # path with a name or id in it).
            return _refuse(request, 404, "not found: the URL path contains a NUL character (%00)")
        if _has_nul(request.GET.lists()):
            return _refuse(request, 400, "the query string contains a NUL character (%00)")
        if request.method == "POST" and not _is_api(request):
            try:
                form = request.POST
            except MultiPartParserError:
                return _refuse(request, 400, "the form body could not be read")
            if _has_nul(form.lists()):
                return _refuse(request, 400, "a form field contains a NUL character")
        return None


def public(view: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a view any visitor may open (login, health checks): PageAccessMiddleware lets it
    through. Everything else outside the API and the admin site is a page that needs a role."""
    view.fleetwatch_public = True  # type: ignore[attr-defined]
    return view


class PageAccessMiddleware(MiddlewareMixin):
    """The pages follow the API's role rules (collectors/roles.py): reading needs a
    role (viewer, operator or admin), anything else operator or admin. Anonymous visitors go to
    the login page; a signed-in user without the role gets the 403 page.

    A middleware rather than a decorator on each view, so a new page is covered without anyone
    remembering to: it applies to every view not marked ``public``. The API checks its callers
    itself (tokens, scopes), and the admin site wants staff.
    """

    def process_view(self, request: HttpRequest, view: Callable[..., Any], args: Any,
                     kwargs: Any) -> HttpResponseBase | None:
        match = request.resolver_match
        if getattr(view, "fleetwatch_public", False) or (
                match is not None and (match.namespace == "api" or match.app_name == "admin")):
            return None
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        need = READ if request.method in ("GET", "HEAD", "OPTIONS") else OPERATE
        role = role_of(request.user)
        if not role_allows(role, need):
            raise PermissionDenied(
                "Your account has no role in FleetWatch yet: ask an administrator to make you a "
                "viewer, operator or admin." if role in (None, AGENT) else
                f"This needs an operator or admin; your role is {role}.")
        return None
