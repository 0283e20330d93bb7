"""Logs as the handlers really write them: one JSON object a line, the request id of the
response on the request's lines, one access line per request naming the caller, and no token,
password, session, signature or configured secret anywhere, whatever happens."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
from django.conf import settings as django_settings

from collectors.request_id import request_id_scope
from fleetwatch.logs import logging_config, query_for_log, redact
from tests.conftest import token_for

WEBHOOK_SECRET = "whsec-Zt9xQ2mP4vL8"
SECRET_KEY = "django-secret-key-for-the-log-tests-0123456789"


class Output:
    def __init__(self, stream: io.StringIO) -> None:
        self.stream = stream

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def lines(self) -> list[dict[str, Any]]:
        """Every line, each of which must be one JSON object with the fixed fields."""
        parsed = []
        for line in self.text.splitlines():
            record = json.loads(line)
            assert {"time", "level", "logger", "request_id", "message"} <= set(record), record
            parsed.append(record)
        return parsed

    def access(self, request_id: str) -> dict[str, Any]:
        [line] = [r for r in self.lines()
                  if r["logger"] == "fleetwatch.access" and r["request_id"] == request_id]
        return line


def configure(fmt: str) -> tuple[io.StringIO, Callable[[], None]]:
    stream = io.StringIO()
    config = logging_config(fmt, "DEBUG")
    config["handlers"]["console"]["stream"] = stream
    logging.config.dictConfig(config)
    return stream, lambda: logging.config.dictConfig(django_settings.LOGGING)


@pytest.fixture
def output(settings: Any) -> Iterator[Output]:
    """The project's logging config, writing to a buffer instead of stderr."""
    settings.FLEETWATCH_NOTIFY_WEBHOOK_SECRET = WEBHOOK_SECRET
    settings.SECRET_KEY = SECRET_KEY
    stream, restore = configure("json")
    try:
        yield Output(stream)
    finally:
        restore()


def test_token_request_logged_with_its_request_id_never_its_key(
        output: Output, client: Any, operator: Any) -> None:
    key = token_for(operator, name="ci-bot")
    response = client.get("/api/v1/incidents/?status=open", HTTP_AUTHORIZATION=f"Token {key}")
    assert response.status_code == 200
    line = output.access(response["X-Request-ID"])
    assert line["actor"] == "token:ci-bot"
    assert (line["method"], line["path"], line["status"]) == ("GET", "/api/v1/incidents/", 200)
    assert line["query"] == "status=open" and line["view"] == "api:incident-list"
    assert isinstance(line["duration_ms"], float) and line["level"] == "INFO"
    # An id from a proxy or client is kept and logged as it came.
    response = client.get("/api/v1/nodes/", HTTP_AUTHORIZATION=f"Token {key}",
                          HTTP_X_REQUEST_ID="trace-abc-123")
    assert response["X-Request-ID"] == "trace-abc-123"
    assert output.access("trace-abc-123")["status"] == 200
    assert key not in output.text and key[3:20] not in output.text


def test_session_request_and_login_never_log_password_or_cookie(
        output: Output, client: Any, viewer: Any) -> None:
    response = client.post("/login/", {"username": "victor", "password": "viewer-pass-1"})
    assert response.status_code == 302
    assert output.access(response["X-Request-ID"])["path"] == "/login/"
    session = client.cookies["sessionid"].value
    response = client.get("/api/v1/incidents/?status=open&api_key=hunter2secret&password=pw12345")
    assert response.status_code == 200
    line = output.access(response["X-Request-ID"])
    assert line["actor"] == "user:victor"
    assert "status=open" in line["query"] and "api_key=[redacted]" in line["query"]
    for secret in ("viewer-pass-1", session, "hunter2secret", "pw12345"):
        assert secret not in output.text


def test_wrong_token_is_refused_and_not_logged(output: Output, client: Any, operator: Any) -> None:
    wrong = "fw_" + "0123456789abcdef" * 4
    response = client.get("/api/v1/incidents/", HTTP_AUTHORIZATION=f"Token {wrong}")
    assert response.status_code == 401
    line = output.access(response["X-Request-ID"])
    assert (line["status"], line["actor"]) == (401, "anonymous")
    # Django's own "Unauthorized" line comes after the middleware, and still has the id.
    [warning] = [r for r in output.lines() if r["logger"] == "django.request"]
    assert warning["request_id"] == response["X-Request-ID"]
    response = client.get("/api/v1/incidents/", HTTP_AUTHORIZATION="Bearer eyJhbGciOi.J9x1")
    assert response.status_code in (401, 403)
    assert wrong not in output.text and "0123456789abcdef" not in output.text
    assert "eyJhbGciOi" not in output.text


