"""Production security settings come from the environment (README, "Running in production"):
with the documented variables ``manage.py check --deploy`` is clean; without them ``make run``
works on plain http. Every page carries a Content-Security-Policy that allows only its own
assets and no inline script, and no page has one."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from collectors.roles import OPERATOR, user_with_role
from tests.api.world import World, build_world
from tests.unit.test_page_access import _url, page_patterns

ROOT = Path(__file__).resolve().parent.parent.parent
# What the README tells a production deployment to set (besides its database and broker).
PRODUCTION = {
    "FLEETWATCH_HTTPS": "true",
    "SECURE_HSTS_PRELOAD": "true",
    "ALLOWED_HOSTS": "fleetwatch.example.org",
    "CSRF_TRUSTED_ORIGINS": "https://fleetwatch.example.org",
    "SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto",
}


def _run(tmp_path: Path, extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECURE_", "FLEETWATCH_"))}
    env.update({"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
                "FLEETWATCH_DATA_DIR": str(tmp_path / "data"), **extra})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_check_deploy_is_clean_with_the_production_variables(tmp_path: Path) -> None:
    done = _run(tmp_path, {**PRODUCTION, "SECRET_KEY": secrets.token_urlsafe(60)},
                "manage.py", "check", "--deploy", "--fail-level", "WARNING")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout


def test_check_deploy_names_what_is_missing_without_them(tmp_path: Path) -> None:
    done = _run(tmp_path, {}, "manage.py", "check", "--deploy", "--fail-level", "WARNING")
    assert done.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in done.stderr + done.stdout, warning


def test_the_variables_reach_the_settings(tmp_path: Path) -> None:
    code = ("import django, json; django.setup(); from django.conf import settings as s; "
            "print(json.dumps([s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS, "
            "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_PROXY_SSL_HEADER, "
            "s.CSRF_TRUSTED_ORIGINS, s.SECURE_HSTS_PRELOAD]))")
    extra = {"DJANGO_SETTINGS_MODULE": "fleetwatch.settings"}
    on = _run(tmp_path, {**extra, **PRODUCTION, "SECURE_HSTS_SECONDS": "600"}, "-c", code)
    assert json.loads(on.stdout) == [True, 600, True, True, ["HTTP_X_FORWARDED_PROTO", "https"],
                                     ["https://fleetwatch.example.org"], True], on.stderr
    off = _run(tmp_path, extra, "-c", code)  # make run: plain http on 127.0.0.1
    assert json.loads(off.stdout) == [False, 0, False, False, None, [], False], off.stderr
    bad = _run(tmp_path, {**extra, "FLEETWATCH_HTTPS": "maybe"}, "-c", code)
    assert bad.returncode != 0 and "FLEETWATCH_HTTPS='maybe' is not a boolean" in bad.stderr


def test_https_redirects_and_hsts_behind_the_proxy(db: None, settings: Any) -> None:
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS = 3600
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    client = Client()
    plain = client.get("/login/")
    assert plain.status_code == 301 and plain["Location"] == "https://testserver/login/"
    # Probes and scrapers talk to the pod over http: not redirected.
    assert client.get("/metrics").status_code == 200
    proxied = client.get("/login/", headers={"X-Forwarded-Proto": "https"})
    assert proxied.status_code == 200 and proxied["Strict-Transport-Security"] == "max-age=3600"


@pytest.fixture
def world(db: None, settings: Any) -> World:
    return build_world(settings)


def _directives(header: str) -> dict[str, list[str]]:
    return {part.split()[0]: part.split()[1:] for part in header.split(";") if part.strip()}


def test_every_page_has_a_csp_allowing_only_its_own_scripts_and_no_inline_script(
        world: World) -> None:
    client = Client()
    client.force_login(user_with_role("olga-csp", OPERATOR)[0])
    seen = 0
    extra = [("login/", "login"), ("api/docs/", "api-docs"), ("api/redoc/", "api-redoc")]
    for route, _ in [*page_patterns(), *extra]:
        response = client.get(_url(route, world))
        if response.status_code != 200:
            continue
        csp = _directives(response["Content-Security-Policy"])
        assert csp["default-src"] == ["'self'"] and csp["script-src"] == ["'self'"], route
        assert csp["frame-ancestors"] == ["'none'"] and csp["object-src"] == ["'none'"]
        if not response["Content-Type"].startswith("text/html"):
            continue
        seen += 1
        html = response.content.decode()
        for tag in re.findall(r"<script\b[^>]*>", html):
            assert " src=" in tag, (route, tag)  # an inline script would be blocked
        assert not re.search(r"\son[a-z]+=", html), route  # inline handlers too
        assert not re.findall(r"""(?:src|href)=["'](?:https?:)?//""", html), route
    assert seen >= 10


def test_the_swagger_page_loads_its_start_up_script_as_a_file(db: None) -> None:
    html = Client().get("/api/docs/").content.decode()
    scripts = re.findall(r'<script src="([^"]+)"', html)
    start = [s for s in scripts if "script=" in s]
    assert start, scripts
    answer = Client().get(start[0].replace("&amp;", "&"))
    assert answer.status_code == 200 and "SwaggerUIBundle" in answer.content.decode()
