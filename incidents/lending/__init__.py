"""Lending GPU nodes between Slurm training and Kubernetes inference.

GPU nodes are Kubernetes nodes first and Slurm is a workload on them: when training demand
drops, idle training nodes can serve inference, and they come back when Slurm needs them.
Neither team changes how it works: researchers keep ``sbatch``, inference keeps its
Deployments; FleetWatch drains the node in Slurm (``fleetwatch:`` reason) and makes it
schedulable for inference in Kubernetes (labels and taints as the site configures them, a
``fleetwatch.io/lent`` annotation), and back.

- ``decide``: the automatic policy as a pure function (demand and idle history in, nodes to
  lend and to bring back out): floor, ceiling, hysteresis. No Django, no database.
- ``steps``: a loan's steps, each an executor like a remediation step's (outside calls
  through ``OutsideCalls.call``: audited once, never made twice after a restart).
- ``services``: lend, approve, decline, return, retry, the step runner, the beat's tick and
  the capacity snapshots.
- ``selectors``: capacity by pool and use, now and over time; what could be lent now.
- ``views``: the capacity page; ``incidents/api/lending.py``: its API.
"""