def test_exception_with_secrets_in_its_message(output: Output) -> None:
    log = logging.getLogger("incidents.webhooks")
    key = "fw_" + "feedbeef" * 8
    with request_id_scope("rid-exception-1"):
        try:
            raise RuntimeError(f"signing failed with {WEBHOOK_SECRET}: Authorization: Token "
                               f"{key} sig=sha256={'ab' * 32} url=https://bot:hunter2@hooks.example/x")
        except RuntimeError:
            log.exception("delivery to %s failed (password=%s)", "https://hooks.example/x",
                          "s3cr3t-pw")
    [line] = output.lines()
    assert line["request_id"] == "rid-exception-1" and line["level"] == "ERROR"
    assert "RuntimeError" in line["exc_info"] and "[redacted]" in line["exc_info"]
    for secret in (WEBHOOK_SECRET, key, "ab" * 32, "hunter2", "s3cr3t-pw", SECRET_KEY):
        assert secret not in output.text


def test_server_error_in_a_request(output: Output, client: Any) -> None:
    client.raise_request_exception = False
    with mock.patch("fleetwatch.metrics.registry_for_scrape",
                    side_effect=RuntimeError(f"cannot sign: {WEBHOOK_SECRET}")):
        response = client.get("/metrics")
    assert response.status_code == 500
    rid = response["X-Request-ID"]
    errors = [r for r in output.lines() if r["logger"] == "django.request"]
    assert errors and errors[0]["request_id"] == rid and "RuntimeError" in errors[0]["exc_info"]
    assert output.access(rid)["level"] == "WARNING"
    assert WEBHOOK_SECRET not in output.text


def test_extra_fields_are_scrubbed_too(output: Output) -> None:
    logging.getLogger("x").info("call", extra={"headers": "Authorization: Bearer abc123def456",
                                               "dsn": "redis://:p4ssw0rd99@cache:6379/0"})
    [line] = output.lines()
    assert "abc123def456" not in line["headers"] and "p4ssw0rd99" not in line["dsn"]


def test_plain_format_is_scrubbed_too(settings: Any) -> None:
    settings.FLEETWATCH_NOTIFY_WEBHOOK_SECRET = WEBHOOK_SECRET
    stream, restore = configure("plain")
    try:
        with request_id_scope("rid-plain"):
            logging.getLogger("x").warning("secret is %s, key Token fw_%s", WEBHOOK_SECRET,
                                           "a1" * 20)
    finally:
        restore()
    text = stream.getvalue()
    assert "[rid-plain]" in text and "WARNING x" in text
    assert WEBHOOK_SECRET not in text and "a1" * 20 not in text


def test_celery_tasks_log_with_their_task_id(output: Output) -> None:
    from celery.signals import task_postrun, task_prerun

    assert django_settings.CELERY_WORKER_HIJACK_ROOT_LOGGER is False
    task_prerun.send(sender=None, task_id="abc-123", task=None)
    try:
        logging.getLogger("celery.task").info("step ran")
    finally:
        task_postrun.send(sender=None, task_id="abc-123", task=None)
    [line] = output.lines()
    assert line["request_id"] == "task:abc-123" and line["logger"] == "celery.task"


@pytest.mark.parametrize(("text", "gone", "kept"), [
    ("Authorization: Token fw_0a1b2c3d4e5f60718293", "0a1b2c3d4e5f", "Authorization"),
    ("headers {'Authorization': 'Bearer x.y.z1'}", "x.y.z1", "Authorization"),
    ('{"password": "hunter2", "user": "olivia"}', "hunter2", '"user": "olivia"'),
    ("GET /api/v1/signals/?token=abc123&cluster=a", "abc123", "cluster=a"),
    ("client_secret=s3cr3t&scope=read", "s3cr3t", "scope=read"),
    ("X-FleetWatch-Signature: sha256=" + "0f" * 32, "0f" * 32, "X-FleetWatch-Signature"),
    ("postgres://fw:dbpass99@db:5432/fleetwatch", "dbpass99", "db:5432/fleetwatch"),
    ("Password: correct-horse", "correct-horse", "Password"),
])
def test_redact(text: str, gone: str, kept: str) -> None:
    clean = redact(text, {})
    assert gone not in clean and kept in clean


@pytest.mark.parametrize("text", [
    "api.call token:ci-bot POST /api/v1/incidents/7/approve/ 200",
    "request 0f5c2a9b8e7d4c3b2a1f0e9d8c7b6a5f done",
    "Token authentication failed: token 'ci-bot' was revoked",
    "incident 42: gpu_hardware on gpu-003, XID 79",
])
def test_redact_keeps_ordinary_text(text: str) -> None:
    assert redact(text, {}) == text


def test_query_for_log() -> None:
    assert query_for_log([("status", "open"), ("access_token", "x"), ("Password", "y")]) == \
        "status=open&access_token=[redacted]&Password=[redacted]"
