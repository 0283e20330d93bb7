"""InfiniBand ports under ``/sys/class/infiniband/<dev>/ports/<n>/``: state and the link
counters, sent when they change (the first reading is the baseline)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

IB_COUNTERS = ("link_downed", "link_error_recovery", "symbol_error")
# The state reported for a port that was there and is no more.
ABSENT = "ABSENT"


class InfinibandSource:
    """Port state and counters under ``/sys/class/infiniband/<dev>/ports/<n>/``."""

    def __init__(self, node: str, root: str | Path = "/sys/class/infiniband") -> None:
        self.node, self.root = node, Path(root)
        self.last: dict[tuple[str, int], dict[str, Any]] = {}

    def read(self) -> dict[tuple[str, int], dict[str, Any]]:
        ports: dict[tuple[str, int], dict[str, Any]] = {}
        for port_dir in sorted(self.root.glob("*/ports/*")):
            try:
                device, port = port_dir.parent.parent.name, int(port_dir.name)
                # "4: ACTIVE" -> "ACTIVE"
                state = (port_dir / "state").read_text().strip().rpartition(":")[2].strip()
                reading: dict[str, Any] = {"state": state}
                for counter in IB_COUNTERS:
                    f = port_dir / "counters" / counter
                    if f.exists():
                        reading[counter] = int(f.read_text().strip())
            except (OSError, ValueError) as exc:
                log.warning("unreadable port %s: %s", port_dir, exc)
                continue
            ports[(device, port)] = reading
        return ports

    def poll(self) -> list[dict[str, Any]]:
        out = []
        ports = self.read()
        for (device, port), before in list(self.last.items()):
            if (device, port) not in ports and before["state"] != ABSENT:
                # The port went away (the HCA fell off the bus, its driver was unloaded):
                # news, like a link going down. Its return is compared with this.
                out.append({"source": "nic", "node": self.node, "device": device, "port": port,
                            "state": ABSENT})
                self.last[(device, port)] = {"state": ABSENT}
        for (device, port), now in ports.items():
            before = self.last.get((device, port))
            self.last[(device, port)] = now
            if before is None:
                continue  # the first reading is the baseline
            base = {"source": "nic", "node": self.node, "device": device, "port": port}
            for counter in IB_COUNTERS:
                if counter in now and counter in before and now[counter] > before[counter]:
                    out.append({**base, "counter": counter, "value": now[counter],
                                "previous": before[counter]})
            if now["state"] != before["state"]:
                out.append({**base, "state": now["state"]})
        return out
