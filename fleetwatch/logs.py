"""Logs: one JSON object a line (or plain text), every line carrying the request id, secrets
scrubbed before any handler writes them, and one access line per request.

``logging_config()`` is the whole configuration: settings.py uses it for Django (web, Celery
workers, management commands) and deploy/gunicorn.conf.py for gunicorn's own master, so every
process of a deployment writes the same format through the same filters.

Nothing here may touch Django's settings or models at import time: settings.py imports it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode, urlsplit

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

from collectors.redaction import redact_url
from collectors.request_id import current_request_id

REDACTED = "[redacted]"

# --- redaction ---------------------------------------------------------------------------------

# Names whose values are credentials, in key=value, "key": "value" and "key: value" forms.
# ``token`` alone is left out of the "key: value" form: "token:NAME" is how the audit trail and
# the access log name a caller, and a token's name is not a secret.
_SECRET_NAME = (r"[\w-]*(?:password|passwd|secret|token|api[_-]?key|access[_-]?key|"
                r"private[_-]?key|signature|sessionid|csrftoken|credentials?|authorization|"
                r"cookie)[\w-]*")
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Authorization header values: "Token fw_...", "Bearer eyJ...", "Basic dXNlcjpwYXNz".
    # The value must hold a digit, so prose such as "Token authentication failed" survives.
    (re.compile(r"\b(Token|Bearer|Basic)(\s+)(?=[^\s]*\d)[A-Za-z0-9._~+/=-]{8,}", re.I),
     rf"\1\2{REDACTED}"),
    # django-rest-knox keys (REST_KNOX's TOKEN_PREFIX), wherever they turn up.
    (re.compile(r"\bfw_[A-Za-z0-9]{8,}"), f"fw_{REDACTED}"),
    # HMAC signatures as our webhooks send them (X-FleetWatch-Signature: sha256=<hex>).
    (re.compile(r"\b(sha1|sha256|sha512)=[0-9a-fA-F]{16,}"), rf"\1={REDACTED}"),
    # "name": "value" and 'name': 'value' (JSON bodies, dict reprs, header dicts).
    (re.compile(rf"""(["'])({_SECRET_NAME})\1(\s*:\s*)(["'])(?:(?!\4).)*\4""", re.I),
     rf"\1\2\1\3\4{REDACTED}\4"),
    # name=value (query strings, form bodies, logfmt, DSNs in messages).
    (re.compile(rf"\b({_SECRET_NAME})=([^\s&;,'\"]+)", re.I), rf"\1={REDACTED}"),
    # "Password: x", "Authorization: Token ...", "X-FleetWatch-Signature: ..." in prose.
    (re.compile(r"\b((?:[\w-]*(?:password|passwd|secret|signature))|authorization)(\s*:\s*)(\S+)",
                re.I), rf"\1\2{REDACTED}"),
]
# URLs with a user (and usually a password) in them: redis://:pw@host, https://u:p@hook.
_URL_WITH_CREDENTIALS = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/@'\"<>]+@[^\s'\"<>]*")

# Settings (and, outside Django, environment variables) whose values are secrets: they are
# replaced wherever they appear, whatever the words around them.
SECRET_SETTINGS = ("SECRET_KEY", "FLEETWATCH_NOTIFY_WEBHOOK_SECRET", "EMAIL_HOST_PASSWORD",
                   "FLEETWATCH_PROMETHEUS_TOKEN", "FLEETWATCH_METRICS_TOKEN",
                   "FLEETWATCH_AUDIT_CHECKPOINT_KEY")
# URLs whose password, query string or (for Slack-style hooks) path is the secret.
SECRET_URL_SETTINGS = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "FLEETWATCH_CACHE_URL",
                       "FLEETWATCH_NOTIFY_SLACK_URL", "FLEETWATCH_NOTIFY_WEBHOOK_URL")
_MIN_SECRET = 6  # shorter "secrets" would blank out ordinary words


def _configured(name: str) -> str:
    """A setting's value when Django is configured, else the environment variable's (gunicorn's
    master logs before any settings are loaded)."""
    from django.conf import settings

    if settings.configured:
        return str(getattr(settings, name, "") or "")
    return os.environ.get(name, "")


def known_secrets() -> dict[str, str]:
    """Each configured secret (and each secret part of a configured URL) -> what to show."""
    found: dict[str, str] = {}
    for name in SECRET_SETTINGS:
        value = _configured(name)
        if len(value) >= _MIN_SECRET:
            found[value] = REDACTED
    for name in SECRET_URL_SETTINGS:
        url = _configured(name)
        parts = urlsplit(url)
        if parts.password and len(parts.password) >= _MIN_SECRET:
            found[parts.password] = REDACTED
        if parts.query and len(parts.query) >= _MIN_SECRET:
            found[parts.query] = REDACTED
        if name == "FLEETWATCH_NOTIFY_SLACK_URL" and len(parts.path) > 1:
            found[url] = redact_url(url, keep_path=False)  # the hook's path is its key
    return found


