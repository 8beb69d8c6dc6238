"""Where the crawler may connect.

Only the public internet is reached unless `allow_private` is set: URL lists come
from untrusted dumps, and a URL or a redirect to a loopback, private, link-local
(169.254.169.254 is a cloud's metadata service) or other non-global address would
otherwise be fetched and stored. The host is resolved once per connection, every
address is checked (`check_address`) and the socket is connected to the checked
address itself (`connect_checked`), so a second DNS answer (rebinding) cannot slip past;
the Host header, TLS SNI and certificate checks still use the host name (GuardedAdapter).
Proxies from the environment are not used: through one, the address connected would not
be the page's.
"""

import ipaddress
import socket
import sys
from collections.abc import Callable

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError
from urllib3.util.connection import allowed_gai_family
from urllib3.util.timeout import _DEFAULT_TIMEOUT

_PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 addresses reached through a NAT64 gateway

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
AddressCheck = Callable[[str], "str | None"]
Resolver = Callable[..., list]  # socket.getaddrinfo's signature and answer


def check_address(address: str | Address) -> str | None:
    """Why a crawl must not connect to `address`, or None for an address of the public
    internet. An IPv6 address that carries an IPv4 one (::ffff:a.b.c.d, 6to4, NAT64), where
    the packets end up, is judged by that one."""
    if isinstance(address, str):
        address = address.split("%", 1)[0]  # an IPv6 zone (fe80::1%eth0)
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            return check_address(inner)
    if ip.is_unspecified:
        return "unspecified address"  # 0.0.0.0 reaches this machine
    if ip.is_loopback:
        return "loopback address"
    if ip.is_link_local:
        return "link-local address"
    if ip.is_multicast:
        return "multicast address"
    if any(ip in network for network in _PRIVATE_NETWORKS if network.version == ip.version):
        return "private address"
    if ip.is_private or ip.is_reserved or not ip.is_global:
        return "non-global address"
    return None


class AddressRefused(Exception):
    """No address of a host may be connected to (not an OSError: it is neither wrapped as a
    connection error nor retried by urllib3, requests or the Fetcher)."""

    def __init__(self, host: str, address: str, reason: str):
        super().__init__(f"{host} resolves to {address}, a {reason}")
        self.host, self.address, self.reason = host, address, reason


def connect_checked(
    host: str,
    port: int,
    check: AddressCheck | None,
    resolve: Resolver = socket.getaddrinfo,
    timeout=_DEFAULT_TIMEOUT,
    source_address=None,
    socket_options=None,
) -> socket.socket:
    """A socket connected to an address of `host` that `check` allows (any when None).
    The host is resolved once here and the socket connected to the very address checked:
    no later lookup, which a DNS rebinding could answer differently, is made. Refused
    addresses are skipped; AddressRefused when every address is refused."""
    host = host.strip("[]")
    refused, error = None, None
    for family, socktype, proto, _, sockaddr in resolve(
        host, port, allowed_gai_family(), socket.SOCK_STREAM
    ):
        reason = check(sockaddr[0]) if check is not None else None
        if reason:
            refused = refused or AddressRefused(host, sockaddr[0], reason)
            continue
        sock = None
        try:
            sock = socket.socket(family, socktype, proto)
            for option in socket_options or ():
                sock.setsockopt(*option)
            if timeout is not _DEFAULT_TIMEOUT:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            error = e
            if sock is not None:
                sock.close()
    if error is not None:
        raise error
    if refused is not None:
        raise refused
    raise OSError(f"no address found for {host}")


def _guarded(base: type, check: AddressCheck | None, resolve: Resolver) -> type:
    """`base` (urllib3's HTTP or HTTPS connection) connecting by connect_checked. Only the
    socket changes: TLS still sends and verifies the host name."""

    class Guarded(base):
        def _new_conn(self) -> socket.socket:  # urllib3's own, but for connect_checked
            try:
                sock = connect_checked(
                    self._dns_host,
                    self.port,
                    check,
                    resolve,
                    self.timeout,
                    self.source_address,
                    self.socket_options,
                )
            except socket.gaierror as e:
                raise NameResolutionError(self.host, self, e) from e
            except TimeoutError as e:
                raise ConnectTimeoutError(
                    self, f"Connection to {self.host} timed out. (connect timeout={self.timeout})"
                ) from e
            except OSError as e:
                raise NewConnectionError(self, f"Failed to establish a new connection: {e}") from e
            sys.audit("http.client.connect", self, self.host, self.port)
            return sock

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


class GuardedAdapter(HTTPAdapter):
    """requests' adapter whose connections reach only addresses that `check` allows (all
    when None), each resolved by `resolve` and connected to as checked. No proxies."""

    def __init__(
        self, check: AddressCheck | None = check_address, resolve: Resolver = socket.getaddrinfo
    ):
        self.check, self.resolve = check, resolve
        super().__init__()

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        http_conn = _guarded(urllib3.connection.HTTPConnection, self.check, self.resolve)
        https_conn = _guarded(urllib3.connection.HTTPSConnection, self.check, self.resolve)

        class HTTPPool(urllib3.HTTPConnectionPool):
            ConnectionCls = http_conn

        class HTTPSPool(urllib3.HTTPSConnectionPool):
            ConnectionCls = https_conn

        self.poolmanager.pool_classes_by_scheme = {"http": HTTPPool, "https": HTTPSPool}

    def proxy_manager_for(self, proxy, **proxy_kwargs):
        raise requests.exceptions.InvalidProxyURL(
            f"proxy {proxy}: the crawler connects directly, to addresses it has checked"
        )
