"""The package's environment switches read "on" one way (custom_ops/_env.py)."""

import pytest

from custom_ops._env import env_flag


@pytest.mark.parametrize("value", ["1", "true", "on", "yes", "TRUE", "On", "YES"])
def test_on_values(monkeypatch, value):
    monkeypatch.setenv("CUSTOM_OPS_TEST_SWITCH", value)
    assert env_flag("CUSTOM_OPS_TEST_SWITCH")


@pytest.mark.parametrize("value", ["0", "false", "off", "no", "", "2", "y"])
def test_off_values(monkeypatch, value):
    monkeypatch.setenv("CUSTOM_OPS_TEST_SWITCH", value)
    assert not env_flag("CUSTOM_OPS_TEST_SWITCH")


def test_unset_is_off(monkeypatch):
    monkeypatch.delenv("CUSTOM_OPS_TEST_SWITCH", raising=False)
    assert not env_flag("CUSTOM_OPS_TEST_SWITCH")
