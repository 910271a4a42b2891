"""The control socket: JSON lines over a Unix stream socket, server and tiny client.

``schema`` is the command table (arguments and who may send what), ``wire`` one
request line (strict parsing, checks, errors), ``server`` the asyncio server
(framing, limits per uid, authorisation, answers in order), ``client`` one
request and its answer. The wire format is described in
``docs/control-protocol.md``. Standard library only.
"""

from kiwid.adapters.control.client import request
from kiwid.adapters.control.schema import (
    ADMIN_COMMANDS,
    COMMANDS,
    ERROR_CODES,
    PROTOCOL_VERSION,
    READ_COMMANDS,
    ROOT_COMMANDS,
    Access,
    Arg,
    CommandSpec,
    CommandTableMismatch,
    Kind,
    check_command_table,
)
from kiwid.adapters.control.server import ControlServer, peer_of
from kiwid.adapters.control.wire import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    ControlError,
    DaemonUnreachable,
    EncodedResult,
    Handler,
    Peer,
    SocketInUse,
)

__all__ = [
    "ADMIN_COMMANDS",
    "COMMANDS",
    "ERROR_CODES",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "PROTOCOL_VERSION",
    "READ_COMMANDS",
    "ROOT_COMMANDS",
    "Access",
    "Arg",
    "CommandSpec",
    "CommandTableMismatch",
    "ControlError",
    "ControlServer",
    "DaemonUnreachable",
    "EncodedResult",
    "Handler",
    "Kind",
    "Peer",
    "SocketInUse",
    "check_command_table",
    "peer_of",
    "request",
]
