"""Sign-in with OpenID Connect: ``--oidc-issuer``, ``--oidc-audience``, ``--oidc-jwks-url``
(the issuer's keys, instead of discovering them through its
``/.well-known/openid-configuration``) and ``--oidc-tenant-claim`` (the claim that names
the caller: its rate limits, prefix-cache salt and cancellation rights, as an API key's).

Only the flags and how they go together live here; the API servers verify tokens
(``api_server/oidc.py``). The flags are URLs and names, not secrets, so they travel on child
command lines like every other flag.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from common.config_checks import require

DEFAULT_TENANT_CLAIM = "sub"


def check_oidc_flags(
    issuer: str | None, audience: str | None, jwks_url: str | None, tenant_claim: str
) -> None:
    """How the flags go together, refused where the config is built."""
    require(
        bool(issuer) == bool(audience),
        "--oidc-issuer and --oidc-audience go together: a token is accepted only from that "
        "issuer and for that audience",
    )
    require(
        not jwks_url or bool(issuer),
        "--oidc-jwks-url overrides the keys of --oidc-issuer: give --oidc-issuer and "
        "--oidc-audience too",
    )
    for flag, url in (("--oidc-issuer", issuer), ("--oidc-jwks-url", jwks_url)):
        require(
            not url or url.startswith(("https://", "http://")),
            f"{flag} takes an http(s) URL, got {url!r}",
        )
        # Keys fetched over plain HTTP could be anyone's on the way: whoever answers
        # the fetch could sign in as any tenant. Loopback (a local issuer, tests) only.
        host = urlsplit(url).hostname if url else None
        require(
            not url or url.startswith("https://") or host in ("127.0.0.1", "localhost", "::1"),
            f"{flag} {url} is plain HTTP: the signing keys must come over https:// "
            "(http:// only on 127.0.0.1)",
        )
    require(bool(tenant_claim), "--oidc-tenant-claim must name a claim")


def add_oidc_args(parser: argparse.ArgumentParser) -> None:
    """The OIDC flags of ``tandem serve`` (``common/cli_args.py`` adds them)."""
    g = parser.add_argument_group("OIDC sign-in (bearer JWTs; API keys may be on too)")
    g.add_argument(
        "--oidc-issuer",
        default=None,
        help="accept bearer JWTs from this issuer (its `iss`), verified with its published "
        "keys (RS256, ES256); with --oidc-audience",
    )
    g.add_argument(
        "--oidc-audience",
        default=None,
        help="the audience (`aud`) tokens must be issued for",
    )
    g.add_argument(
        "--oidc-jwks-url",
        default=None,
        help="the issuer's JWKS; default: the jwks_uri of its /.well-known/openid-configuration",
    )
    g.add_argument(
        "--oidc-tenant-claim",
        default=DEFAULT_TENANT_CLAIM,
        help="the token claim naming the tenant, for rate limits, the prefix-cache salt and "
        "cancellation (default: %(default)s)",
    )
