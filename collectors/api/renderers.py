"""JSON answers that cannot fail on what is stored.

DRF's renderer writes strict JSON in UTF-8: a float infinity or NaN (a GPU reading PostgreSQL
keeps as it came) raises, and so does a lone surrogate (SQLite keeps one written escaped in
a JSON text), and either made the whole answer a 500. The door refuses them now, but rows
stored before stay: this renderer renders as DRF does and, only when that fails, renders the
data again with them replaced (``collectors.models.json_safe``: U+FFFD, null)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rest_framework.renderers import JSONRenderer

from collectors.models import json_safe

log = logging.getLogger(__name__)


class SafeJSONRenderer(JSONRenderer):
    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: Mapping[str, Any] | None = None) -> bytes:
        try:
            return super().render(data, accepted_media_type, renderer_context)
        except (ValueError, UnicodeEncodeError, RecursionError) as exc:
            # ValueError: "Out of range float values are not JSON compliant".
            log.warning("answer held values JSON cannot carry, replaced: %s", exc)
            return super().render(json_safe(data), accepted_media_type, renderer_context)
