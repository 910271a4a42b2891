"""A simulated GPU backend driven by real processes (stdlib only; reads ``/proc``).

See :mod:`kiwid.adapters.sim.backend`; the persist file is
:mod:`kiwid.adapters.sim.persist`, daemon-less restores
:mod:`kiwid.adapters.sim.offline`.
"""

from kiwid.adapters.sim.backend import ACTIVITIES, SimAttachment, SimBackend, SimOutOfMemory
from kiwid.adapters.sim.offline import swap_in_persisted

__all__ = ["ACTIVITIES", "SimAttachment", "SimBackend", "SimOutOfMemory", "swap_in_persisted"]
