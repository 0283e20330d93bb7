"""Leave room in each page of the GPU and node tables so PostgreSQL can update rows in place.

Every poll rewrites every GPU row (utilisation and temperature always move). With free space
in the page and no indexed column changed, PostgreSQL makes a heap-only tuple update and
touches no index, which roughly halves the cost of a 100,000-row poll. SQLite: nothing to do.
"""

from __future__ import annotations

from django.db import migrations


def fillfactor(apps, schema_editor, value: int = 70) -> None:  # noqa: ANN001 - migration API
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in ("collectors_gpu", "collectors_node"):
        schema_editor.execute(f'ALTER TABLE "{table}" SET (fillfactor = {value})')


def reset(apps, schema_editor) -> None:  # noqa: ANN001
    fillfactor(apps, schema_editor, 100)


class Migration(migrations.Migration):
    dependencies = [("collectors", "0002_collector_runs_and_readings")]
    operations = [migrations.RunPython(fillfactor, reset)]
