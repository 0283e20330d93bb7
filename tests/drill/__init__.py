"""The end-to-end failure drill: "GPU died, training didn't".

``python -m tests.drill.run --out reports/drill`` (``make drill``) starts a real Slurm cluster,
the Kubernetes test server, a real Prometheus scraping the simulated dcgm-exporter, and
FleetWatch's web server, worker and beat on real sources; submits a checkpointing training job
(``tests/drill/train.py``) with plain ``sbatch --requeue``; kills a GPU under it; lets
FleetWatch repair the fleet alone; and writes the timeline and timings
(``tests/drill/report.py``). ``tests/integration/test_drill.py`` runs it shortened.
"""
