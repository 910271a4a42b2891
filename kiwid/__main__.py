"""``python -m kiwid`` runs the daemon's command line."""

from __future__ import annotations

from kiwid.daemon.main import main

raise SystemExit(main())
