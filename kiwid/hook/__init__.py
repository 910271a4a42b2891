"""kiwi-hook: the OCI hook that registers containers with kiwid (see `kiwid.hook.main`)."""

from __future__ import annotations
