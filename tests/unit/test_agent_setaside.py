"""The node agent is never stuck behind a batch the server cannot take: a batch answered with a
server error is tried a bounded number of times, with backoff, then set aside beside the
spool, and the rest flows. Every batch carries one idempotency key, the same on each try and
after a restart, so FleetWatch stores a retried batch once.

A small local HTTP server plays FleetWatch where it must misbehave (answer 500 to one batch);
the last test pushes to a live FleetWatch."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from collectors import services as collectors
from collectors.agent.push import Pusher
from collectors.agent.runner import Agent
from collectors.agent.spool import Spool
from collectors.models import Signal
from incidents.tokens import agent_token_create

XID79 = "NVRM: Xid (PCI:0000:9b:00): 79, pid=881, name=python, GPU has fallen off the bus."


@dataclass
class FakeFleetWatch:
    """Answers each push with ``answer(signals)``; remembers what it got."""

    answer: Callable[[list[dict[str, Any]]], int]
    seen: list[tuple[str | None, list[str]]] = field(default_factory=list)  # (key, messages)
    url: str = ""


@pytest.fixture
def fake() -> Iterator[FakeFleetWatch]:
    server_side = FakeFleetWatch(lambda signals: 201)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            signals = body["signals"]
            server_side.seen.append((self.headers.get("Idempotency-Key"),
                                     [s["message"] for s in signals]))
            code = server_side.answer(signals)
            payload = json.dumps({"stored": len(signals)} if code == 201
                                 else {"detail": f"answer {code}"}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server_side.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server_side
    server.shutdown()
    server.server_close()


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _agent(tmp_path: Path, url: str, clock: Clock, **kw: Any) -> Agent:
    return Agent("gpu-003", Spool(tmp_path / "spool.jsonl"),
                       Pusher(url, "fw_token", timeout=5), batch=1, now=clock, **kw)


def _line(message: str) -> dict[str, Any]:
    return {"at": "2026-12-03T10:00:00Z", "source": "kernel", "node": "gpu-003",
            "message": message}


def test_a_batch_the_server_fails_on_is_set_aside_after_its_tries_and_the_rest_flows(
        fake: FakeFleetWatch, tmp_path: Path) -> None:
    fake.answer = lambda signals: 500 if "poison" in signals[0]["message"] else 201
    clock = Clock()
    runner = _agent(tmp_path, fake.url, clock, max_tries=3, retry_backoff=30)
    runner.spool.add([_line("poison"), _line("a"), _line("b")])

    assert runner.flush() == 0  # try 1 failed: the batch waits 30 s, the rest behind it
    assert runner.flush() == 0 and len(fake.seen) == 1  # not due yet: nothing sent
    clock.t += 30
    assert runner.flush() == 0 and len(fake.seen) == 2  # try 2 failed: now 60 s
    clock.t += 59
    assert runner.flush() == 0 and len(fake.seen) == 2
    # A restarted agent carries on from the spool: the same batch, key and count of tries.
    runner = _agent(tmp_path, fake.url, clock, max_tries=3, retry_backoff=30)
    clock.t += 1
    assert runner.flush() == 3  # try 3 failed: set aside; "a" and "b" sent
    assert [m for _, m in fake.seen] == [["poison"]] * 3 + [["a"], ["b"]]
    keys = [k for k, _ in fake.seen]
    assert len(set(keys[:3])) == 1 and len(set(keys)) == 3 and None not in keys
    assert len(runner.spool) == 0
    [aside] = [json.loads(line) for line in
               (tmp_path / "spool.rejected").read_text().splitlines()]
    assert aside["signals"] == [_line("poison")] and aside["tries"] == 3
    assert aside["key"] == keys[0] and "500" in aside["error"]


@pytest.mark.parametrize("code", [503, 429, 401, 404, 408])
def test_answers_that_are_not_about_the_batch_keep_it_however_often_they_come(
        fake: FakeFleetWatch, tmp_path: Path, code: int) -> None:
    fake.answer = lambda signals: code
    clock = Clock()
    runner = _agent(tmp_path, fake.url, clock, max_tries=2, retry_backoff=0)
    runner.spool.add([_line("a")])
    for _ in range(5):
        assert runner.flush() == 0
    assert len(runner.spool) == 1 and not (tmp_path / "spool.rejected").exists()
    assert len({k for k, _ in fake.seen}) == 1  # one batch, one key, every time
    fake.answer = lambda signals: 201
    assert runner.flush() == 1 and len(runner.spool) == 0


def test_a_refused_batch_is_set_aside_at_once(fake: FakeFleetWatch, tmp_path: Path) -> None:
    fake.answer = lambda signals: 403 if signals[0]["message"] == "other" else 201
    runner = _agent(tmp_path, fake.url, Clock(), max_tries=5, retry_backoff=30)
    runner.spool.add([_line("other"), _line("a")])
    assert runner.flush() == 2
    assert [m for _, m in fake.seen] == [["other"], ["a"]]
    [aside] = (tmp_path / "spool.rejected").read_text().splitlines()
    assert json.loads(aside)["tries"] == 1 and "403" in json.loads(aside)["error"]


def test_the_tries_and_backoff_come_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETWATCH_AGENT_MAX_TRIES", "7")
    monkeypatch.setenv("FLEETWATCH_AGENT_RETRY_BACKOFF", "2.5")
    runner = Agent("gpu-003", Spool(tmp_path / "s.jsonl"),
                         Pusher("http://127.0.0.1:9", "fw_token"))
    assert (runner.max_tries, runner.retry_backoff) == (7, 2.5)
    monkeypatch.setenv("FLEETWATCH_AGENT_MAX_TRIES", "lots")
    runner = Agent("gpu-003", Spool(tmp_path / "s.jsonl"),
                         Pusher("http://127.0.0.1:9", "fw_token"))
    assert runner.max_tries == 5


def test_a_batch_whose_answer_was_lost_is_stored_once(
        transactional_db: None, sim_fleet: Any, live_server: Any, tmp_path: Path) -> None:
    for source in ("slurm", "kubernetes", "telemetry"):
        collectors.collect_source(source)
    token = agent_token_create("gpu-003")[1]
    runner = Agent("gpu-003", Spool(tmp_path / "spool.jsonl"),
                         Pusher(live_server.url, token, timeout=10), batch=10)
    runner.spool.add([_line(XID79), _line("mlx5_core 0000:0c:00.0: Link down")])
    # FleetWatch stores the sealed batch, and the agent dies before it hears so.
    batch = runner.spool.batch(runner.batch)
    assert batch is not None
    runner.pusher.push(batch.signals, key=batch.key)
    assert Signal.objects.filter(source="kernel").count() == 2
    # Restarted, it sends the same batch again under the same key: stored once.
    restarted = Agent("gpu-003", Spool(tmp_path / "spool.jsonl"),
                            Pusher(live_server.url, token, timeout=10), batch=10)
    assert restarted.flush() == 2 and len(restarted.spool) == 0
    assert Signal.objects.filter(source="kernel").count() == 2
    assert not (tmp_path / "spool.rejected").exists()


def test_sealing_a_batch_keeps_the_spool_and_a_restart_sends_the_batch_it_sealed(
        tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    spool.add([_line(str(i)) for i in range(7)])
    sealed = spool.batch(3)
    assert sealed is not None and [s["message"] for s in sealed.signals] == ["0", "1", "2"]
    assert len(spool) == 7  # nothing lost by writing the header
    # An agent restarted with a smaller batch size sends the batch as sealed, under its key.
    again = spool.batch(2)
    assert again is not None and (again.key, again.signals) == (sealed.key, sealed.signals)
    spool.drop(3)
    fresh = spool.batch(2)
    assert fresh is not None and fresh.key != sealed.key
    assert [s["message"] for s in fresh.signals] == ["3", "4"] and len(spool) == 4
