"""Loaded into schemathesis (SCHEMATHESIS_HOOKS) by test_schemathesis.py: how to send bodies
of the media types it has no serializer for."""

from __future__ import annotations

import schemathesis

# Prometheus's remote write (POST /api/v1/prometheus/write/): a binary body, sent as bytes.
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")
