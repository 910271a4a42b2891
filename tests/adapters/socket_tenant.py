"""A tenant (or a client) for tests/adapters/test_sockets.py: real sockets, driven by stdin.

One command a line; each answers one line, ``ok [value]`` or ``error <why>``, once
done, so the test knows the socket state is in place when it reads the answer::

    lo-up                          bring 'lo' up (in a fresh network namespace)
    listen tcp|tcp6 HOST PORT      -> ok <socket id> <port>
    listen unix PATH|@NAME         -> ok <socket id>
    connect tcp|tcp6 HOST PORT     -> ok <socket id>
    connect unix PATH|@NAME        -> ok <socket id>
    accept ID                      -> ok <socket id>   (blocks for a connection)
    recv ID N                      -> ok <text>        (exactly N bytes)
    send ID TEXT                   -> ok
"""

from __future__ import annotations

import socket
import subprocess
import sys

FAMILIES = {"tcp": socket.AF_INET, "tcp6": socket.AF_INET6, "unix": socket.AF_UNIX}


def address(kind: str, args: list[str]) -> tuple[str, int] | str:
    if kind == "unix":  # '@name': the abstract namespace (one per network namespace)
        return "\0" + args[0][1:] if args[0].startswith("@") else args[0]
    return args[0], int(args[1])


def main() -> None:
    sockets: list[socket.socket] = []

    def keep(sock: socket.socket) -> str:
        sockets.append(sock)
        return str(len(sockets) - 1)

    for line in sys.stdin:
        command, *args = line.split()
        try:
            if command == "lo-up":
                subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
                answer = ""
            elif command == "listen":
                sock = socket.socket(FAMILIES[args[0]], socket.SOCK_STREAM)
                sock.bind(address(args[0], args[1:]))
                sock.listen(16)
                answer = keep(sock)
                if args[0] != "unix":
                    answer += f" {sock.getsockname()[1]}"
            elif command == "connect":
                sock = socket.socket(FAMILIES[args[0]], socket.SOCK_STREAM)
                sock.connect(address(args[0], args[1:]))
                answer = keep(sock)
            elif command == "accept":
                answer = keep(sockets[int(args[0])].accept()[0])
            elif command == "recv":
                want, data = int(args[1]), b""
                while len(data) < want:
                    data += sockets[int(args[0])].recv(want - len(data))
                answer = data.decode()
            elif command == "send":
                sockets[int(args[0])].sendall(args[1].encode())
                answer = ""
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception as err:
            print(f"error {err}", flush=True)
        else:
            print(f"ok {answer}".rstrip(), flush=True)


if __name__ == "__main__":
    main()
