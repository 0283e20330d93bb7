"""FleetWatch settings: every value comes from the environment (see README, "Configuration").

With nothing set, FleetWatch runs on its embedded default: SQLite and a filesystem Celery
broker in ``FLEETWATCH_DATA_DIR`` and the simulated fleet, so ``make run`` needs no server.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from pathlib import Path

import dj_database_url
import yaml
from django.core.exceptions import ImproperlyConfigured

from collectors.env import (
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_labels,
    env_list,
    env_map,
    env_per_pool,
    env_schedule,
    env_str,
    env_taint_keys,
    env_taints,
)
from collectors.knowledge import acceptance as _acceptance  # lower case: not a setting
from collectors.knowledge import causes as _causes  # lower case: not a setting itself
from collectors.sources import FLEETS, SourceSettings, cluster_default_name, clusters_load
from fleetwatch.datadir import broker_dir, data_dir, secret_key_saved
from fleetwatch.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent
# Paths only: importing settings writes nothing. The programs that use the data folder make it
# and its contents on first use (fleetwatch/datadir.py: manage.py, WSGI/ASGI, Celery, make run).
DATA_DIR = data_dir()


def _share_problem(value: str) -> str | None:
    """What is wrong with a node count ("8") or a pool share ("50%"), or None."""
    number = value[:-1] if value.endswith("%") else value
    try:
        parsed = float(number) if value.endswith("%") else int(number)
    except ValueError:
        return "not a node count (8) or a share of the pool (50%)"
    if parsed < 0 or (value.endswith("%") and parsed > 100):
        return "out of range (0..100% or a count of nodes)"
    return None


def _secret_key(deployed: str | None) -> str:
    key = env_str("SECRET_KEY")
    if key:
        return key
    if deployed:
        # A deployment's processes (several web pods, workers, beat) must sign with one key
        # that outlives each of them: a key saved in one pod's data folder, or made up per
        # process, would log people out at each restart and break the signed audit
        # checkpoints. Refused before anything starts, rather than running on such a key.
        raise ImproperlyConfigured(
            f"SECRET_KEY is not set, and {deployed} means a deployment: set SECRET_KEY to a "
            "long random string shared by every FleetWatch process (web, worker, beat, "
            "management commands), e.g. from a Kubernetes Secret; "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(50))' makes one.")
    # The embedded default keeps a random key in the data folder (written by the first program
    # to start, data_dir_prepare) so sessions survive restarts without anyone having to
    # invent a secret for a demo.
    saved = secret_key_saved(DATA_DIR)
    if saved:
        return saved
    # Imported by no such program (a test, a type check, a script): a key for this process.
    return secrets.token_urlsafe(50)


DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# --- HTTPS and browser security (README, "Running in production") ---------------------------
# The defaults suit `make run` on plain http://127.0.0.1:8000. FLEETWATCH_HTTPS=true turns on
# what a site served over HTTPS wants; each setting can still be set by its own variable.
FLEETWATCH_HTTPS = env_bool("FLEETWATCH_HTTPS", False)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", FLEETWATCH_HTTPS)
# Health probes and Prometheus reach the pod itself over plain HTTP: no redirect for them.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000 if FLEETWATCH_HTTPS else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", FLEETWATCH_HTTPS)
# Asks browsers' preload lists to take the domain: hard to undo, so only when asked for.
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", FLEETWATCH_HTTPS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", FLEETWATCH_HTTPS)
# Behind a proxy that ends TLS and sets this header to "https" (e.g. X-Forwarded-Proto); the
# proxy must overwrite the header a client sends. gunicorn does the same for the addresses in
# FORWARDED_ALLOW_IPS (deploy/gunicorn.conf.py).
_proxy_ssl_header = env_str("SECURE_PROXY_SSL_HEADER")
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _proxy_ssl_header.upper().replace("-", "_"), "https") if _proxy_ssl_header else None)
# Content-Security-Policy (django-csp): the pages load only their own scripts, styles, images
# and fonts, send forms and requests only here, and cannot be framed. No inline scripts (htmx
# and Plotly are files in static/vendor/). Inline styles are allowed: Plotly and Redoc insert
# <style> elements and the dashboard's bars are sized with style attributes.
CONTENT_SECURITY_POLICY = {"DIRECTIVES": {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'", "'unsafe-inline'"],
    "img-src": ["'self'", "data:"],
    "font-src": ["'self'", "data:"],
    "connect-src": ["'self'"],
    "worker-src": ["'self'", "blob:"],  # Redoc's search runs in a worker made from a blob
    "object-src": ["'none'"],
    "base-uri": ["'self'"],
    "form-action": ["'self'"],
    "frame-ancestors": ["'none'"],
}}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "django_filters",
    "django_tables2",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "csp",
    "collectors",
    "incidents",
    "fleetwatch",
]

MIDDLEWARE = [
    "fleetwatch.middleware.RequestIdMiddleware",
    "fleetwatch.logs.RequestLogMiddleware",  # the access log line and HTTP metrics
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "fleetwatch.middleware.BadInputMiddleware",  # NUL in URLs and forms, chunked bodies
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "incidents.api.middleware.ApiAuditMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "fleetwatch.middleware.PageAccessMiddleware",  # pages follow the API's role rules
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
]

ROOT_URLCONF = "fleetwatch.urls"
WSGI_APPLICATION = "fleetwatch.wsgi.application"
ASGI_APPLICATION = "fleetwatch.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "fleetwatch.context.fleetwatch",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{DATA_DIR / 'fleetwatch.sqlite3'}")
try:
    _db = dj_database_url.parse(DATABASE_URL, conn_max_age=60, conn_health_checks=True)
except (ValueError, KeyError) as exc:  # dj-database-url raises on unknown schemes
    raise ImproperlyConfigured(f"DATABASE_URL is not a database URL: {exc}") from exc
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default has web, worker and beat writing one file: WAL lets readers go on
    # during a write, IMMEDIATE transactions take the write lock up front instead of failing
    # with "database is locked" on upgrade, and the timeout waits out short contention.
    _db["CONN_MAX_AGE"] = 0
    _db["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
# The image collects static files at build time into its own read-only folder
# (FLEETWATCH_STATIC_ROOT=/app/staticfiles, deploy/image/Containerfile); elsewhere they go to the
# data folder.
STATIC_ROOT = Path(env_str("FLEETWATCH_STATIC_ROOT") or DATA_DIR / "staticfiles")
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve straight from STATICFILES_DIRS too, so a checkout works before collectstatic runs. Not
# where the files were collected ahead (the image): the finders' plain copies would replace
# the compressed ones WhiteNoise serves from STATIC_ROOT.
WHITENOISE_USE_FINDERS = not env_str("FLEETWATCH_STATIC_ROOT")

# The cache holds the API's throttling counters, so every gunicorn worker must see the same
# one: Redis when REDIS_URL is set, else files in the data folder (one machine, several
# processes). FLEETWATCH_CACHE_URL overrides (redis://... or a folder path).
_cache = env_str("FLEETWATCH_CACHE_URL") or env_str("REDIS_URL") or str(DATA_DIR / "cache")
CACHES = {"default": (
    {"BACKEND": "fleetwatch.cache.RedisCache", "LOCATION": _cache}
    if _cache.startswith(("redis://", "rediss://", "unix://"))
    # Files: room for every token's counters, and entries that outlive a day-long throttle
    # window (incr rewrites an entry with the default timeout). Not atomic across processes:
    # under bursts a few requests more than the rate get through; Redis is exact.
    else {"BACKEND": "django.core.cache.backends.filebased.FileBasedCache", "LOCATION": _cache,
          "TIMEOUT": 2 * 86400 + 1, "OPTIONS": {"MAX_ENTRIES": 20000}})}

# --- Celery ---------------------------------------------------------------------------------
_broker = env_str("CELERY_BROKER_URL") or env_str("REDIS_URL")
CELERY_BROKER_URL = _broker or "filesystem://"
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith("filesystem://"):
    _queue_dir = broker_dir(DATA_DIR)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue_dir),
        "data_folder_out": str(_queue_dir),
        "processed_folder": str(_queue_dir / "processed"),
        "store_processed": False,
        "control_folder": str(_queue_dir / "control"),
    }
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SOFT_TIME_LIMIT = env_int("FLEETWATCH_TASK_SOFT_TIME_LIMIT", 60, minimum=1)
CELERY_TASK_TIME_LIMIT = CELERY_TASK_SOFT_TIME_LIMIT + 30
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ROUTES = {
    "collectors.tasks.*": {"queue": "collect"},
    "incidents.tasks.diagnose_signals": {"queue": "diagnose"},
    "incidents.tasks.diagnose_cluster": {"queue": "diagnose"},
    "incidents.tasks.diagnosis_rescue": {"queue": "diagnose"},
    "incidents.tasks.fail_slow_scan": {"queue": "diagnose"},
    # A slow webhook receiver must not hold up remediation steps, and a page asking a person
    # for an approval must not wait behind them (in a storm, the repairs' steps fill them).
    "incidents.tasks.webhook*": {"queue": "default"},
    "incidents.tasks.page_person": {"queue": "default"},
    # A fire drill measures the remediate queue; its own bookkeeping must not wait in it.
    "incidents.tasks.drill*": {"queue": "default"},
    "incidents.tasks.*": {"queue": "remediate"},
}
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")
# Only the beat holding the beat lock sends anything (fleetwatch/beat.py): a second beat
# started by mistake stands by.
CELERY_BEAT_SCHEDULER = "fleetwatch.beat:SingleBeatScheduler"
# How long a beat that died holding the lock keeps the others from taking over.
FLEETWATCH_BEAT_LOCK_SECONDS = env_float("FLEETWATCH_BEAT_LOCK_SECONDS", 30.0, minimum=1.0)

# --- FleetWatch -----------------------------------------------------------------------------
# "sim": the simulated fleet (the default, needs nothing). "real": the Slurm CLI, the
# Kubernetes API and Prometheus, configured by the variables below.
if env_str("FLEETWATCH_FLEET") is None and _db["ENGINE"] != "django.db.backends.sqlite3":
    # A database server means a deployment: one that forgot to name its fleet must not come
    # up on the simulated fleet, with buttons that inject faults, and look healthy.
    raise ImproperlyConfigured(
        "FLEETWATCH_FLEET is not set, and DATABASE_URL points at a database server "
        f"({_db['ENGINE'].rsplit('.', 1)[-1]}), not the embedded SQLite: set "
        "FLEETWATCH_FLEET=real to watch the Slurm, Kubernetes and Prometheus the environment "
        "names, or FLEETWATCH_FLEET=sim to run the simulated fleet (a demo or a test). "
        f"Allowed values: {', '.join(FLEETS)}.")
# The sources (fleet, Slurm, Kubernetes, Prometheus, provider) as the environment sets them:
# read and checked in collectors/sources.py, where each cluster of FLEETWATCH_CLUSTERS reads
# its own by the same rules.
# With FLEETWATCH_CLUSTERS they are only the clusters' defaults, and need not be complete.
_sources = SourceSettings.from_env(os.environ, sim_state=DATA_DIR / "sim-fleet.json",
                                   check=not env_str("FLEETWATCH_CLUSTERS"))
FLEETWATCH_FLEET = _sources.fleet
# Set here, after the database and the fleet: which of them make this a deployment decides
# whether a saved or made-up key may stand in for SECRET_KEY.
SECRET_KEY = _secret_key(
    "FLEETWATCH_FLEET=real" if FLEETWATCH_FLEET == "real"
    else f"DATABASE_URL naming a database server ({_db['ENGINE'].rsplit('.', 1)[-1]})"
    if _db["ENGINE"] != "django.db.backends.sqlite3" else None)
# Several clusters in one FleetWatch: each cluster's name and its own source settings (a YAML
# or JSON file, or the JSON itself); unset, one cluster, FLEETWATCH_CLUSTER, on the above.
FLEETWATCH_CLUSTERS = clusters_load(env_str("FLEETWATCH_CLUSTERS"), os.environ, data_dir=DATA_DIR)
# The cluster (of FLEETWATCH_CLUSTERS, the first by default) that pushes naming none go to.
FLEETWATCH_CLUSTER = cluster_default_name(FLEETWATCH_CLUSTERS, env_str("FLEETWATCH_CLUSTER"))
FLEETWATCH_SOURCES = _sources.sources
# Not below a second: a collection of a real source takes hundreds of milliseconds to
# seconds, and a beat faster than that only skips runs (they never overlap). Faults need not
# wait for it: Prometheus's remote write rings the telemetry doorbell, agents push.
FLEETWATCH_COLLECT_INTERVAL = env_float("FLEETWATCH_COLLECT_INTERVAL", 5.0, minimum=1.0)
FLEETWATCH_POLICY_MODE = env_choice("FLEETWATCH_POLICY_MODE", "auto", ["auto", "approve", "observe"])
FLEETWATCH_SLURM_GRACE_SECONDS = env_int("FLEETWATCH_SLURM_GRACE_SECONDS", 120, minimum=0)
FLEETWATCH_STEP_POLL_SECONDS = env_float("FLEETWATCH_STEP_POLL_SECONDS", 1.0, minimum=0.1)
FLEETWATCH_STEP_TIMEOUT_SECONDS = env_int("FLEETWATCH_STEP_TIMEOUT_SECONDS", 900, minimum=1)
FLEETWATCH_STEP_MAX_ATTEMPTS = env_int("FLEETWATCH_STEP_MAX_ATTEMPTS", 3, minimum=1)
# A step's lease: how long one run of it may take before another worker may run it again
# (longer than the Celery time limit). The watchdog re-queues steps whose message was lost.
FLEETWATCH_STEP_LEASE_SECONDS = env_float("FLEETWATCH_STEP_LEASE_SECONDS", 120.0, minimum=1)
FLEETWATCH_WATCHDOG_SECONDS = env_float("FLEETWATCH_WATCHDOG_SECONDS", 30.0, minimum=0.5)
# How long a stopping worker (SIGTERM, Ctrl-C) lets its running tasks finish before it cancels
# them (Celery's cold shutdown; a cut-off step resumes from its recorded calls). Below a
# Pod's default 30 s grace, so the worker stops itself before the kubelet's SIGKILL. 0: wait.
FLEETWATCH_WORKER_SHUTDOWN_SECONDS = env_float("FLEETWATCH_WORKER_SHUTDOWN_SECONDS", 20.0, minimum=0)
FLEETWATCH_DEDUPE_MINUTES = env_int("FLEETWATCH_DEDUPE_MINUTES", 30, minimum=0)
# Remediation policy. Modes per playbook (root cause) and per risky step kind override
# FLEETWATCH_POLICY_MODE: "gpu_hardware=auto,thermal=approve"; "replace=approve,reboot=auto".
_MODES = ["auto", "approve", "observe"]
FLEETWATCH_PLAYBOOK_MODES = env_map(
    "FLEETWATCH_PLAYBOOK_MODES",
    [cause.value for cause in _causes.INCIDENT_CAUSES], _MODES)
# A risk class the variable does not name keeps its default (policy.step_mode): auto, but
# replacing a node that still works (fail-slow, replace_working) waits for a person's approval.
FLEETWATCH_STEP_MODES = env_map("FLEETWATCH_STEP_MODES", [risk.value for risk in _causes.RISKS], _MODES)
# The fleet budget: at most this many nodes, and this share of a pool, partition or leaf
# switch, in remediation at once; beyond it a new remediation waits for a person.
FLEETWATCH_BUDGET_MAX_NODES = env_int("FLEETWATCH_BUDGET_MAX_NODES", 8, minimum=1)
FLEETWATCH_BUDGET_MAX_PERCENT = env_float("FLEETWATCH_BUDGET_MAX_PERCENT", 25.0, minimum=0.1)
# The storm brake: more than N new incidents in M minutes pauses automation.
FLEETWATCH_STORM_INCIDENTS = env_int("FLEETWATCH_STORM_INCIDENTS", 10, minimum=1)
FLEETWATCH_STORM_MINUTES = env_int("FLEETWATCH_STORM_MINUTES", 10, minimum=1)
# Fire drills (README, "Fire drills"): FleetWatch proves its own repair loop on a canary node
# with no user job. SCHEDULE: an interval (6h) or a cron expression (0 3 * * *, UTC); unset:
# no scheduled drill (one can still be started by hand). NODES: the canary nodes, tried in
# order (NODE or CLUSTER:NODE); unset: any idle node, in observe mode only. MODE: observe (the
# playbook runs, every outside call recorded as "would call", nothing changed) or canary (the
# canary really drained and cordoned, then put back). BUDGET: a drill not done by then fails.
FLEETWATCH_DRILL_SCHEDULE = env_schedule("FLEETWATCH_DRILL_SCHEDULE")
FLEETWATCH_DRILL_NODES = env_list("FLEETWATCH_DRILL_NODES", [])
FLEETWATCH_DRILL_MODE = env_choice("FLEETWATCH_DRILL_MODE", "observe", ["observe", "canary"])
FLEETWATCH_DRILL_BUDGET_SECONDS = env_float("FLEETWATCH_DRILL_BUDGET_SECONDS", 300.0, minimum=1)
if FLEETWATCH_DRILL_MODE == "canary" and not FLEETWATCH_DRILL_NODES:
    # A drill that really drains a node drains only nodes someone set aside for it.
    raise ImproperlyConfigured("FLEETWATCH_DRILL_MODE=canary needs FLEETWATCH_DRILL_NODES: the "
                               "nodes set aside for drills (a drill drains and cordons one)")
# A node remediated again this soon waits for a person; K remediations in a week: RMA.
FLEETWATCH_COOLDOWN_MINUTES = env_int("FLEETWATCH_COOLDOWN_MINUTES", 60, minimum=0)
FLEETWATCH_RMA_AFTER = env_int("FLEETWATCH_RMA_AFTER", 3, minimum=1)
# How long a recovered link, switch or GPU temperature must stay good before FleetWatch puts
# nodes back into service; how long a rebooted node has to come back before it is replaced;
# how many flaps of one node in a week make it a replacement.
FLEETWATCH_RECOVERY_STABLE_MINUTES = env_float("FLEETWATCH_RECOVERY_STABLE_MINUTES", 10.0,
                                               minimum=0)
FLEETWATCH_NODE_BACK_MINUTES = env_float("FLEETWATCH_NODE_BACK_MINUTES", 15.0, minimum=0)
FLEETWATCH_FLAPS_BEFORE_REPLACE = env_int("FLEETWATCH_FLAPS_BEFORE_REPLACE", 3, minimum=1)
# Fail-slow (a node alive but slower than its job's peers): how often the beat looks (0: never),
# how much history it reads from the telemetry source and at what step, how long a node must
# stay slower than its peers, and how long its repair waits for the job's next checkpoint
# before it takes the node out anyway (at most a day: a step's longest wait).
FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS = env_float("FLEETWATCH_FAIL_SLOW_INTERVAL_SECONDS", 300.0,
                                                  minimum=0)
FLEETWATCH_FAIL_SLOW_WINDOW_MINUTES = env_float("FLEETWATCH_FAIL_SLOW_WINDOW_MINUTES", 30.0,
                                                minimum=1)
FLEETWATCH_FAIL_SLOW_STEP_SECONDS = env_float("FLEETWATCH_FAIL_SLOW_STEP_SECONDS", 30.0,
                                              minimum=1)
FLEETWATCH_FAIL_SLOW_SUSTAIN_MINUTES = env_float("FLEETWATCH_FAIL_SLOW_SUSTAIN_MINUTES", 5.0,
                                                 minimum=1)
FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES = env_float("FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES",
                                                    60.0, minimum=0)
if FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES > 24 * 60:
    raise ImproperlyConfigured("FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES="
                               f"{FLEETWATCH_FAIL_SLOW_CHECKPOINT_MINUTES:g} is more than a day "
                               "(1440), the longest a remediation step may wait")
# The return-to-service gate (incidents/remediation/gate.py): acceptance checks a node passes
# before it goes back to Slurm service. The catalogue of checks and per-GPU-model thresholds
# ships in collectors/knowledge/acceptance.py; FLEETWATCH_GATE_FILE lays a site's own over it
# (JSON or YAML). FLEETWATCH_GATE_CHECKS chooses, per node pool and per repair, which run:
# "[POOL:]REPAIR=CHECK+CHECK,..." ("*" any, "none" no check). The check programs live on the
# nodes in FLEETWATCH_GATE_CHECK_DIR; a check job writes its output under
# FLEETWATCH_GATE_OUTPUT_DIR (read back where FleetWatch can read that path: a shared file
# system). A check job queued (or Slurm unreachable) longer than FLEETWATCH_GATE_START_MINUTES:
# the gate gives up and holds the node. FLEETWATCH_GATE_RMA_AFTER failed gates of one node in a
# week mark it for RMA. FLEETWATCH_GATE_ENV: more KEY=VALUE for every check job's environment.
FLEETWATCH_GATE_FILE = env_str("FLEETWATCH_GATE_FILE", "")
try:
    if FLEETWATCH_GATE_FILE:
        # YAML reads JSON too.
        FLEETWATCH_GATE_CATALOGUE = _acceptance.catalogue_from(
            yaml.safe_load(Path(FLEETWATCH_GATE_FILE).read_text()),
            f"FLEETWATCH_GATE_FILE {FLEETWATCH_GATE_FILE}")
    else:
        FLEETWATCH_GATE_CATALOGUE = _acceptance.Catalogue()
    FLEETWATCH_GATE_CHECKS = _acceptance.selection_parse(
        env_str("FLEETWATCH_GATE_CHECKS", _acceptance.DEFAULT_SELECTION),
        FLEETWATCH_GATE_CATALOGUE.checks)
except (_acceptance.CatalogueError, OSError, yaml.YAMLError) as _exc:
    raise ImproperlyConfigured(f"FLEETWATCH_GATE_FILE / FLEETWATCH_GATE_CHECKS: {_exc}") from _exc
FLEETWATCH_GATE_CHECK_DIR = env_str("FLEETWATCH_GATE_CHECK_DIR", "/opt/fleetwatch/checks")
FLEETWATCH_GATE_OUTPUT_DIR = env_str("FLEETWATCH_GATE_OUTPUT_DIR", "/tmp")
FLEETWATCH_GATE_START_MINUTES = env_float("FLEETWATCH_GATE_START_MINUTES", 30.0, minimum=0)
FLEETWATCH_GATE_RMA_AFTER = env_int("FLEETWATCH_GATE_RMA_AFTER", 2, minimum=1)
FLEETWATCH_GATE_ENV: dict[str, str] = {}
for _item in env_list("FLEETWATCH_GATE_ENV", []):
    _key, _sep, _value = _item.partition("=")
    if not _sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", _key.strip()):
        raise ImproperlyConfigured(f"FLEETWATCH_GATE_ENV: {_item!r} is not KEY=VALUE")
    FLEETWATCH_GATE_ENV[_key.strip()] = _value.strip()
# Pools Kubernetes schedules (no Slurm): the gate holds such a node with a cordon and a
# fleetwatch.io/gate taint and runs its checks as batch/v1 Jobs in FLEETWATCH_GATE_NAMESPACE,
# in the image FLEETWATCH_GATE_IMAGE (which must hold the check programs at
# FLEETWATCH_GATE_CHECK_DIR: FleetWatch's own image does, at /opt/fleetwatch/checks); passed,
# the node is uncordoned. The playbooks' Slurm steps pass over such a node when Slurm does
# not know it.
FLEETWATCH_KUBERNETES_POOLS = frozenset(env_list("FLEETWATCH_KUBERNETES_POOLS", []))
FLEETWATCH_GATE_NAMESPACE = env_str("FLEETWATCH_GATE_NAMESPACE", "fleetwatch")
FLEETWATCH_GATE_IMAGE = env_str("FLEETWATCH_GATE_IMAGE", "")

# --- Lending nodes between Slurm training and Kubernetes inference (README, "Lending") -----
# What the demand policy does with its decisions: auto lends and returns, approve asks a
# person first, observe records what it would do; per pool with FLEETWATCH_LEND_MODES
# ("approve,gpu=auto"). A person's own lend or return on the capacity page runs at once.
FLEETWATCH_LEND_MODE = env_choice("FLEETWATCH_LEND_MODE", "observe", _MODES)
FLEETWATCH_LEND_MODES = env_per_pool(
    "FLEETWATCH_LEND_MODES", FLEETWATCH_LEND_MODE,
    lambda v: None if v in _MODES else f"not one of {', '.join(_MODES)}")
# Per pool, as a node count ("8") or a share of the pool's nodes in service ("50%"): the
# training capacity never lent (rounded up), and the most nodes lent at once (rounded down).
FLEETWATCH_LEND_FLOOR = env_per_pool("FLEETWATCH_LEND_FLOOR", "50%", _share_problem)
FLEETWATCH_LEND_CEILING = env_per_pool("FLEETWATCH_LEND_CEILING", "25%", _share_problem)
# Demand and its hysteresis: nodes go out only after Slurm's pending GPU demand has stayed at
# or below FLEETWATCH_LEND_BELOW_GPUS for FLEETWATCH_LEND_QUIET_MINUTES, and only nodes idle in
# Slurm for FLEETWATCH_LEND_IDLE_MINUTES; they come back once demand has stayed above
# FLEETWATCH_LEND_RETURN_ABOVE_GPUS for FLEETWATCH_LEND_RETURN_AFTER_MINUTES. A node back from a
# loan is not lent again for FLEETWATCH_LEND_COOLDOWN_MINUTES; at most FLEETWATCH_LEND_MAX_MOVES
# nodes of a pool go out per decision (every FLEETWATCH_LEND_TICK_SECONDS).
FLEETWATCH_LEND_BELOW_GPUS = env_int("FLEETWATCH_LEND_BELOW_GPUS", 0, minimum=0)
FLEETWATCH_LEND_RETURN_ABOVE_GPUS = env_int("FLEETWATCH_LEND_RETURN_ABOVE_GPUS", 0, minimum=0)
if FLEETWATCH_LEND_BELOW_GPUS > FLEETWATCH_LEND_RETURN_ABOVE_GPUS:
    raise ImproperlyConfigured(
        f"FLEETWATCH_LEND_BELOW_GPUS={FLEETWATCH_LEND_BELOW_GPUS} is above "
        f"FLEETWATCH_LEND_RETURN_ABOVE_GPUS={FLEETWATCH_LEND_RETURN_ABOVE_GPUS}: nodes would "
        "be lent at a demand that brings them back")
FLEETWATCH_LEND_IDLE_MINUTES = env_float("FLEETWATCH_LEND_IDLE_MINUTES", 30.0, minimum=0)
FLEETWATCH_LEND_QUIET_MINUTES = env_float("FLEETWATCH_LEND_QUIET_MINUTES", 30.0, minimum=0)
FLEETWATCH_LEND_RETURN_AFTER_MINUTES = env_float("FLEETWATCH_LEND_RETURN_AFTER_MINUTES", 5.0,
                                                 minimum=0)
FLEETWATCH_LEND_COOLDOWN_MINUTES = env_float("FLEETWATCH_LEND_COOLDOWN_MINUTES", 60.0, minimum=0)
FLEETWATCH_LEND_MAX_MOVES = env_int("FLEETWATCH_LEND_MAX_MOVES", 2, minimum=1)
FLEETWATCH_LEND_TICK_SECONDS = env_float("FLEETWATCH_LEND_TICK_SECONDS", 60.0, minimum=1.0)
# A lend waits this long for the jobs running on the node to end, then gives the node back.
FLEETWATCH_LEND_DRAIN_DEADLINE_MINUTES = env_float("FLEETWATCH_LEND_DRAIN_DEADLINE_MINUTES",
                                                   60.0, minimum=0)
# How a lent node is made schedulable for inference: labels set and taints added while lent,
# labels and taints removed while lent (Slinky: the label its NodeSet selects, so the
# operator scales the node's slurmd pod away) and put back on return.
FLEETWATCH_LEND_LABELS = env_labels("FLEETWATCH_LEND_LABELS",
                                    {"fleetwatch.io/lent-to": "inference"})
FLEETWATCH_LEND_REMOVE_LABELS = env_list("FLEETWATCH_LEND_REMOVE_LABELS", [])
FLEETWATCH_LEND_TAINTS = env_taints("FLEETWATCH_LEND_TAINTS")
FLEETWATCH_LEND_REMOVE_TAINTS = env_taint_keys("FLEETWATCH_LEND_REMOVE_TAINTS")
# An eviction a PodDisruptionBudget holds back is tried again after this long.
FLEETWATCH_LEND_EVICT_RETRY_SECONDS = env_float("FLEETWATCH_LEND_EVICT_RETRY_SECONDS", 30.0,
                                                minimum=1.0)
# Run the return-to-service gate on a node coming back from inference before Slurm gets it.
FLEETWATCH_LEND_GATE = env_bool("FLEETWATCH_LEND_GATE", False)
# A lent GPU at least this busy (%) counts as allocated to inference on the capacity page; a
# node without GPU telemetry counts this many GPUs.
FLEETWATCH_LEND_BUSY_UTILIZATION = env_float("FLEETWATCH_LEND_BUSY_UTILIZATION", 5.0, minimum=0)
FLEETWATCH_LEND_GPUS_PER_NODE = env_int("FLEETWATCH_LEND_GPUS_PER_NODE", 8, minimum=1)
# The capacity chart's points: one per pool this often, kept this many days.
FLEETWATCH_CAPACITY_SNAPSHOT_SECONDS = env_float("FLEETWATCH_CAPACITY_SNAPSHOT_SECONDS", 300.0,
                                                 minimum=10.0)
FLEETWATCH_CAPACITY_RETENTION_DAYS = env_int("FLEETWATCH_CAPACITY_RETENTION_DAYS", 8, minimum=1)
# Where replacement, reboot and GPU reset come from: the simulation, Slurm's own reboot, a
# Kubernetes node pool (delete the node, wait for a new one), or a site's program.
FLEETWATCH_PROVIDER = _sources.provider
FLEETWATCH_PROVIDER_COMMAND = _sources.provider_command
FLEETWATCH_PROVIDER_TIMEOUT = _sources.provider_timeout
# Notifiers, each used when set: a JSON webhook (signed with the secret, HMAC-SHA256), a
# Slack-compatible incoming webhook, e-mail through Django's mail backend.
FLEETWATCH_NOTIFY_WEBHOOK_SECRET = env_str("FLEETWATCH_NOTIFY_WEBHOOK_SECRET", "")
FLEETWATCH_NOTIFY_SLACK_URL = env_str("FLEETWATCH_NOTIFY_SLACK_URL", "")
FLEETWATCH_NOTIFY_EMAIL = env_list("FLEETWATCH_NOTIFY_EMAIL", [])
# Where people reach this FleetWatch (links in notifications), e.g. https://fleetwatch.example.
FLEETWATCH_BASE_URL = env_str("FLEETWATCH_BASE_URL", "")
# Why FleetWatch stopped or requeued a job, written into the job in Slurm: its admin comment
# (operators only, so no user can forge it), its comment (where a site's users read that), or
# nowhere. The job's owner is told on their own channel: FLEETWATCH_OWNER_CONTACTS maps Slurm
# users to an e-mail address, slack:MEMBERID or none; anyone else gets USER@DOMAIN when
# FLEETWATCH_OWNER_EMAIL_DOMAIN is set, and no message when it is not.
FLEETWATCH_SLURM_COMMENT_FIELD = env_choice("FLEETWATCH_SLURM_COMMENT_FIELD", "admin_comment",
                                            ["admin_comment", "comment", "none"])
FLEETWATCH_OWNER_EMAIL_DOMAIN = env_str("FLEETWATCH_OWNER_EMAIL_DOMAIN", "").lstrip("@")
FLEETWATCH_OWNER_CONTACTS: dict[str, str] = {}
for _item in env_list("FLEETWATCH_OWNER_CONTACTS", []):
    _user, _sep, _address = (part.strip() for part in _item.partition("="))
    if not (_sep and _user and (_address == "none" or "@" in _address
                                or re.fullmatch(r"slack:[A-Z0-9]{2,32}", _address))):
        raise ImproperlyConfigured(
            f"FLEETWATCH_OWNER_CONTACTS: {_item!r} is not USER=ADDRESS with ADDRESS an e-mail "
            "address, slack:MEMBERID (e.g. slack:U0123ABCD) or none")
    FLEETWATCH_OWNER_CONTACTS[_user] = _address
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = 10
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "fleetwatch@localhost")
FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES = env_int("FLEETWATCH_DIAGNOSIS_WINDOW_MINUTES", 15, minimum=1)
FLEETWATCH_TELEMETRY_RETENTION_HOURS = env_int("FLEETWATCH_TELEMETRY_RETENTION_HOURS", 24, minimum=1)
FLEETWATCH_NOTIFY_WEBHOOK_URL = env_str("FLEETWATCH_NOTIFY_WEBHOOK_URL")
FLEETWATCH_HTTP_TIMEOUT = env_float("FLEETWATCH_HTTP_TIMEOUT", 5.0, minimum=0.1)
# Webhook subscriptions: a delivery that meets a transient failure (no connection, timeout,
# 408, 429, 5xx) is tried again after BACKOFF seconds, five times longer after each failure
# (5 s, 25 s, 2 min, 10 min, ...) but never more than BACKOFF_MAX, up to MAX_ATTEMPTS in all.
FLEETWATCH_WEBHOOK_MAX_ATTEMPTS = env_int("FLEETWATCH_WEBHOOK_MAX_ATTEMPTS", 8, minimum=1)
FLEETWATCH_WEBHOOK_BACKOFF_SECONDS = env_float("FLEETWATCH_WEBHOOK_BACKOFF_SECONDS", 5.0, minimum=0)
FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS = env_float("FLEETWATCH_WEBHOOK_BACKOFF_MAX_SECONDS", 3600.0,
                                                   minimum=0)
# Webhook subscriptions may only point at public addresses: a name that resolves to a
# loopback, private, link-local, multicast or otherwise non-global address is refused (at
# subscribe time and again at each delivery), unless allowed here: exact host names and
# addresses or CIDR ranges, comma-separated ("hooks.corp.internal,10.20.0.0/16,127.0.0.1").
FLEETWATCH_WEBHOOK_ALLOW_HOSTS = env_list("FLEETWATCH_WEBHOOK_ALLOW_HOSTS", [])
for _entry in FLEETWATCH_WEBHOOK_ALLOW_HOSTS:
    try:
        ipaddress.ip_network(_entry, strict=False)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", _entry):
            raise ImproperlyConfigured(
                f"FLEETWATCH_WEBHOOK_ALLOW_HOSTS: {_entry!r} is neither a host name nor an "
                "address or CIDR range") from None
# The audit trail's head, signed and written to the log every CHECKPOINT_MINUTES (0: never)
# so that a trail cut or rewritten in the database is caught against a copy kept elsewhere
# (see README "Audit trail"). The key signs the checkpoints: keep it out of the database.
FLEETWATCH_AUDIT_CHECKPOINT_KEY = env_str("FLEETWATCH_AUDIT_CHECKPOINT_KEY") or SECRET_KEY
FLEETWATCH_AUDIT_CHECKPOINT_MINUTES = env_float("FLEETWATCH_AUDIT_CHECKPOINT_MINUTES", 60.0,
                                                minimum=0)
# The most signals one push (POST /api/v1/signals/) may carry; more gets 413.
FLEETWATCH_INGEST_MAX_BATCH = env_int("FLEETWATCH_INGEST_MAX_BATCH", 1000, minimum=1)
# The largest batch must fit the request size limit. One signal's message holds up to 4,000
# characters, which JSON may write as 6 bytes each ("\u00e9", as Python's json and requests
# do); its extra fields at most 4 KiB, the named fields under 1 KiB: 32 KiB a signal. Django
# refuses bodies over DATA_UPLOAD_MAX_MEMORY_SIZE (the API answers 413 naming it).
FLEETWATCH_INGEST_MESSAGE_MAX_CHARS = 4000
FLEETWATCH_INGEST_EXTRA_MAX_BYTES = 4096
FLEETWATCH_INGEST_SIGNAL_MAX_BYTES = 32 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = max(
    2_621_440, FLEETWATCH_INGEST_MAX_BATCH * FLEETWATCH_INGEST_SIGNAL_MAX_BYTES + 64 * 1024)
# How long a push's Idempotency-Key is remembered (its retry is then answered, not stored).
FLEETWATCH_INGEST_IDEMPOTENCY_HOURS = env_int("FLEETWATCH_INGEST_IDEMPOTENCY_HOURS", 24, minimum=1)
FLEETWATCH_SIM_STATE = _sources.sim_state
FLEETWATCH_SIM_SPEED = _sources.sim_speed
FLEETWATCH_DEMO_CONTROLS = env_bool("FLEETWATCH_DEMO_CONTROLS", FLEETWATCH_FLEET == "sim")
# Real sources. Slurm: its CLI (squeue/sinfo/scontrol/scancel) from this directory ("" = PATH),
# reading SLURM_CONF like any Slurm command. Kubernetes: this kubeconfig ("" = the in-cluster
# service account). Prometheus: the server that scrapes dcgm-exporter and node-exporter.
FLEETWATCH_SLURM_BIN_DIR = _sources.slurm_bin_dir
FLEETWATCH_SLURM_CONF = _sources.slurm_conf  # else SLURM_CONF, else Slurm's default
FLEETWATCH_SLURM_TIMEOUT = _sources.slurm_timeout
# How FleetWatch talks to Slurm: "cli" (the commands above, with munge) or "rest" (slurmrestd
# with JWT, as under Slinky, where the FleetWatch pod has no Slurm binaries or munge).
FLEETWATCH_SLURM_TRANSPORT = _sources.slurm_transport
# Slurm node name -> machine (Kubernetes node / host) where they differ and no slurm-operator
# pods say so: "slurmname=machine" pairs (commas or spaces), or the path of a file of them.
# Under Slinky the slurmd pods' spec.nodeName gives the mapping by itself.
FLEETWATCH_SLURM_NODE_MAP = _sources.slurm_node_map
FLEETWATCH_SLURMRESTD_URL = _sources.slurmrestd_url
# X-SLURM-USER-NAME (optional with a user's own token); the "sun" of minted tokens.
FLEETWATCH_SLURM_USER = _sources.slurm_user
# The JWT: the token itself, a file holding it (re-read when it changes or nears its exp:
# a rotated Secret), or slurmctld's HS256 key to mint short-lived tokens with.
FLEETWATCH_SLURM_JWT = _sources.slurm_jwt
FLEETWATCH_SLURM_JWT_FILE = _sources.slurm_jwt_file
FLEETWATCH_SLURM_JWT_KEY_FILE = _sources.slurm_jwt_key_file
FLEETWATCH_SLURM_JWT_LIFESPAN = _sources.slurm_jwt_lifespan
# slurmctld's own HTTP endpoints (25.11+: /readyz, /metrics), on SlurmctldPort; optional.
FLEETWATCH_SLURMCTLD_URL = _sources.slurmctld_url
# slurmrestd has no topology: a copy of the cluster's topology.conf gives the leaf switches.
FLEETWATCH_SLURM_TOPOLOGY_FILE = _sources.slurm_topology_file
FLEETWATCH_KUBECONFIG = _sources.kubeconfig
FLEETWATCH_KUBE_CONTEXT = _sources.kube_context
FLEETWATCH_PROMETHEUS_URL = _sources.prometheus_url
# Label matchers added to every query, when one Prometheus holds more than this fleet
# (e.g. 'cluster="a100-east"'); a bearer token; TLS verification (true/false or a CA file).
FLEETWATCH_PROMETHEUS_MATCHERS = _sources.prometheus_matchers
FLEETWATCH_PROMETHEUS_TOKEN = _sources.prometheus_token
FLEETWATCH_PROMETHEUS_VERIFY_TLS = _sources.prometheus_verify_tls
FLEETWATCH_STORE_GPU_SAMPLES = _sources.store_gpu_samples

# API tokens: django-rest-knox keeps a SHA-512 digest, never the token; our model adds names,
# scopes and revocation. New tokens last FLEETWATCH_API_TOKEN_TTL_DAYS unless told otherwise
# (0: no expiry). "Token <key>" in the Authorization header, as DRF's own scheme.
KNOX_TOKEN_MODEL = "incidents.ApiToken"
# knox's own migrations would create its (swapped-out, unused) table with a key to users, which
# then blocks the test runner's truncating flush; without them that table is never made.
MIGRATION_MODULES = {"knox": None}
FLEETWATCH_API_TOKEN_TTL_DAYS = env_int("FLEETWATCH_API_TOKEN_TTL_DAYS", 90, minimum=0)
REST_KNOX = {"TOKEN_TTL": None, "AUTH_HEADER_PREFIX": "Token", "TOKEN_PREFIX": "fw_"}
# Requests per token (per user for the browser, per address for anonymous callers).
FLEETWATCH_API_RATE = env_str("FLEETWATCH_API_RATE", "1200/min")
FLEETWATCH_API_INGEST_RATE = env_str("FLEETWATCH_API_INGEST_RATE", "6000/min")
FLEETWATCH_API_ANON_RATE = env_str("FLEETWATCH_API_ANON_RATE", "60/min")
for _name in ("FLEETWATCH_API_RATE", "FLEETWATCH_API_INGEST_RATE", "FLEETWATCH_API_ANON_RATE"):
    if not re.fullmatch(r"\d+/(s|sec|second|m|min|minute|h|hour|d|day)", globals()[_name] or ""):
        raise ImproperlyConfigured(f"{_name}={globals()[_name]!r}: expected a rate such as "
                                   "1200/min (per s, min, h or d)")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "incidents.api.auth.ScopedTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["collectors.api.permissions.FleetWatchAccess"],
    "DEFAULT_THROTTLE_CLASSES": ["collectors.api.throttles.TokenRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {
        "token": FLEETWATCH_API_RATE,
        "ingest": FLEETWATCH_API_INGEST_RATE,
        "anon": FLEETWATCH_API_ANON_RATE,
    },
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    # Limit/offset with a count for most lists; signals and audit page by cursor (their views).
    "DEFAULT_PAGINATION_CLASS": "collectors.api.pagination.LimitOffset",
    "PAGE_SIZE": 100,
    # JSON only: one body format to validate, document and fuzz (the docs page sends JSON).
    # Refuses, naming the field, what the database cannot store (NUL, lone surrogates, 1e999).
    "DEFAULT_PARSER_CLASSES": ["collectors.api.parsers.SafeJSONParser"],
    # Answers survive what is already stored (a lone surrogate, NaN): see renderers.py.
    "DEFAULT_RENDERER_CLASSES": ["collectors.api.renderers.SafeJSONRenderer",
                                 "rest_framework.renderers.BrowsableAPIRenderer"],
    "DEFAULT_SCHEMA_CLASS": "incidents.api.schema.FleetWatchSchema",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "FleetWatch API",
    "DESCRIPTION": "Incidents, remediations, signals and the audit trail of a GPU fleet. "
                   "Authenticate with `Authorization: Token <key>`; see the README.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # Tags and operation ids from the path after /api/v1/ ("incidents", "incidents_list").
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    # Fire drills' choice sets share field names (status, mode) with remediations' and steps'.
    "ENUM_NAME_OVERRIDES": {"DrillStatusEnum": "incidents.models.Drill.Status",
                            "DrillModeEnum": "incidents.models.Drill.Mode",
                            "DrillTriggerEnum": "incidents.models.Drill.Trigger",
                            "ModeEnum": "incidents.models.Remediation.Mode"},
}

# --- Logs and metrics -----------------------------------------------------------------------
# One JSON object a line on stderr (or "plain" text for a terminal), each with the request or
# task id; tokens, passwords, signatures and configured secrets are scrubbed from every line.
# See fleetwatch/logs.py.
FLEETWATCH_LOG_FORMAT = env_choice("FLEETWATCH_LOG_FORMAT", "json", ["json", "plain"])
LOG_LEVEL = (env_str("LOG_LEVEL", "INFO") or "INFO").upper()
LOGGING = logging_config(FLEETWATCH_LOG_FORMAT, LOG_LEVEL)
# Celery workers log through LOGGING too, instead of replacing the root logger's handlers.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# /metrics is open (Prometheus scrapers have no session) unless this is set; then it wants
# "Authorization: Bearer <this>" (Prometheus: authorization.credentials) or a signed-in person.
FLEETWATCH_METRICS_TOKEN = env_str("FLEETWATCH_METRICS_TOKEN", "")
