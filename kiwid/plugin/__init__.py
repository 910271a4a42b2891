"""kiwi-device-plugin: Kiwi's kubelet device plugin (see `kiwid.plugin.main`)."""

from __future__ import annotations
