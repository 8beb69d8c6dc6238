"""The crawler reaches only the public internet unless told otherwise (--allow-private).

Everything here runs against a server on 127.0.0.1 and never touches the network: a
refused address is refused before any connection, and the "public" hosts of the tests
are names that an injected resolver maps to 127.0.0.1 while an injected check lets
127.0.0.1 (only) through, so a redirect from an allowed host to a private one can be
shown. The addresses are checked by `check_address` and connected to as checked
(`connect_checked`): one lookup per connection, Host header, SNI and certificate checks
by the host name.
"""

import contextlib
import json
import shutil
import socket
import ssl
import subprocess
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from megadata.cli import main
from megadata.crawl import CrawlSettings, crawl
from megadata.crawl.addresses import AddressRefused, GuardedAdapter, check_address, connect_checked
from megadata.crawl.fetch import Fetcher, HostScheduler, crawl_url
from megadata.crawl.filters import load_blacklist

SETTINGS = CrawlSettings(
    timeout=2.0, page_deadline=4.0, retries=2, backoff=0.01, per_host=4, host_delay=0.0
)


def article(doc: dict) -> bytes:
    paragraphs = "".join(f"<p>{p}</p>" for p in doc["text"].split("\n\n"))
    return (
        f"<html><head><title>{doc['title']}</title></head><body>"
        f"<article><h1>{doc['title']}</h1>{paragraphs}</article></body></html>"
    ).encode()


class Site(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, docs: list[dict]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.docs = docs
        self.requests: list[tuple[str, str]] = []  # (path, Host header)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server_port}{path}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        site, port = self.server, self.server.server_port
        site.requests.append((self.path, self.headers.get("Host", "")))
        targets = {
            "/to-private": f"http://intranet.test:{port}/secret",
            "/to-private-ip": "http://192.168.1.1/admin",
            "/to-metadata": "http://169.254.169.254/latest/meta-data/",
            "/to-loopback": f"http://127.0.0.2:{port}/article",
            "/to-ipv6-loopback": f"http://[::1]:{port}/article",
            "/to-public": f"http://public.test:{port}/article",
        }
        if self.path in targets:
            self.send_response(302)
            self.send_header("Location", targets[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = article(site.docs[0])
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def site(documents):
    server = Site(documents)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


NAMES = {"public.test": "127.0.0.1", "rebind.test": "127.0.0.1", "intranet.test": "10.1.2.3"}


class Resolver:
    """getaddrinfo with a few made-up names, counting its lookups."""

    def __init__(self, names: dict[str, str | list[str]] = NAMES):
        self.names, self.lookups = names, []

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        self.lookups.append(host)
        if host not in self.names:
            return socket.getaddrinfo(host, port, family, type, proto, flags)
        addresses = self.names[host]
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))
            for address in ([addresses] if isinstance(addresses, str) else addresses)
        ]


def only_127_0_0_1(address: str) -> str | None:
    """The tests' stand-in for "the public internet": 127.0.0.1, nothing else."""
    return None if address == "127.0.0.1" else check_address(address)


def errors_of(out: Path) -> dict[str, dict]:
    path = out / "errors.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["url"]: r for r in map(json.loads, lines)}


def pages_of(out: Path) -> dict[str, dict]:
    path = out / "pages.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["url"]: r for r in map(json.loads, lines)}


# ------------------------------------------------------------------- check_address


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback address"),
        ("127.8.9.10", "loopback address"),
        ("::1", "loopback address"),
        ("10.1.2.3", "private address"),
        ("172.16.0.1", "private address"),
        ("172.31.255.254", "private address"),
        ("192.168.1.1", "private address"),
        ("100.64.0.1", "private address"),  # carrier-grade NAT
        ("fc00::1", "private address"),
        ("fd12:3456::1", "private address"),
        ("169.254.169.254", "link-local address"),  # a cloud's metadata service
        ("fe80::1", "link-local address"),
        ("fe80::1%eth0", "link-local address"),
        ("0.0.0.0", "unspecified address"),
        ("::", "unspecified address"),
        ("224.0.0.1", "multicast address"),
        ("ff02::1", "multicast address"),
        ("192.0.2.10", "non-global address"),  # documentation
        ("198.18.0.1", "non-global address"),  # benchmarking
        ("240.0.0.1", "non-global address"),  # reserved
        ("255.255.255.255", "non-global address"),
        ("::ffff:127.0.0.1", "loopback address"),  # IPv4-mapped
        ("::ffff:10.0.0.1", "private address"),
        ("2002:a9fe:a9fe::1", "link-local address"),  # 6to4 of 169.254.169.254
        ("64:ff9b::a00:1", "private address"),  # NAT64 of 10.0.0.1
    ],
)
def test_check_address_refuses_what_is_not_the_public_internet(address, reason):
    assert check_address(address) == reason


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        "93.184.216.34",
        "172.32.0.1",
        "2606:4700:4700::1111",
        "::ffff:8.8.8.8",
        "2002:808:808::1",  # 6to4 of 8.8.8.8
        "64:ff9b::808:808",  # NAT64 of 8.8.8.8
    ],
)
def test_check_address_allows_public_addresses(address):
    assert check_address(address) is None


