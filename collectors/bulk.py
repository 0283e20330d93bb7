"""Fast writes of many rows' columns, for collectors that see the whole fleet each poll.

A poll of 100,000 GPUs changes 100,000 rows (utilisation and temperature always move).
Django's ``bulk_update`` turns that into CASE expressions PostgreSQL evaluates per row and per
case (minutes), and even an ORM upsert spends seconds preparing values field by field. On
PostgreSQL we COPY the new values into a temporary table and apply them with one
``UPDATE ... FROM``; elsewhere (SQLite, the embedded default) a plain ``executemany``.

New rows go the same way (``insert_missing``): the first poll of a fleet creates 12,500 nodes
and 100,000 GPUs, and ``bulk_create`` builds a model instance and prepares every field of
every row (seconds), where the rows differ only in a key or two.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any, cast

import orjson
from django.db import IntegrityError, connection, models, transaction

try:  # psycopg is only needed (and installed) for PostgreSQL
    from psycopg.types.json import Jsonb
except ImportError:  # pragma: no cover - SQLite-only installs
    Jsonb = None  # type: ignore[assignment,misc]

UNIQUE_VIOLATION = "23505"  # PostgreSQL's SQLSTATE


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


def _json_text(value: Any) -> bytes | str:
    """A JSON column's value as text: orjson (a poll can write 12,500 nodes' port readings),
    or the json module for what orjson refuses (keys that are not strings, integers past 64
    bits), so every value written before is written now."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value)


def insert_missing(template: models.Model, columns: Sequence[str],
                   rows: Sequence[tuple[Any, ...]]) -> int:
    """Insert one row per ``rows`` item, each ``template`` (an unsaved instance holding the
    defaults) with ``columns`` set to the item's values; a row that would break a unique
    constraint (a concurrent collector created it) is skipped. ``columns`` are attnames
    (``node_id``) of plain columns (no JSON). Returns the rows sent."""
    if not rows:
        return 0
    model = type(template)
    meta = model._meta
    if connection.vendor != "postgresql":
        base = {f.attname: getattr(template, f.attname) for f in meta.concrete_fields
                if not f.primary_key}
        model._default_manager.bulk_create(
            [model(**{**base, **dict(zip(columns, row, strict=True))}) for row in rows],
            ignore_conflicts=True, batch_size=5000)
        return len(rows)
    varying = [cast("models.Field[Any, Any]", meta.get_field(c)) for c in columns]
    keys = {f.attname for f in varying}
    fixed = [f for f in meta.concrete_fields if not f.primary_key and f.attname not in keys]
    # Only the columns that differ go through COPY (its cost is per value); the template's
    # values are parameters of the INSERT, prepared once, each cast to its column's type.
    params: list[Any] = []
    for f in fixed:
        value = f.get_db_prep_save(f.pre_save(template, add=True), connection)
        if isinstance(f, models.JSONField):
            value = json.dumps(getattr(template, f.attname))
        params.append(value)
    table = meta.db_table
    names = [cast(str, f.column) for f in varying]
    staging = f"fw_new_{table}_{zlib.crc32(','.join(names).encode()):08x}"
    spec = ", ".join(f'"{n}" {f.db_type(connection)}' for n, f in zip(names, varying,
                                                                        strict=True))
    target = ", ".join(f'"{f.column}"' for f in [*fixed, *varying])
    values = ", ".join([*(f"%s::{f.db_type(connection)}" for f in fixed),
                        *(f's."{n}"' for n in names)])
    # In key order, as the callers sorted them: collectors creating the same rows at once
    # queue behind each other instead of deadlocking.
    order = ", ".join(f's."{n}"' for n in names)
    insert = (f'INSERT INTO "{table}" ({target}) SELECT {values} FROM "{staging}" AS s '
              f"ORDER BY {order}")
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE TEMP TABLE IF NOT EXISTS "{staging}" ({spec})')
        cursor.execute(f'TRUNCATE "{staging}"')
        with cursor.cursor.copy(f'COPY "{staging}" FROM STDIN') as copy:
            for row in rows:
                copy.write_row(row)
        # A plain insert first, in a savepoint: ON CONFLICT's speculative insertion costs
        # about 40% more per row (100,000 GPUs: 0.65 s against 0.45 s), and a conflict is
        # rare (the caller sends the rows it did not find). On one, the insert is undone
        # whole and done again, skipping the rows that exist.
        try:
            with transaction.atomic():
                cursor.execute(insert, params)
        except IntegrityError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != UNIQUE_VIOLATION:
                raise
            cursor.execute(f"{insert} ON CONFLICT DO NOTHING", params)
        cursor.execute(f'TRUNCATE "{staging}"')
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
                        row[i + 1] = Jsonb(row[i + 1], dumps=_json_text)
                copy.write_row(row)
        cursor.execute(
            f'UPDATE "{table}" AS t SET ' + ", ".join(f'"{n}" = s."{n}"' for n in names)
            + f' FROM "{staging}" AS s WHERE t."{pk}" = s._pk')
        cursor.execute(f'TRUNCATE "{staging}"')
    return len(rows)


def append_rows(model: type[models.Model], columns: Sequence[str],
                rows: Sequence[tuple[Any, ...]]) -> int:
    """Insert ``rows`` (values of ``columns``, attnames of plain columns; the rest take their
    database defaults or NULL) into a table no row of which can conflict with them, such as
    a history of samples. PostgreSQL: COPY straight into the table, where ``bulk_create``
    prepared every field of every row (a poll of the simulated fleet's 40,000 GPUs spent
    more on that than on reading them). Returns the rows written."""
    if not rows:
        return 0
    meta = model._meta
    fields = [cast("models.Field[Any, Any]", meta.get_field(c)) for c in columns]
    if connection.vendor != "postgresql":
        model._default_manager.bulk_create(
            [model(**dict(zip(columns, row, strict=True))) for row in rows], batch_size=5000)
        return len(rows)
    names = ", ".join(f'"{f.column}"' for f in fields)
    with connection.cursor() as cursor, \
            cursor.cursor.copy(f'COPY "{meta.db_table}" ({names}) FROM STDIN') as copy:
        for row in rows:
            copy.write_row(row)
    return len(rows)
