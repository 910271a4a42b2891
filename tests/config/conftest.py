from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_service_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test as check-config runs by hand, even when pytest runs under systemd."""
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
