"""The OpenAPI schema: generated without a warning, served, and readable offline."""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

from django.core.management import call_command
from django.test import Client

from tests.api.test_permissions import schema_operations


def test_schema_generates_and_validates_without_warnings() -> None:
    out = StringIO()
    # --fail-on-warn: any warning or error (an unresolvable serializer, an unknown
    # authenticator, a path parameter without a type) raises here.
    call_command("spectacular", "--validate", "--fail-on-warn", "--format", "openapi-json",
                 stdout=out)
    assert '"openapi": "3.0.3"' in out.getvalue()


def test_schema_documents_errors_and_access(db: None, client: Client) -> None:
    schema: dict[str, Any] = client.get("/api/schema/?format=json").json()
    assert schema["components"]["securitySchemes"]["tokenAuth"]["type"] == "apiKey"
    ops = schema["paths"]
    approve = ops["/api/v1/remediations/{id}/approve/"]["post"]
    assert {"200", "400", "401", "403", "404", "409", "429"} <= approve["responses"].keys()
    assert "**Access:** operate" in approve["description"]
    push = ops["/api/v1/signals/"]["post"]
    assert {"201", "400", "413", "422"} <= push["responses"].keys()
    assert "**Access:** ingest" in push["description"]
    assert "**Access:** admin" in ops["/api/v1/tokens/"]["get"]["description"]
    assert len(schema_operations()) == sum(
        1 for item in ops.values() for m in item if m in ("get", "post", "put", "patch", "delete"))


def test_reference_page_renders_from_local_assets(client: Client) -> None:
    response = client.get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in html
    # Nothing fetched from elsewhere: the docs work on a machine with no internet access.
    external = re.findall(r"""(?:src|href)=["']((?:https?:)?//[^"']+)""", html)
    assert external == [], external
    assert "cdn." not in html.lower()
    asset = re.search(r'src="(/static/[^"]+swagger-ui-bundle\.js)"', html)
    assert asset and client.get(asset.group(1)).status_code == 200


def test_redoc_page_renders_from_local_assets_too(client: Client) -> None:
    html = client.get("/api/redoc/").content.decode()
    assert "/static/drf_spectacular_sidecar/redoc/bundles/redoc.standalone.js" in html
    assert re.findall(r"""(?:src|href)=["']((?:https?:)?//[^"']+)""", html) == []
    assert "fonts.googleapis" not in html
