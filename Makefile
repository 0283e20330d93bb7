# FleetWatch. `make run` starts the embedded demo; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test lint install bench drill clean agent-image image

$(BIN)/.installed: requirements.txt requirements-dev.txt
	deploy/bootstrap.sh run
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	touch $@

install: $(BIN)/.installed

# `make run PORT=8123 HOST=0.0.0.0` for another address (the default: loopback, port 8000).
# exec: the script takes the shell's place, so a TERM that make passes on to its recipe
# reaches the script, which stops everything it started (deploy/run-local.sh).
run: install
	HOST=$(HOST) PORT=$(PORT) VENV=$(VENV) exec deploy/run-local.sh

# The type check (mypy, [tool.mypy] in pyproject.toml) over the production code. Its Django
# plugin imports the settings, which refuse PostgreSQL without a named fleet: the check names
# the simulated one, whatever the shell has.
MYPY := FLEETWATCH_FLEET=sim $(BIN)/mypy

# Slurm 25.11 for the tests is built once from the shared source into a cache
# (tests/harness/slurm_build.py; FLEETWATCH_SLURM_TARBALL, FLEETWATCH_SLURM_CACHE): ~5 minutes
# the first time, nothing after.
# The suite runs on TEST_WORKERS pytest-xdist workers: most of its time is spent waiting on
# Slurm daemons, Celery workers, podman and the browser, so several pay off on 2 cores (2 by
# default: at 4, waits tuned for a quiet machine timed out in runs beside other load). Each worker
# gets its own test database, Redis database (the broker's number plus its index: 9-12 for the
# default db 9) and data folder (tests/harness/parallel.py). Tests sharing a module-scoped
# fixture stay on one worker (--dist loadgroup). One process: TEST_WORKERS=0, or -n 0 or
# -p no:xdist in PYTEST_ARGS (--pdb too).
TEST_WORKERS ?= 2
XDIST_ARGS = $(if $(or $(findstring no:xdist,$(PYTEST_ARGS)),$(findstring --pdb,$(PYTEST_ARGS))),,\
  -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
test: install
	$(MYPY)
	deploy/bootstrap.sh test
	$(BIN)/python -m tests.harness.slurm_build
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m pytest $(XDIST_ARGS) $(PYTEST_ARGS)

# Benchmarks: figures in reports/, never timed assertions in tests (the machines are shared).
# tests.bench.quality: precision, recall and a confusion matrix per root cause on the replay
# scenarios, no services; it fails on a wrong scenario or a healthy node blamed.
# tests.bench.fail_slow: fail-slow precision and recall per straggler kind and magnitude, and
# healthy nodes flagged per look-alike, on simulated fleets; no services.
# BURST_ARGS: e.g. --batches 500 for a shorter burst (the default is 2,000 batches of 100).
bench: install
	$(BIN)/python -m tests.bench.diagnosis --out reports
	$(BIN)/python -m tests.bench.quality --out reports
	$(BIN)/python -m tests.bench.fail_slow --out reports
	deploy/bootstrap.sh test
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.collectors --out reports
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.pages --out reports
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.burst --out reports $(BURST_ARGS)
	VENV=$(VENV) tests/harness/with-services.sh sh -c '$(BIN)/python -m tests.bench.storm --nodes 500 --out reports && $(BIN)/python -m tests.bench.storm --nodes 5000 --out reports && $(BIN)/python -m tests.bench.storm --nodes 5000 --web-workers 4 --out reports && $(BIN)/python -m tests.bench.storm --intake --out reports'
	# A kernel XID line through the real node agent (root: it writes to /dev/kmsg).
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.agent --out reports
	# Beside Prometheus + Alertmanager: FleetWatch polling Prometheus (reports/peer.md), then
	# Prometheus's remote write ringing FleetWatch's doorbell, as deploy/prometheus ships it,
	# against the tight peer (reports/peer-remote-write.md; issue 18's 9-of-10 target).
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.peer --out reports
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.peer --remote-write \
	  --profiles tight --runs 10 --out reports
	# Lending: a simulated week of demand through the decision and the loans' steps (the chart
	# reports/bench-lending.svg), and the capacity reads at 12,500 nodes on PostgreSQL.
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.lending --scale 12500 --out reports
	# Hostile requests at every endpoint and page, on SQLite and PostgreSQL; fails on any 5xx.
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.bench.bad_input \
	  --database sqlite --database postgres --out reports

# The end-to-end failure drill on real Slurm, Prometheus and the Kubernetes test server:
# reports/drill/*.json and .md. Production-like by default (120 s SIGTERM grace, 15 s scrapes,
# Slurm's default 120 s cred_expire); shorten it with e.g. `make drill DRILL_GRACE=10
# DRILL_SCRAPE=2 DRILL_CRED_EXPIRE=10`, or pass more options (`--fault-path agent`,
# `--no-auto-replace`, see `python -m tests.drill.run --help`) in DRILL_ARGS.
DRILL_GRACE ?= 120
DRILL_SCRAPE ?= 15
DRILL_CRED_EXPIRE ?= 120
DRILL_ARGS ?=
drill: install
	deploy/bootstrap.sh test
	VENV=$(VENV) tests/harness/with-services.sh $(BIN)/python -m tests.drill.run \
	  --out reports/drill --grace $(DRILL_GRACE) --scrape $(DRILL_SCRAPE) \
	  --cred-expire $(DRILL_CRED_EXPIRE) $(DRILL_ARGS)

# The node agent's OCI image (localhost/fleetwatch-agent:<version> and :latest) with podman,
# from this checkout's collectors/agent package: deploy/agent/README.md. Root; REBUILD_BASE=1
# makes the Debian base again.
agent-image:
	deploy/agent/build-image.sh

# FleetWatch's server image (localhost/fleetwatch:<revision> and :latest) with podman: web,
# Celery worker and beat, management commands: deploy/image/README.md. Root; REBUILD_BASE=1
# makes the Debian base again, NO_CACHE=1 every layer.
image:
	deploy/image/build.sh

lint: install
	$(BIN)/ruff check .
	$(MYPY)
	FLEETWATCH_FLEET=sim $(BIN)/python manage.py makemigrations --check --dry-run

clean:
	rm -rf data reports .pytest_cache
