"""Test harness: private stand-ins for the services FleetWatch talks to (Kubernetes API server,
Slurm cluster, Prometheus, PostgreSQL/Redis via with-services.sh). Test code only, never deployed."""
