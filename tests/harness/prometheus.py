"""A real Prometheus for tests: Debian's ``prometheus`` binary with a private TSDB and port.

    with PrometheusServer(tmp_path / "prom", ["127.0.0.1:9400"]) as prom:
        PrometheusConnect(prom.url).custom_query("up")

``kill()`` stops it hard (SIGKILL, as a crash would) and ``restart()`` brings it back on the same
port and TSDB, for outage tests; ``pause()``/``resume()`` make it hang without going away.
Targets are ``host:port`` strings or ``ScrapeTarget``s (another job, a metrics path, or labels
of their own, such as one ``instance`` per simulated node).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BINARY_ENV = "FLEETWATCH_PROMETHEUS_BIN"


class PrometheusError(RuntimeError):
    pass


@dataclass(frozen=True)
class ScrapeTarget:
    address: str  # host:port
    metrics_path: str = "/metrics"
    labels: Mapping[str, str] = field(default_factory=dict)
    job: str = "fleetwatch"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now. Another process could take it before Prometheus does;
    on loopback in a test run that is rare, and start() then fails loudly with the log."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_binary() -> str:
    binary = os.environ.get(BINARY_ENV) or shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        raise PrometheusError(
            f"the prometheus binary was not found (looked at ${BINARY_ENV}, PATH and "
            "/usr/bin/prometheus): install Debian's `prometheus` package "
            "(apt-get install prometheus) or set FLEETWATCH_PROMETHEUS_BIN")
    return binary


PROMTOOL_ENV = "FLEETWATCH_PROMTOOL_BIN"


def find_promtool() -> str:
    """promtool, which ships with the prometheus package: $FLEETWATCH_PROMTOOL_BIN, beside the
    prometheus binary in use, on PATH, or /usr/bin/promtool."""
    beside = ""
    with contextlib.suppress(PrometheusError):  # no prometheus: look elsewhere
        beside = str(Path(find_binary()).with_name("promtool"))
    for candidate in (os.environ.get(PROMTOOL_ENV), beside, shutil.which("promtool"),
                      "/usr/bin/promtool"):
        if candidate and Path(candidate).exists():
            return candidate
    raise PrometheusError(
        f"promtool was not found (looked at ${PROMTOOL_ENV}, beside the prometheus binary, PATH "
        "and /usr/bin/promtool): it comes with Debian's `prometheus` package, which "
        "`make test` installs (deploy/bootstrap.sh test)")


class PrometheusServer:
    def __init__(
        self,
        root: Path,
        targets: Sequence[str | ScrapeTarget],
        scrape_interval: str = "1s",
        *,
        honor_labels: bool = True,
        host: str = "127.0.0.1",
        port: int | None = None,
        ready_timeout: float = 30.0,
        relabel: Mapping[str, Sequence[Mapping[str, object]]] | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """``relabel``: a job's relabel_configs (job name -> rules), as in prometheus.yml.
        ``extra``: more top-level sections of prometheus.yml (``remote_write``,
        ``rule_files``, ``alerting``), and ``global`` keys to add or override."""
        self.root = Path(root)
        self.extra = dict(extra or {})
        self.relabel = dict(relabel or {})
        self.targets = [t if isinstance(t, ScrapeTarget) else ScrapeTarget(t) for t in targets]
        self.scrape_interval = scrape_interval
        # The simulated exporter's combined page names each node's series itself (instance);
        # honor_labels keeps those labels as a federation or Pushgateway job would.
        self.honor_labels = honor_labels
        self.host = host
        self.port = port or free_port(host)
        self.ready_timeout = ready_timeout
        self.binary = find_binary()
        self.config_path = self.root / "prometheus.yml"
        self.data_path = self.root / "tsdb"
        self.log_path = self.root / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def config(self) -> dict[str, object]:
        jobs: dict[str, list[dict[str, object]]] = {}
        for t in self.targets:
            labels = dict(t.labels)
            if t.metrics_path != "/metrics":
                # A target's own path: Prometheus takes __metrics_path__ from the target's
                # labels before it falls back to the job's metrics_path.
                labels["__metrics_path__"] = t.metrics_path
            group: dict[str, object] = {"targets": [t.address]}
            if labels:
                group["labels"] = labels
            jobs.setdefault(t.job, []).append(group)
        extra = dict(self.extra)
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                # A scrape may not outlast its interval (Prometheus refuses the config).
                "scrape_timeout": self.scrape_interval,
                "evaluation_interval": self.scrape_interval,
                **dict(extra.pop("global", {})),
            },
            **extra,
            "scrape_configs": [
                {"job_name": job, "honor_labels": self.honor_labels, "static_configs": groups,
                 **({"relabel_configs": [dict(r) for r in self.relabel[job]]}
                    if job in self.relabel else {})}
                for job, groups in jobs.items()
            ],
        }

    def start(self) -> PrometheusServer:
        if self.running:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        # JSON is YAML: no YAML writer needed.
        self.config_path.write_text(json.dumps(self.config(), indent=2))
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [self.binary,
                 f"--config.file={self.config_path}",
                 f"--storage.tsdb.path={self.data_path}",
                 "--storage.tsdb.retention.time=1d",
                 f"--web.listen-address={self.host}:{self.port}",
                 "--web.enable-lifecycle",
                 "--log.level=warn"],
                cwd=self.root, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the test run is ours to handle
            )
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self._proc.returncode}:\n"
                                      f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise PrometheusError(f"prometheus not ready at {self.url} after {self.ready_timeout}s:\n"
                              f"{self.log_tail()}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """A clean shutdown (SIGTERM: Prometheus flushes its head block), then SIGKILL."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # a paused one could not act on SIGTERM
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown. The TSDB keeps its write-ahead log for restart()."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections (the kernel does that) but nothing
        answers, as with an overloaded or wedged server. ``resume()`` undoes it."""
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> PrometheusServer:
        self.kill()
        return self.start()

    def reload(self) -> None:
        """Re-read the config (after changing ``targets``) through the lifecycle API."""
        self.config_path.write_text(json.dumps(self.config(), indent=2))
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
