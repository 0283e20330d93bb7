# FleetWatch. `make run` starts the embedded demo; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test lint install bench clean

$(BIN)/.installed: requirements.txt requirements-dev.txt
	deploy/bootstrap.sh run
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	touch $@

install: $(BIN)/.installed

run: install
	HOST=$(HOST) PORT=$(PORT) VENV=$(VENV) deploy/run-local.sh

test: install
	deploy/bootstrap.sh test
	VENV=$(VENV) deploy/testing/with-services.sh $(BIN)/python -m pytest $(PYTEST_ARGS)

# Benchmarks: figures in reports/, never timed assertions in tests (the machines are shared).
bench: install
	$(BIN)/python -m tests.bench.diagnosis --out reports
	deploy/bootstrap.sh test
	VENV=$(VENV) deploy/testing/with-services.sh $(BIN)/python -m tests.bench.collectors --out reports
	VENV=$(VENV) deploy/testing/with-services.sh $(BIN)/python -m tests.bench.pages --out reports

lint: install
	$(BIN)/ruff check .
	$(BIN)/python manage.py makemigrations --check --dry-run

clean:
	rm -rf data reports .pytest_cache
