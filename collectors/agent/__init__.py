"""FleetWatch's node agent: runs on each GPU node and pushes what only the node can see.

- the kernel log (``/dev/kmsg``, else journald): the driver's XID and SXid lines, GPUs falling
  off the bus, NIC and InfiniBand link changes, PCIe AER errors (``kernel``);
- NVML: XID and double-bit ECC events the moment they happen, and changes in ECC counters,
  remapped rows, clock-event reasons, temperatures, power, the PCIe link against its maximum,
  NVLink links and their error counters (``nvml``);
- ``/sys/class/infiniband/*/ports/*``: port state and link counters (``infiniband``).

Everything goes to an on-disk spool first (``spool``), then to FleetWatch with the node's
token (``push``); nothing is lost while FleetWatch is away. ``runner`` is the loop,
``cli`` the command (``fleetwatch-agent``, ``python -m collectors.agent``).

A package of its own: it imports no Django and nothing of the server but the standard-library
``collectors.knowledge`` (field names, the push protocol), so a node installs it alone with
``pip install ./collectors/agent`` (``pyproject.toml`` here), needing only ``requests`` and
``nvidia-ml-py``.
"""

__version__ = "0.2.0"
