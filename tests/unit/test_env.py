from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from collectors.env import env_bool, env_choice, env_float, env_int, env_list, env_subset


def test_unset_values_take_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FW_X", raising=False)
    assert env_int("FW_X", 7) == 7
    assert env_bool("FW_X", True) is True
    assert env_list("FW_X", ["a"]) == ["a"]


@pytest.mark.parametrize(
    ("helper", "value", "message"),
    [
        (lambda: env_int("FW_X", 1), "ten", "FW_X='ten' is not an integer"),
        (lambda: env_int("FW_X", 1, minimum=0), "-3", "FW_X=-3 must be at least 0"),
        (lambda: env_float("FW_X", 1.0), "fast", "FW_X='fast' is not a number"),
        (lambda: env_bool("FW_X", False), "maybe", "FW_X='maybe' is not a boolean"),
        (lambda: env_choice("FW_X", "auto", ["auto", "observe"]), "yolo", "is not one of"),
        (lambda: env_subset("FW_X", [], ["slurm"]), "slurm,lsf", "unknown entries lsf"),
    ],
)
def test_bad_values_fail_loudly(
    monkeypatch: pytest.MonkeyPatch, helper: object, value: str, message: str
) -> None:
    monkeypatch.setenv("FW_X", value)
    with pytest.raises(ImproperlyConfigured, match=message):
        helper()  # type: ignore[operator]


def test_good_values_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FW_X", " slurm , kubernetes ")
    assert env_subset("FW_X", [], ["slurm", "kubernetes"]) == ["slurm", "kubernetes"]
    monkeypatch.setenv("FW_X", "Off")
    assert env_bool("FW_X", True) is False


def test_settings_refuse_a_bad_policy_mode() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", "import django, os; os.environ['DJANGO_SETTINGS_MODULE']="
         "'fleetwatch.settings'; django.setup()"],
        env={"FLEETWATCH_POLICY_MODE": "sometimes", "PATH": "/usr/bin:/bin",
             "FLEETWATCH_DATA_DIR": "/tmp/fleetwatch-env-test"},
        capture_output=True, text=True, check=False,
    )
    assert result.returncode != 0
    assert "FLEETWATCH_POLICY_MODE='sometimes' is not one of auto, approve, observe" in result.stderr
