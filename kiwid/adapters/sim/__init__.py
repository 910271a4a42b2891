"""A simulated GPU backend driven by real processes (stdlib only; reads ``/proc``).

See :mod:`kiwid.adapters.sim.backend`; the persist file is
:mod:`kiwid.adapters.sim.persist`, daemon-less restores
:mod:`kiwid.adapters.sim.offline`, faults injected into its swaps
:mod:`kiwid.adapters.sim.faults`.
"""

from kiwid.adapters.sim.backend import ACTIVITIES, SimAttachment, SimBackend, SimOutOfMemory
from kiwid.adapters.sim.faults import SimFault, SimFaults
from kiwid.adapters.sim.offline import swap_in_persisted

__all__ = [
    "ACTIVITIES",
    "SimAttachment",
    "SimBackend",
    "SimFault",
    "SimFaults",
    "SimOutOfMemory",
    "swap_in_persisted",
]
