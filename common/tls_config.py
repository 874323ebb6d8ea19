"""HTTPS on the HTTP port, with vLLM's flags: ``--ssl-keyfile`` and ``--ssl-certfile``
(the server's key and certificate chain, PEM), ``--ssl-ca-certs`` (the CAs a client's
certificate must chain to) and ``--ssl-cert-reqs`` (``ssl.VerifyMode``: 0 = no client
certificate asked, 1 = optional, 2 = required: mutual TLS). uvicorn serves them
(``uvicorn_tls_options``).

The flags are file paths, not secrets, so they travel on child command lines like every
other flag. Only the process facing clients uses them: the API server, or with several
``--model`` the model router, whose per-model services stay plain HTTP on 127.0.0.1
(``NO_TLS``). ``tandem fleet`` refuses them: vLLM's router faces its clients.
"""

from __future__ import annotations

import argparse
import ssl
from typing import Any

from common.config_checks import require

# ssl.VerifyMode's values as plain ints, as vLLM's --ssl-cert-reqs takes them (and as a
# command line gives them back): CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED.
CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED = 0, 1, 2
CERT_REQS: tuple[int, ...] = (CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)

# ServerConfig fields that turn TLS off (a model router's services, on loopback).
NO_TLS: dict[str, Any] = {
    "ssl_keyfile": None,
    "ssl_certfile": None,
    "ssl_ca_certs": None,
    "ssl_cert_reqs": CERT_NONE,
}


def check_tls_flags(
    keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int
) -> None:
    """How the four flags go together, refused where the config is built. (Whether the
    files load is ``check_tls_files``'s: only the process that serves HTTP reads them.)"""
    require(
        bool(keyfile) == bool(certfile),
        "--ssl-keyfile and --ssl-certfile go together: give the server's private key and "
        "its certificate (PEM files) to serve HTTPS",
    )
    require(
        cert_reqs in CERT_REQS,
        f"--ssl-cert-reqs must be 0 (no client certificate), 1 (optional) or 2 (required), "
        f"got {cert_reqs}",
    )
    require(
        bool(certfile) or (not ca_certs and cert_reqs == CERT_NONE),
        "--ssl-ca-certs and --ssl-cert-reqs check client certificates of an HTTPS server: "
        "give --ssl-certfile and --ssl-keyfile too",
    )
    require(
        cert_reqs == CERT_NONE or bool(ca_certs),
        f"--ssl-cert-reqs {cert_reqs} verifies client certificates: give --ssl-ca-certs, "
        "the CA file they must chain to",
    )


def check_tls_files(
    keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int
) -> None:
    """Load the files as uvicorn will, so a missing file, or a key that does not match its
    certificate, is one line before anything starts rather than a traceback later."""
    if not certfile:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile} do not load as a PEM "
            f"certificate and its private key: {e}"
        ) from None
    if ca_certs:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {ca_certs} does not load as PEM CAs: {e}") from None


def uvicorn_tls_options(
    keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int
) -> dict[str, Any]:
    """``uvicorn.Config`` keywords: HTTPS with a certificate, none without (plain HTTP)."""
    if not certfile:
        return {}
    return {
        "ssl_keyfile": keyfile,
        "ssl_certfile": certfile,
        "ssl_ca_certs": ca_certs,
        "ssl_cert_reqs": cert_reqs,
    }


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    """The TLS flags of ``tandem serve`` (``common/cli_args.py`` adds them)."""
    g = parser.add_argument_group("TLS (HTTPS on --port)")
    g.add_argument(
        "--ssl-keyfile",
        default=None,
        help="the server's private key (PEM); with --ssl-certfile, serve HTTPS instead of HTTP",
    )
    g.add_argument(
        "--ssl-certfile",
        default=None,
        help="the server's certificate chain (PEM), with --ssl-keyfile",
    )
    g.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates (PEM) that client certificates must chain to (mutual TLS)",
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=CERT_NONE,
        choices=CERT_REQS,
        help="client certificates: 0 = not asked, 1 = optional, 2 = required (mutual TLS, "
        "with --ssl-ca-certs) (default: %(default)s)",
    )
