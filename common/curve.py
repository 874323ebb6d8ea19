"""CurveZMQ for the engine's sockets when they listen beyond this host.

``tandem keys DIR`` makes two key pairs with pyzmq's ``zmq.auth``: the engine's
(``server.key`` / ``server.key_secret``) and its peers' (``client.key`` /
``client.key_secret``; API servers and workers). Every process of one deployment is
given the directory (a mounted secret), never a key on its command line. The engine's
sockets are Curve servers that accept only the client key, checked by zmq.auth's
authenticator thread; peers are Curve clients that know the engine's public key. A peer
without the keys never completes the handshake: its frames never reach the engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER, CLIENT = "server", "client"


def generate_keys(directory: str) -> Path:
    """Write both key pairs into ``directory`` (0700; secret files 0600)."""
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    for name in (SERVER, CLIENT):
        public, secret = zmq.auth.create_certificates(str(path), name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
    return path


class CurveKeys:
    """One deployment's keys, loaded from the directory ``generate_keys`` wrote."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        try:
            self.server_public, self.server_secret = zmq.auth.load_certificate(
                str(self.directory / f"{SERVER}.key_secret")
            )
            self.client_public, self.client_secret = zmq.auth.load_certificate(
                str(self.directory / f"{CLIENT}.key_secret")
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--curve-keys {directory}: cannot read the key pairs ({e}); make them with "
                "`tandem keys DIR`"
            ) from None

    def start_authenticator(self, ctx: zmq.Context[Any]) -> ThreadAuthenticator:
        """Accept Curve clients presenting the deployment's client key, on every socket
        of ``ctx`` that is a Curve server. Stop it (``stop()``) before terminating ``ctx``."""
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.directory))
        return auth

    def make_server(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def make_client(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public
