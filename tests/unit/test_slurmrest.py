"""SlurmRest against a small HTTP server standing in for slurmrestd, for what a real one cannot
be made to answer on demand (a 500, garbage, a version dropped between two calls, a body
without its records), and the JWT handling (minted, rotated, expired). The behaviour against a
real 25.11 slurmrestd is in tests/integration/test_slurmrestd.py."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from collectors.clients.base import ClientError, NotFound, node_or_none
from collectors.clients.slurmrest import (
    SlurmRest,
    TokenSource,
    _b64url_decode,
    jwt_expiry,
    jwt_hs256,
)
from tests.harness.slurm_cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
META = {"plugin": {"type": "openapi/slurmctld", "data_parser": "data_parser/v0.0.42"},
        "slurm": {"version": {"major": "24", "minor": "11", "micro": "6"}}}


def openapi(*versions: int) -> dict[str, Any]:
    return {"openapi": "3.0.3", "paths": {
        **{f"/slurm/v0.0.{v}/{p}": {} for v in versions for p in ("nodes/", "jobs/", "ping/")},
        "/util/v0.0.44/hostlist": {}}}


def nodes_body(*names: str) -> dict[str, Any]:
    return {"meta": META, "errors": [], "warnings": [],
            "nodes": [{"name": n, "state": ["IDLE"], "reason": "", "partitions": ["gpu"]}
                      for n in names]}


class Stub:
    """Routes: (method, path) -> (status, body: dict | str); every request is logged with the
    token it carried."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], tuple[int, Any]] = {}
        self.log: list[tuple[str, str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                stub.log.append((self.command, self.path,
                                 self.headers.get("X-SLURM-USER-TOKEN", "")))
                status, body = stub.routes.get((self.command, self.path.split("?")[0]),
                                               (404, "Unable to find requested URL endpoint."))
                raw = (json.dumps(body) if not isinstance(body, str) else body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    server.routes[("GET", "/openapi/v3")] = (200, openapi(41, 42))
    yield server
    server.close()


def client(url: str, **kw: Any) -> SlurmRest:
    return SlurmRest(url, TokenSource(token="t0k"), user="slurm", timeout=3.0, **kw)


def test_reads_nodes_at_the_highest_known_version(stub: Stub) -> None:
    stub.routes[("GET", "/openapi/v3")] = (200, openapi(40, 41, 42))
    stub.routes[("GET", "/slurm/v0.0.42/nodes/")] = (200, nodes_body("gpu-001", "gpu-002"))
    rest = client(stub.url)
    assert [n.name for n in rest.nodes()] == ["gpu-001", "gpu-002"]
    assert rest.version() == 42 and rest.last_warnings == []
    assert {(m, p.split("?")[0]) for m, p, _ in stub.log} == {
        ("GET", "/openapi/v3"), ("GET", "/slurm/v0.0.42/nodes/")}
    assert {token for _, _, token in stub.log} == {"t0k"}


def test_an_untested_newer_version_is_used_with_a_warning(stub: Stub) -> None:
    stub.routes[("GET", "/openapi/v3")] = (200, openapi(99))
    stub.routes[("GET", "/slurm/v0.0.99/nodes/")] = (200, nodes_body("gpu-001"))
    rest = client(stub.url)
    assert [n.name for n in rest.nodes()] == ["gpu-001"]
    assert rest.version() == 99
    assert len(rest.last_warnings) == 1 and "/slurm/v0.0.99/" in rest.last_warnings[0]
    assert "not tested" in rest.last_warnings[0]


def test_unreachable_slurmrestd_names_the_address() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ClientError, match=f"slurmrestd at {url} is unreachable") as exc:
        client(url).nodes()
    assert exc.value.permanent is False


def test_401_names_the_token_source(stub: Stub) -> None:
    stub.routes[("GET", "/openapi/v3")] = (401, "Authentication failure")
    with pytest.raises(ClientError, match=r"401 Authentication failure.*FLEETWATCH_SLURM_JWT"):
        client(stub.url).nodes()


def test_a_token_slurmctld_refuses_is_named(stub: Stub) -> None:
    # What 25.11 answers for an expired or foreign token (seen on the real one).
    stub.routes[("GET", "/slurm/v0.0.42/nodes/")] = (511, {
        "meta": META, "warnings": [], "errors": [{
            "description": "Failure to query nodes", "error_number": 1007,
            "error": "Protocol authentication error", "source": "_dump_nodes"}]})
    with pytest.raises(ClientError, match=r"slurmctld refused the JWT .*Protocol authentication "
                                          r"error.*expired"):
        client(stub.url).nodes()


def test_500_from_slurmctld_names_its_errors(stub: Stub) -> None:
    stub.routes[("GET", "/slurm/v0.0.42/nodes/")] = (500, {
        "meta": META, "warnings": [], "nodes": [], "errors": [{
            "description": "Failure to query nodes", "error_number": 1008,
            "error": "Unable to contact slurm controller (connect failure)",
            "source": "_dump_nodes"}]})
    with pytest.raises(ClientError, match=r"failed \(500\): _dump_nodes: Failure to query nodes"
                                          ": Unable to contact slurm controller") as exc:
        client(stub.url).nodes()
    assert exc.value.permanent is False  # a controller outage is worth retrying


def test_one_node_unknown_is_not_found_and_an_outage_is_a_failed_read(stub: Stub) -> None:
    stub.routes[("GET", "/slurm/v0.0.42/node/gpu-003")] = (200, nodes_body("gpu-003"))
    assert client(stub.url).node("gpu-003").name == "gpu-003"
    # What 25.11 answers for a name slurmctld does not know (seen on the real one).
    stub.routes[("GET", "/slurm/v0.0.42/node/gpu-999")] = (200, {
        "meta": META, "warnings": [], "nodes": [], "errors": [{
            "description": "Failure to query node gpu-999", "error_number": 0,
            "error": "No error", "source": "_dump_nodes"}]})
    with pytest.raises(NotFound) as unknown:
        client(stub.url).node("gpu-999")
    assert unknown.value.permanent
    assert node_or_none(client(stub.url), "gpu-999") is None
    # The same description with slurmctld away: a read that failed, never "no such node".
    stub.routes[("GET", "/slurm/v0.0.42/node/gpu-003")] = (500, {
        "meta": META, "warnings": [], "nodes": [], "errors": [{
            "description": "Failure to query node gpu-003", "error_number": 1008,
            "error": "Unable to contact slurm controller (connect failure)",
            "source": "_dump_nodes"}]})
    for read in (lambda: client(stub.url).node("gpu-003"),
                 lambda: node_or_none(client(stub.url), "gpu-003"),
                 lambda: client(stub.url).drain("gpu-003", "incident 1")):
        with pytest.raises(ClientError, match="Unable to contact slurm controller") as exc:
            read()
        assert not isinstance(exc.value, NotFound) and exc.value.permanent is False


def test_garbage_is_refused_not_read_as_no_nodes(stub: Stub) -> None:
    stub.routes[("GET", "/slurm/v0.0.42/nodes/")] = (200, "<html>proxy error</html>")
    with pytest.raises(ClientError, match="with no JSON: '<html>proxy error</html>'"):
        client(stub.url).nodes()


def test_a_body_without_its_records_names_the_field(stub: Stub) -> None:
    stub.routes[("GET", "/slurm/v0.0.42/nodes/")] = (200, {"meta": META, "errors": []})
    with pytest.raises(ClientError, match="nodes"):
        client(stub.url).nodes()


def test_a_dropped_version_is_replaced_by_rereading_openapi(stub: Stub) -> None:
    rest = client(stub.url)
    assert rest.version() == 42
    # The server is upgraded: v0.0.42 is gone, v0.0.43 is there.
    stub.routes[("GET", "/openapi/v3")] = (200, openapi(43))
    stub.routes[("GET", "/slurm/v0.0.43/nodes/")] = (200, nodes_body("gpu-001"))
    assert [n.name for n in rest.nodes()] == ["gpu-001"]
    assert rest.version() == 43
    assert [p for _, p, _ in stub.log] == ["/openapi/v3", "/slurm/v0.0.42/nodes/",
                                           "/openapi/v3", "/slurm/v0.0.43/nodes/"]


def test_a_dropped_version_with_nothing_to_replace_it_fails(stub: Stub) -> None:
    rest = client(stub.url)
    assert rest.version() == 42
    stub.routes[("GET", "/openapi/v3")] = (200, openapi(38))  # only what FleetWatch cannot read
    with pytest.raises(ClientError, match=r"serves only v0\.0\.38, older than any FleetWatch "
                                          r"reads") as exc:
        rest.nodes()
    assert exc.value.permanent
    # Listed, but answering 404 all the same: re-read once, then fail naming the call.
    stub.routes[("GET", "/openapi/v3")] = (200, openapi(42))
    with pytest.raises(ClientError, match=r"answered 404 to GET /slurm/v0\.0\.42/nodes/"):
        rest.nodes()
    assert [p for _, p, _ in stub.log].count("/openapi/v3") == 4


def test_resume_refuses_someone_elses_drain(stub: Stub) -> None:
    body = nodes_body("gpu-003")
    body["nodes"][0].update(state=["IDLE", "DRAIN"], reason="admin: bad DIMM")
    stub.routes[("GET", "/slurm/v0.0.42/node/gpu-003")] = (200, body)
    with pytest.raises(ClientError, match="drained by someone else") as exc:
        client(stub.url).resume("gpu-003")
    assert exc.value.permanent
    assert not [m for m, _, _ in stub.log if m == "POST"]


def test_requeue_without_scontrol_is_refused_plainly(stub: Stub, tmp_path: Path) -> None:
    stub.routes[("GET", "/slurm/v0.0.42/jobs/")] = (200, {"meta": META, "errors": [], "jobs": [
        {"job_id": 7, "name": "train", "user_name": "alice", "job_state": ["CANCELLED"],
         "nodes": "gpu-001", "restart_cnt": 0}]})
    rest = client(stub.url, bin_dir=str(tmp_path))  # no scontrol there
    with pytest.raises(ClientError, match=r"slurmrestd has no endpoint for this.*scontrol") as exc:
        rest.requeue("7")
    assert exc.value.permanent


def test_slurmctld_not_ready_fails_the_read_and_metrics_are_cross_checked(stub: Stub) -> None:
    ctld = Stub()
    try:
        stub.routes[("GET", "/slurm/v0.0.42/nodes/")] = (200, nodes_body("gpu-001", "gpu-002"))
        ctld.routes[("GET", "/readyz")] = (503, "")
        rest = client(stub.url, ctld_url=ctld.url)
        with pytest.raises(ClientError, match=r"slurmctld is not ready: GET .*/readyz answered 503"):
            rest.nodes()
        assert not [p for _, p, _ in stub.log if "nodes" in p]  # nothing read past it
        ctld.routes[("GET", "/readyz")] = (204, "")
        ctld.routes[("GET", "/metrics/nodes")] = (200, "".join(
            f'slurm_node_cpus{{node="{n}"}} 4\n' for n in ("gpu-001", "gpu-002", "gpu-003")))
        assert len(rest.nodes()) == 2
        assert rest.last_warnings == ["slurmctld /metrics lists 3 nodes, slurmrestd 2 "
                                      "(not in REST: ['gpu-003'])"]
        ctld.routes.pop(("GET", "/metrics/nodes"))
        rest.nodes()
        assert rest.last_warnings == ["slurmctld /metrics/nodes answered 404 "
                                      "(MetricsType=metrics/openmetrics not set?)"]
    finally:
        ctld.close()


# --- JWT ---------------------------------------------------------------------------------------


def test_minted_tokens_are_hs256_and_renewed_before_expiry(tmp_path: Path) -> None:
    key = os.urandom(32)
    (tmp_path / "jwt.key").write_bytes(key)
    now = [1_000_000.0]
    tokens = TokenSource(key_file=str(tmp_path / "jwt.key"), user="slurm", lifespan=600,
                         clock=lambda: now[0])
    first = tokens.get()
    header, body, signature = first.split(".")
    assert json.loads(_b64url_decode(header)) == {"alg": "HS256", "typ": "JWT"}
    assert json.loads(_b64url_decode(body)) == {"iat": 1_000_000, "exp": 1_000_600, "sun": "slurm"}
    assert _b64url_decode(signature) == hmac.new(key, f"{header}.{body}".encode(),
                                                 hashlib.sha256).digest()
    now[0] += 500
    assert tokens.get() == first  # 100 s left: still good
    now[0] += 60
    assert tokens.get() != first and jwt_expiry(tokens.get()) == 1_000_560 + 600


def test_a_rotated_token_file_is_reread(tmp_path: Path) -> None:
    now = [2_000_000.0]
    path = tmp_path / "token"
    old = jwt_hs256({"exp": 2_000_300, "sun": "slurm"}, b"k")
    path.write_text(f"SLURM_JWT={old}\n")
    tokens = TokenSource(token_file=str(path), clock=lambda: now[0])
    assert tokens.get() == old
    new = jwt_hs256({"exp": 2_003_600, "sun": "slurm"}, b"k")
    path.write_text(new + "\n")
    os.utime(path, (now[0] + 5, now[0] + 5))
    assert tokens.get() == new
    now[0] = 2_003_700
    with pytest.raises(ClientError, match=r"expired at .*re-read"):
        tokens.get()


def test_an_expired_fixed_token_is_named() -> None:
    token = jwt_hs256({"exp": 100, "sun": "slurm"}, b"k")
    with pytest.raises(ClientError, match="FLEETWATCH_SLURM_JWT expired at 1970-01-01 00:01:40Z"):
        TokenSource(token=token, clock=lambda: 200.0).get()


# --- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "message"), [
    ({}, "FLEETWATCH_SLURM_TRANSPORT=rest needs FLEETWATCH_SLURMRESTD_URL"),
    ({"FLEETWATCH_SLURMRESTD_URL": "http://r:6820"}, "needs a token: FLEETWATCH_SLURM_JWT"),
    ({"FLEETWATCH_SLURMRESTD_URL": "http://r:6820", "FLEETWATCH_SLURM_JWT_KEY_FILE": "/k"},
     "mints tokens for FLEETWATCH_SLURM_USER"),
    ({"FLEETWATCH_SLURM_TRANSPORT": "grpc"}, "expected cli or rest"),
])
def test_settings_refuse_rest_without_what_it_needs(tmp_path: Path, env: dict[str, str],
                                                    message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, capture_output=True,
        text=True, timeout=120, check=False,
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
             "FLEETWATCH_DATA_DIR": str(tmp_path / "data"),
             "DJANGO_SETTINGS_MODULE": "fleetwatch.settings", "FLEETWATCH_FLEET": "sim",
             "FLEETWATCH_SLURM_TRANSPORT": "rest", **env})
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr and message in done.stderr, done.stderr[-800:]