def redact(text: str, secrets: dict[str, str] | None = None) -> str:
    """``text`` without anything that looks like a credential."""
    if not text:
        return text
    for secret, shown in sorted((secrets if secrets is not None else known_secrets()).items(),
                                key=lambda item: len(item[0]), reverse=True):
        if secret in text:
            text = text.replace(secret, shown)
    if "://" in text and "@" in text:
        text = _URL_WITH_CREDENTIALS.sub(lambda m: redact_url(m.group(0)), text)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


# A LogRecord's own attributes; anything else on it came from ``extra=`` and is written out.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "request_id"}


class RedactFilter(logging.Filter):
    """On every handler: rewrites a record's message, extra fields, traceback and stack so no
    handler (JSON, plain, or one a site adds) can write a credential.

    The traceback is formatted and scrubbed here and ``exc_info`` dropped, because formatters
    would otherwise format it again from the exception object, secrets included."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = known_secrets()
        try:
            message = record.getMessage()
        except Exception:  # bad %-args: let the handler report it as logging does
            return True
        clean = redact(message, secrets)
        if clean != message or record.args:
            record.msg, record.args = clean, ()
        if record.exc_info:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_text, record.exc_info = redact(text, secrets), None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text, secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, secrets)
        for key, value in list(vars(record).items()):
            if key not in _RECORD_ATTRS and isinstance(value, str):
                setattr(record, key, redact(value, secrets))
        return True


class RequestIdFilter(logging.Filter):
    """Stamps the id of the request or Celery task being served on every record.

    Django logs a 4xx/5xx answer (django.request, "Not Found: ...") after the middleware
    chain has returned, outside the id's scope; that record carries the request, and
    RequestIdMiddleware left the id on it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = current_request_id() or str(
                getattr(getattr(record, "request", None), "request_id", "") or "")
        return True


# --- formatters --------------------------------------------------------------------------------


class JsonFormatter(_JsonFormatter):
    """``{"time", "level", "logger", "request_id", "message", ...extra fields, "exc_info"}``.

    The final line is scrubbed again: a record that reached this formatter without passing
    RedactFilter (a handler someone added by hand) still writes no configured secret."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("json_ensure_ascii", False)
        super().__init__("%(message)s", **kwargs)

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord,
                   message_dict: dict[str, Any]) -> None:
        log_data["time"] = datetime.fromtimestamp(record.created, UTC).isoformat(
            timespec="milliseconds").replace("+00:00", "Z")
        log_data["level"] = record.levelname
        log_data["logger"] = record.name
        log_data["request_id"] = getattr(record, "request_id", None) or current_request_id()
        super().add_fields(log_data, record, message_dict)

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class PlainFormatter(logging.Formatter):
    """Text for people at a terminal (FLEETWATCH_LOG_FORMAT=plain; `make run` on a terminal),
    equally scrubbed: ``12:04:31 INFO    celery.beat: message [request id]``. The request or
    task id comes last, and only when there is one, so the message starts at a steady place."""

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None) or current_request_id()
        record.request_id = request_id  # a format may name it
        record.request_tag = f" [{request_id}]" if request_id else ""
        return redact(super().format(record))


PLAIN_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s%(request_tag)s"
# Routine lines a terminal does not need at INFO: each task received and finished, each beat
# tick (every few seconds in the demo), kombu's "No hostname was supplied" for the filesystem
# broker. Failures still show (a failed task is an ERROR of celery.app.trace); JSON logs keep
# them all, and LOG_LEVEL=DEBUG brings them back here too.
# Beat's own start ("beat: Starting...") and errors stay: only its ticks are dropped
# (BeatTickFilter), not the logger.
PLAIN_QUIET = {"celery.worker.strategy": "WARNING", "celery.app.trace": "WARNING",
               "kombu.connection": "ERROR"}


class BeatTickFilter(logging.Filter):
    """Drops beat's "Scheduler: Sending due task ..." lines (one per task, every few seconds)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Scheduler: Sending due task")


