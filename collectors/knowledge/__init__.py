"""What FleetWatch knows about GPUs and faults, written once.

The XID catalogue (``xid``), DCGM field names and clock-event bits (``dcgm``), the root-cause
labels, risk classes and the playbook each cause runs first (``causes``). Everything else
imports these; ``tests/unit/test_single_source.py`` fails when a module writes one again.

This package sits at the bottom of the import graph: it imports only the standard library, so
collectors, the node agent, the diagnosis engine and ``incidents`` can all use it, and it never
needs Django.
"""

from __future__ import annotations

from collectors.knowledge import dcgm
from collectors.knowledge.causes import (
    CAUSE_LABELS,
    INCIDENT_CAUSES,
    PLAYBOOK_FOR,
    RISKS,
    SEVERITY_FOR,
    SEVERITY_LABELS,
    PlaybookName,
    Risk,
    RootCause,
    Severity,
)
from collectors.knowledge.xid import (
    GPU_OUT_XIDS,
    RECOVERY_ACTIONS,
    RECOVERY_FAULTS,
    XID_TABLE,
    Action,
    Xid,
    XidClass,
    takes_gpu_out,
    xid_info,
)

__all__ = [
    "CAUSE_LABELS",
    "GPU_OUT_XIDS",
    "INCIDENT_CAUSES",
    "PLAYBOOK_FOR",
    "RECOVERY_ACTIONS",
    "RECOVERY_FAULTS",
    "RISKS",
    "SEVERITY_FOR",
    "SEVERITY_LABELS",
    "XID_TABLE",
    "Action",
    "PlaybookName",
    "Risk",
    "RootCause",
    "Severity",
    "Xid",
    "XidClass",
    "dcgm",
    "takes_gpu_out",
    "xid_info",
]
