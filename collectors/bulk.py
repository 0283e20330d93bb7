"""Fast writes of many rows' columns, for collectors that see the whole fleet each poll.

A poll of 100,000 GPUs changes 100,000 rows (utilisation and temperature always move).
Django's ``bulk_update`` turns that into CASE expressions PostgreSQL evaluates per row and per
case (minutes), and even an ORM upsert spends seconds preparing values field by field. On
PostgreSQL we COPY the new values into a temporary table and apply them with one
``UPDATE ... FROM``; elsewhere (SQLite, the embedded default) a plain ``executemany``.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any, cast

from django.db import connection, models

try:  # psycopg is only needed (and installed) for PostgreSQL
    from psycopg.types.json import Jsonb
except ImportError:  # pragma: no cover - SQLite-only installs
    Jsonb = None  # type: ignore[assignment,misc]


def update_columns(model: type[models.Model], columns: Sequence[str],
                   rows: Sequence[tuple[Any, ...]]) -> int:
    """Set ``columns`` of existing rows. Each row is ``(pk, value, value, ...)`` in the order
    of ``columns`` (field names; foreign keys as ``node_id``). Returns the rows written."""
    if not rows:
        return 0
    meta = model._meta
    # Concrete columns only (a reverse relation has no column): the cast says so to mypy.
    fields = [cast("models.Field[Any, Any]", meta.get_field(c)) for c in columns]
    json_at = [i for i, f in enumerate(fields) if isinstance(f, models.JSONField)]
    table, pk = meta.db_table, cast(str, meta.pk.column)
    names = [cast(str, f.column) for f in fields]
    if connection.vendor == "postgresql":
        return _postgres(table, pk, names, [f.db_type(connection) for f in fields], json_at, rows)
    sql = (f'UPDATE "{table}" SET ' + ", ".join(f'"{n}" = %s' for n in names)
           + f' WHERE "{pk}" = %s')
    params = []
    for row in rows:
        values = list(row[1:])
        for i in json_at:
            values[i] = json.dumps(values[i])
        params.append((*values, row[0]))
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)
    return len(rows)


def _postgres(table: str, pk: str, names: list[str], types: list[str | None],
              json_at: list[int], rows: Sequence[tuple[Any, ...]]) -> int:
    # One staging table per column set: a session reuses it, with the right columns.
    staging = f"fw_stage_{table}_{zlib.crc32(','.join(names).encode()):08x}"
    columns = ", ".join(f'"{n}" {t}' for n, t in zip(names, types, strict=True))
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE TEMP TABLE IF NOT EXISTS "{staging}" (_pk bigint, {columns})')
        cursor.execute(f'TRUNCATE "{staging}"')
        raw = cursor.cursor  # the psycopg cursor: Django's wrapper has no COPY
        with raw.copy(f'COPY "{staging}" FROM STDIN') as copy:
            row: tuple[Any, ...] | list[Any]  # a list once its JSON values are wrapped
            for row in rows:
                if json_at:
                    row = list(row)
                    for i in json_at:
                        row[i + 1] = Jsonb(row[i + 1])
                copy.write_row(row)
        cursor.execute(
            f'UPDATE "{table}" AS t SET ' + ", ".join(f'"{n}" = s."{n}"' for n in names)
            + f' FROM "{staging}" AS s WHERE t."{pk}" = s._pk')
        cursor.execute(f'TRUNCATE "{staging}"')
    return len(rows)
