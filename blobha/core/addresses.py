"""Master addresses: ``"h1:p1,h2:p2"`` parsed and checked.

Kept apart from :mod:`blobha.client` so that code which only needs to check a configured
address (the Spark settings read in every task) does not load grpc with the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from blobha.core.errors import InvalidArgument

__all__ = ["DEFAULT_PORT", "host_of", "parse_cluster"]

DEFAULT_PORT = 6627


def parse_cluster(cluster: str | Sequence[str]) -> tuple[str, ...]:
    """Master addresses from ``"h1:p1,h2:p2"`` or a list of such strings, deduplicated.

    A host without a port gets :data:`DEFAULT_PORT`; IPv6 hosts are written in brackets.

    >>> parse_cluster("m1:6627, m2")
    ('m1:6627', 'm2:6627')
    """
    items = [cluster] if isinstance(cluster, str) else list(cluster)
    out: list[str] = []
    for item in items:
        for raw in item.split(","):
            text = raw.strip()
            if not text:
                continue
            host, port = _split_host_port(text)
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if address not in out:
                out.append(address)
    if not out:
        raise InvalidArgument(
            "no master address given; use HOST:PORT[,HOST:PORT...], e.g. 127.0.0.1:6627"
        )
    return tuple(out)


def host_of(address: str) -> str:
    """The host of ``"host:port"`` (an IPv6 host without its brackets).

    >>> host_of("[::1]:6627")
    '::1'
    """
    return _split_host_port(address)[0]


def split_host_port(text: str) -> tuple[str, int]:
    """``"host:port"`` as (host, port); an IPv6 host without its brackets."""
    return _split_host_port(text)


def _split_host_port(text: str) -> tuple[str, int]:
    port_text = ""
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :] if end > 0 else "?"
        if end <= 1 or (rest and not rest.startswith(":")):
            raise InvalidArgument(f"bad master address {text!r}: write IPv6 as [::1]:6627")
        host, port_text = text[1:end], rest[1:]
    elif text.count(":") > 1:
        raise InvalidArgument(f"bad master address {text!r}: write IPv6 as [::1]:6627")
    else:
        host, _, port_text = text.partition(":")
    if not host or any(c.isspace() for c in host):
        raise InvalidArgument(f"bad master address {text!r}: expected HOST:PORT")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgument(f"bad port in master address {text!r}: expected 1-65535")
    return host, int(port_text)


def status_url(config_listen: str, advertise: str) -> str:
    """The page's URL as others should use it: the advertised host with the metrics port."""
    host = advertise.rsplit(":", 1)[0]
    listen_host, port = config_listen.rsplit(":", 1)
    if listen_host not in ("", "0.0.0.0", "::", "[::]"):
        host = listen_host
    return f"http://{host}:{port}/"