# ------------------------------------------------------------------- refusals in a crawl


def test_non_public_hosts_are_refused_without_the_flag(site, tmp_path):
    port = site.server_port
    refused = {
        site.url("/article"): "loopback address",
        f"http://localhost:{port}/article": "loopback address",
        f"http://[::1]:{port}/article": "loopback address",
        f"http://0.0.0.0:{port}/article": "unspecified address",
        "http://10.1.2.3/": "private address",
        "http://192.168.0.1/router": "private address",
        "http://169.254.169.254/latest/meta-data/": "link-local address",
    }
    url_list = tmp_path / "urls.txt"
    url_list.write_text("\n".join(refused) + "\n")

    summary = crawl([url_list], tmp_path / "out", SETTINGS, progress=False)

    errors = errors_of(tmp_path / "out")
    assert {url: e["reason"] for url, e in errors.items()} == refused
    assert all(e["stage"] == "fetch" and "--allow-private" in e["detail"] for e in errors.values())
    assert "127.0.0.1 resolves to 127.0.0.1" in errors[site.url("/article")]["detail"]
    assert not (tmp_path / "out" / "pages.jsonl").read_text()
    assert site.requests == []  # refused before connecting, and not retried
    assert summary["reasons"]["fetch"] == {
        "loopback address": 3,
        "private address": 2,
        "unspecified address": 1,
        "link-local address": 1,
    }

    # --allow-private: the same local site is crawled.
    allowed = replace(SETTINGS, allow_private=True)
    crawl([url_list], tmp_path / "intranet", allowed, progress=False)
    assert site.url("/article") in pages_of(tmp_path / "intranet")


def test_a_redirect_to_a_non_public_address_is_refused(site, tmp_path):
    port = site.server_port
    urls = {
        "/to-private": "redirect to private address",
        "/to-private-ip": "redirect to private address",
        "/to-metadata": "redirect to link-local address",
        "/to-loopback": "redirect to loopback address",
        "/to-ipv6-loopback": "redirect to loopback address",
    }
    url_list = tmp_path / "urls.txt"
    listed = [site.url(path, "public.test") for path in [*urls, "/to-public"]]
    url_list.write_text("\n".join(listed) + "\n")
    resolver = Resolver()

    crawl(
        [url_list],
        tmp_path / "out",
        SETTINGS,
        progress=False,
        check=only_127_0_0_1,
        resolve=resolver,
    )

    errors = errors_of(tmp_path / "out")
    assert {url: e["reason"] for url, e in errors.items()} == {
        site.url(path, "public.test"): reason for path, reason in urls.items()
    }
    detail = errors[site.url("/to-private", "public.test")]["detail"]
    assert detail.startswith(f"http://intranet.test:{port}/secret: intranet.test resolves to ")
    assert "10.1.2.3" in detail
    # The first hops were fetched, the refused targets never; a public redirect is followed.
    paths = [path for path, _ in site.requests]
    assert sorted(paths) == sorted([*urls, "/to-public", "/article"])
    page = pages_of(tmp_path / "out")[site.url("/to-public", "public.test")]
    assert page["final_url"] == site.url("/article", "public.test")
    # The Host header kept (requests come from several threads: in any order).
    assert dict(site.requests)["/article"] == f"public.test:{port}"


def test_fetcher_refuses_with_the_shipped_check_and_allows_with_the_flag(site):
    hosts = HostScheduler(per_host=4, delay=0.0, window=10)
    blacklist = load_blacklist()
    strict = Fetcher(SETTINGS, blacklist, hosts)
    record = crawl_url(site.url("/article"), strict)
    assert (record["stage"], record["reason"]) == ("fetch", "loopback address")

    lenient = Fetcher(replace(SETTINGS, allow_private=True), blacklist, hosts)
    assert lenient.check is None
    assert "text" in crawl_url(site.url("/article"), lenient)