def logging_config(fmt: str = "json", level: str = "INFO", *,
                   gunicorn: bool = False) -> dict[str, Any]:
    """The ``LOGGING`` dict: one stream handler on stderr, scrubbed, for everything.

    ``gunicorn=True`` adds gunicorn's own loggers (its master and workers' lifecycle); its
    access log is silenced because RequestLogMiddleware writes a better one (actor, request
    id, no query-string secrets)."""
    handler = {"class": "logging.StreamHandler", "formatter": fmt,
               "filters": ["request_id", "redact"]}
    loggers: dict[str, Any] = {
        # Django's defaults give these handlers of their own (runserver's request lines carry
        # the query string); send them through ours instead.
        "django": {"handlers": [], "level": level, "propagate": True},
        "django.server": {"handlers": [], "level": level, "propagate": True},
        # Celery gives its task logger a handler and formatter of its own unless it has one;
        # with CELERY_WORKER_HIJACK_ROOT_LOGGER off, the root handler below is left alone.
        "celery.task": {"handlers": ["console"], "level": level, "propagate": False},
        "fleetwatch.access": {"level": level},
        # The audit trail's signed checkpoints are written whatever the level: a quieter log
        # must not drop the copy of the head kept outside the database (incidents/audit.py).
        "fleetwatch.audit": {"level": "INFO"},
    }
    if fmt == "plain" and logging.getLevelName(level) == logging.INFO:
        loggers.update({name: {"level": quiet} for name, quiet in PLAIN_QUIET.items()})
        loggers["celery.beat"] = {"filters": ["beat_ticks"]}
    if gunicorn:
        loggers["gunicorn.error"] = {"handlers": ["console"], "level": level, "propagate": False}
        loggers["gunicorn.access"] = {"handlers": ["null"], "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "request_id": {"()": "fleetwatch.logs.RequestIdFilter"},
            "redact": {"()": "fleetwatch.logs.RedactFilter"},
            "beat_ticks": {"()": "fleetwatch.logs.BeatTickFilter"},
        },
        "formatters": {
            "json": {"()": "fleetwatch.logs.JsonFormatter"},
            "plain": {"()": "fleetwatch.logs.PlainFormatter", "format": PLAIN_FORMAT,
                      "datefmt": "%H:%M:%S"},
        },
        "handlers": {"console": handler, "null": {"class": "logging.NullHandler"}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": loggers,
    }


# --- the access log ----------------------------------------------------------------------------

access_log = logging.getLogger("fleetwatch.access")

# Polled all day by load balancers and Prometheus, or served by WhiteNoise: DEBUG, not INFO.
_QUIET_PREFIXES = ("/healthz", "/metrics", "/static/")
_SECRET_PARAM = re.compile(_SECRET_NAME, re.I)
_QUERY_MAX = 300

GetResponse = Callable[[Any], Any]


def query_for_log(pairs: Iterable[tuple[str, str]]) -> str:
    """A query string fit for a log line: values of credential-like parameters replaced."""
    shown = [(k, REDACTED if _SECRET_PARAM.fullmatch(k) else v) for k, v in pairs]
    text = urlencode(shown, safe="[]/,:")
    return text if len(text) <= _QUERY_MAX else text[: _QUERY_MAX - 1] + "…"


def _actor(request: Any) -> str:
    """The caller as the audit trail names it (``user:NAME``, ``token:NAME``), so an access
    line and the audit entries of the same request name the same caller."""
    # Here, not at the top: settings.py imports this module, before the auth models can load.
    from collectors.roles import actor_from_request

    if getattr(request, "user", None) is None:  # answered before authentication (static files)
        return "anonymous"
    actor = actor_from_request(request)
    return "anonymous" if actor == "system" else actor


def _view(request: Any) -> str:
    """The URL pattern's name: few and fixed, so a fit label for metrics (never the path)."""
    match = getattr(request, "resolver_match", None)
    if match is not None:
        return match.view_name
    if request.path.startswith("/static/"):
        return "static"
    return "unmatched"


class RequestLogMiddleware:
    """One ``fleetwatch.access`` line per request (method, path, status, duration, actor,
    request id; never headers, cookies or bodies) and the request's HTTP metrics.

    Second in MIDDLEWARE, right after RequestIdMiddleware: inside the request id's scope, and
    outside everything else, so it sees the answer any later middleware gives (a CSRF refusal,
    a redirect to the login page) and times the whole request."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: GetResponse) -> None:
        from fleetwatch.metrics import http_observe

        self.get_response = get_response
        self.observe = http_observe
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: Any) -> Any:
        if self.is_async:
            return self._acall(request)
        started = time.perf_counter()
        response = self.get_response(request)
        self._done(request, response, time.perf_counter() - started)
        return response

    async def _acall(self, request: Any) -> Any:
        started = time.perf_counter()
        response = await self.get_response(request)
        self._done(request, response, time.perf_counter() - started)
        return response

    def _done(self, request: Any, response: Any, seconds: float) -> None:
        view = _view(request)
        status = response.status_code
        self.observe(request.method or "", view, status, seconds)
        path = request.path
        if status >= 500:
            level = logging.WARNING  # django.request logs the traceback at ERROR
        elif path.startswith(_QUIET_PREFIXES):
            level = logging.DEBUG
        else:
            level = logging.INFO
        if not access_log.isEnabledFor(level):
            return
        duration_ms = round(seconds * 1000, 1)
        extra = {"method": request.method, "path": path, "status": status,
                 "duration_ms": duration_ms, "view": view, "actor": _actor(request),
                 "remote_addr": request.META.get("REMOTE_ADDR", "")}
        if request.GET:
            extra["query"] = query_for_log(request.GET.items())
        access_log.log(level, "%s %s %d %.1fms", request.method, path, status, duration_ms,
                       extra=extra)

