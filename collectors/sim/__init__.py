"""The simulated fleet: the client twins (``fleet``), its dcgm-exporter (``exporter``) and the
fault-injection services the demo and the tests drive (``faults``).

Nothing here is imported unless ``FLEETWATCH_FLEET=sim`` (or a test) asks for it.
"""