def test_cli_refuses_by_default_and_allow_private_lets_through(site, tmp_path):
    url_list = tmp_path / "urls.txt"
    url_list.write_text(site.url("/article") + "\n")
    args = ["crawl", str(url_list), "--host-delay", "0", "--backoff", "0", "--no-progress"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "loopback address" in result.output
    assert site.requests == []

    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b"), "--allow-private"])
    assert result.exit_code == 0, result.output
    assert list(pages_of(tmp_path / "b")) == [site.url("/article")]


# ------------------------------------------------------------------- the connection itself


def test_connect_checked_connects_to_the_address_it_checked(site):
    port = site.server_port
    # Refused addresses are skipped (never connected to), an allowed one is used.
    resolver = Resolver({"mixed.test": ["10.9.9.9", "169.254.1.1", "127.0.0.1"]})
    with connect_checked("mixed.test", port, only_127_0_0_1, resolver, timeout=1.5) as sock:
        assert sock.getpeername() == ("127.0.0.1", port)
        assert sock.gettimeout() == 1.5  # the connect timeout is still set
    assert resolver.lookups == ["mixed.test"]  # one lookup: nothing left to rebind

    with pytest.raises(AddressRefused) as refused:
        connect_checked("intranet.test", port, only_127_0_0_1, Resolver())
    assert (refused.value.address, refused.value.reason) == ("10.1.2.3", "private address")
    assert not isinstance(refused.value, OSError)  # not a connection error to be retried

    with contextlib.closing(connect_checked("127.0.0.1", port, None)) as sock:  # no check
        assert sock.getpeername()[0] == "127.0.0.1"


def test_requests_go_to_the_pinned_address_with_the_host_name_kept(site):
    # rebind.test exists only in our resolver: urllib3 made no lookup of its own.
    resolver = Resolver()
    session = requests.Session()
    session.trust_env = False
    session.mount("http://", GuardedAdapter(only_127_0_0_1, resolver))
    url = site.url("/article", "rebind.test")
    assert session.get(url, timeout=2).status_code == 200
    assert resolver.lookups == ["rebind.test"]
    assert site.requests == [("/article", f"rebind.test:{site.server_port}")]

    # A later answer for the same name cannot slip through: every new connection is checked.
    resolver.names = {"rebind.test": "10.0.0.7"}
    fresh = requests.Session()
    fresh.mount("http://", GuardedAdapter(only_127_0_0_1, resolver))
    with pytest.raises(AddressRefused, match=r"rebind\.test resolves to 10\.0\.0\.7"):
        fresh.get(url, timeout=2)
    assert len(site.requests) == 1


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_site(tmp_path, documents):
    """An HTTPS server on 127.0.0.1 with a certificate for public.test from a test CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=megadata test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=tmp_path)  # fmt: skip
    _openssl("req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=public.test",
             cwd=tmp_path)  # fmt: skip
    (tmp_path / "leaf.ext").write_text(
        "subjectAltName=DNS:public.test\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "leaf.pem", "-days", "2", "-extfile", "leaf.ext",
             cwd=tmp_path)  # fmt: skip
    server = Site(documents)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "leaf.pem", tmp_path / "leaf.key")
    server.sni_names = []
    context.sni_callback = lambda sock, name, ctx: server.sni_names.append(name)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server, tmp_path / "ca.pem"
    server.shutdown()
    server.server_close()


def test_https_keeps_sni_and_verifies_the_host_name(tls_site):
    server, ca = tls_site
    port = server.server_port
    resolver = Resolver({"public.test": "127.0.0.1", "other.test": "127.0.0.1"})
    session = requests.Session()
    session.trust_env = False
    session.mount("https://", GuardedAdapter(only_127_0_0_1, resolver))

    response = session.get(f"https://public.test:{port}/article", verify=str(ca), timeout=3)
    assert response.status_code == 200
    assert server.sni_names == ["public.test"]  # the name, not the pinned address
    assert server.requests == [("/article", f"public.test:{port}")]

    # The same address under a name the certificate does not cover: refused by TLS.
    with pytest.raises(requests.exceptions.SSLError, match=r"other\.test"):
        session.get(f"https://other.test:{port}/article", verify=str(ca), timeout=3)
    assert len(server.requests) == 1
