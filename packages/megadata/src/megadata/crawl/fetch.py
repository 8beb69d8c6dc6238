"""How `megadata crawl` fetches a page: politeness per host, bounded HTTP, newspaper3k.

Every network wait is bounded: connect and read timeouts per socket wait, a
deadline per response, checked as its body streams (a page that trickles bytes
forever ends), a byte cap, at most 5 redirects, each checked like a listed URL,
and a bounded number of retries. Politeness: at most `per_host` requests in flight to a host and
`host_delay` seconds between two request starts to it; a host that must wait
does not hold up the others (HostScheduler).

Only the public internet is reached unless `allow_private` is set
(megadata.crawl.addresses).
"""

import contextlib
import http.client
import logging
import re
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

import requests
import urllib3

from megadata import __version__
from megadata.crawl.addresses import (
    AddressCheck,
    AddressRefused,
    GuardedAdapter,
    Resolver,
    check_address,
)
from megadata.crawl.filters import BadUrl, Blacklist, normalize_url, url_host

log = logging.getLogger("megadata.crawl")

MAX_REDIRECTS = 5
REDIRECT_STATUSES = {301, 302, 303, 307, 308}
HTML_TYPES = {"text/html", "application/xhtml+xml"}
MAX_RETRY_AFTER = 60.0  # seconds; a longer Retry-After is not waited for in full
DEFAULT_USER_AGENT = f"megadata/{__version__} (corpus crawler)"


@dataclass(frozen=True)
class CrawlSettings:
    min_score: float = 3
    user_agent: str = DEFAULT_USER_AGENT
    timeout: float = 10.0  # seconds of connect, and of each wait for bytes
    page_deadline: float = 60.0  # seconds from a request to the last byte of its body
    max_bytes: int = 5_000_000
    retries: int = 2
    backoff: float = 1.0  # seconds before the first retry, doubled for each next one
    concurrency: int = 16
    per_host: int = 2
    host_delay: float = 1.0
    blacklist_domains: tuple[Path, ...] = ()
    blacklist_extensions: tuple[Path, ...] = ()
    allow_private: bool = False  # True: loopback, private, link-local... hosts are fetched too


class CrawlError(Exception):
    """A URL that did not make it; becomes one line of errors.jsonl."""

    def __init__(self, stage: str, reason: str, detail: str = ""):
        super().__init__(reason)
        self.stage, self.reason, self.detail = stage, reason, detail


# ---------------------------------------------------------------- politeness


class HostScheduler:
    """Hands URLs to worker threads so that no host has more than `per_host` requests in
    flight or two request starts less than `delay` seconds apart, and a host that must wait
    does not hold up the others: a worker takes the next URL of the first host, in turn,
    that may start now.

    `take` returns a URL with its host's slot already held; a worker needing another
    request (a retry, a redirect) takes a slot with `acquire`; every slot ends with
    `release`. At most `window` URLs wait in memory; `put` blocks while it is full.
    """

    def __init__(self, per_host: int, delay: float, window: int):
        self.per_host, self.delay, self.window = per_host, delay, window
        self._cond = threading.Condition()
        self._in_flight: Counter = Counter()
        self._next_start: dict[str, float] = {}
        self._waiting: OrderedDict[str, deque] = OrderedDict()
        self._size = 0
        self._closed = False

    def _may_start(self, host: str, now: float) -> bool:
        return self._in_flight[host] < self.per_host and self._next_start.get(host, 0.0) <= now

    def _start(self, host: str, now: float) -> None:
        self._in_flight[host] += 1
        self._next_start[host] = now + self.delay
        if len(self._next_start) > 4 * self.window:  # forget hosts whose delay has passed
            self._next_start = {h: t for h, t in self._next_start.items() if t > now}

    def _wait(self, wake: float | None, now: float) -> None:
        self._cond.wait(None if wake is None else max(wake - now, 0.001))

    def put(self, host: str, url: str) -> None:
        with self._cond:
            while self._size >= self.window and not self._closed:
                self._cond.wait()
            if self._closed:
                return
            self._waiting.setdefault(host, deque()).append(url)
            self._size += 1
            self._cond.notify_all()

    def take(self) -> tuple[str, str] | None:
        """The next (host, url) to fetch, its slot held; None once closed and drained."""
        with self._cond:
            while True:
                if not self._waiting and self._closed:
                    return None
                now, wake = time.monotonic(), None
                for host, urls in self._waiting.items():
                    if self._may_start(host, now):
                        url = urls.popleft()
                        del self._waiting[host]
                        if urls:  # back of the line: hosts take turns
                            self._waiting[host] = urls
                        self._size -= 1
                        self._start(host, now)
                        self._cond.notify_all()
                        return host, url
                    if self._in_flight[host] < self.per_host:  # free, but too soon
                        ready = self._next_start[host]
                        wake = ready if wake is None else min(wake, ready)
                self._wait(wake, now)

    def acquire(self, host: str) -> None:
        with self._cond:
            while not self._may_start(host, now := time.monotonic()):
                free = self._in_flight[host] < self.per_host
                self._wait(self._next_start[host] if free else None, now)
            self._start(host, now)

    def release(self, host: str) -> None:
        with self._cond:
            self._in_flight[host] -= 1
            if self._in_flight[host] <= 0:
                del self._in_flight[host]
            self._cond.notify_all()

    def close(self, drop_waiting: bool = False) -> None:
        """No more puts; `take` returns None once the waiting URLs (or, dropped, none) are gone."""
        with self._cond:
            self._closed = True
            if drop_waiting:
                self._waiting.clear()
                self._size = 0
            self._cond.notify_all()


# ---------------------------------------------------------------- fetching


@dataclass
class Reply:
    status: int
    location: str | None = None
    charset: str | None = None
    body: bytes = b""
    retry_after: float | None = None


class Fetcher:
    """Fetches the HTML of one URL at a time per thread (one requests.Session per thread).

    `check` and `resolve` decide where a request may connect (check_address and the
    system's resolver unless `settings.allow_private`, when any address is allowed)."""

    def __init__(
        self,
        settings: CrawlSettings,
        blacklist: Blacklist,
        hosts: HostScheduler,
        check: AddressCheck | None = check_address,
        resolve: Resolver = socket.getaddrinfo,
    ):
        self.settings, self.blacklist, self.hosts = settings, blacklist, hosts
        self.check = None if settings.allow_private else check
        self.resolve = resolve
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.trust_env = False  # no proxy, no .netrc: the crawl goes where it checked
            adapter = GuardedAdapter(self.check, self.resolve)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            session.headers["User-Agent"] = self.settings.user_agent
            session.headers["Accept"] = "text/html,application/xhtml+xml;q=0.9,*/*;q=0.1"
        return session

    def _read_body(self, raw: urllib3.HTTPResponse, deadline: float) -> bytes:
        # read1 returns whatever one socket read brings, so the deadline is checked at least
        # once per `timeout` even against a server that sends a byte a second forever.
        cap, size, chunks = self.settings.max_bytes, 0, []
        while chunk := raw.read1(65536, decode_content=True):
            size += len(chunk)
            if size > cap:
                raise CrawlError("fetch", f"exceeds {cap} bytes")
            if time.monotonic() > deadline:
                raise CrawlError(
                    "fetch", f"exceeded page deadline of {self.settings.page_deadline:g} s"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _exchange(self, url: str) -> Reply:
        """One request and, for a 2xx HTML answer, its body."""
        s = self.settings
        deadline = time.monotonic() + s.page_deadline
        with self._session().get(
            url, stream=True, allow_redirects=False, timeout=(s.timeout, s.timeout)
        ) as response:
            status = response.status_code
            if status in REDIRECT_STATUSES:
                return Reply(status, location=response.headers.get("Location"))
            if not 200 <= status < 300:
                return Reply(status, retry_after=_seconds(response.headers.get("Retry-After")))
            media_type, charset = _content_type(response.headers.get("Content-Type", ""))
            if media_type not in HTML_TYPES:
                raise CrawlError("fetch", f"not html: {media_type or 'no content type'}")
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > s.max_bytes:
                raise CrawlError("fetch", f"exceeds {s.max_bytes} bytes", f"{declared} declared")
            return Reply(status, charset=charset, body=self._read_body(response.raw, deadline))

    def _exchange_with_retries(self, url: str, slot_held: bool) -> Reply:
        """Retries connection errors, timeouts, 429 and 5xx with exponential backoff."""
        s, host = self.settings, url_host(url)
        failure, detail, wait = "", "", s.backoff
        for attempt in range(s.retries + 1):
            if attempt:
                time.sleep(wait)
                wait *= 2
            if not (slot_held and attempt == 0):
                self.hosts.acquire(host)
            try:
                reply = self._exchange(url)
            except AddressRefused:  # where it resolves to now, and next time: not retried
                raise
            except (requests.Timeout, urllib3.exceptions.TimeoutError, TimeoutError) as e:
                failure, detail = "timeout", str(e)
                continue
            except requests.exceptions.SSLError as e:  # a bad certificate stays bad
                raise CrawlError("fetch", "tls error", str(e)[:500]) from None
            except requests.exceptions.InvalidURL as e:
                raise CrawlError("fetch", "invalid URL", str(e)) from None
            except (
                requests.RequestException,
                urllib3.exceptions.HTTPError,
                http.client.HTTPException,
                OSError,
            ) as e:
                failure, detail = "connection error", f"{type(e).__name__}: {e}"
                continue
            finally:
                self.hosts.release(host)
            if reply.status == 429 or 500 <= reply.status < 600:
                failure, detail = f"http {reply.status}", ""
                if reply.retry_after is not None:
                    wait = max(wait, min(reply.retry_after, MAX_RETRY_AFTER))
                continue
            return reply
        suffix = f" after {s.retries} retries" if s.retries else ""
        raise CrawlError("fetch", failure + suffix, detail[:500])

    def fetch(self, url: str, slot_held: bool = False) -> tuple[str, Reply]:
        """(final URL, reply with the HTML) for a normalised URL, redirects followed."""
        current = url
        for hops in range(MAX_REDIRECTS + 1):
            try:
                reply = self._exchange_with_retries(current, slot_held and hops == 0)
            except AddressRefused as e:
                where = f"{current}: " if hops else ""
                raise CrawlError(
                    "fetch",
                    f"redirect to {e.reason}" if hops else e.reason,
                    f"{where}{e.host} resolves to {e.address} (--allow-private fetches it)",
                ) from None
            if reply.status not in REDIRECT_STATUSES:
                if not 200 <= reply.status < 300:
                    raise CrawlError("fetch", f"http {reply.status}")
                return current, reply
            if hops == MAX_REDIRECTS:
                raise CrawlError("fetch", f"more than {MAX_REDIRECTS} redirects")
            if not reply.location:
                raise CrawlError("fetch", f"http {reply.status} without Location")
            try:  # a redirect is checked like a listed URL: http(s) only, not blacklisted
                target = normalize_url(urljoin(current, reply.location))
            except BadUrl as e:
                raise CrawlError("fetch", f"redirect to {e.reason}", reply.location) from None
            problem = self.blacklist.problem(target)
            if problem:
                raise CrawlError("fetch", f"redirect to {problem}", target)
            current = target
        raise AssertionError("unreachable")


def _content_type(header: str) -> tuple[str, str | None]:
    media_type, _, params = header.partition(";")
    match = re.search(r"charset\s*=\s*[\"']?([\w.:-]+)", params, re.IGNORECASE)
    return media_type.strip().lower(), match.group(1) if match else None


def _seconds(value: str | None) -> float | None:
    return float(value) if value and value.strip().isdigit() else None


def extract_article(body: bytes, charset: str | None, url: str) -> tuple[str, str]:
    """(title, text) of a page by newspaper3k; no network (images are not fetched)."""
    from newspaper import Article, Config  # imports lxml and nltk: only when crawling

    html: str | bytes = body  # without a charset header newspaper sniffs the page's own
    if charset:
        with contextlib.suppress(LookupError):
            html = body.decode(charset, errors="replace")
    config = Config()
    config.fetch_images = False  # True would download the page's images to rank them
    article = Article(url, config=config)
    article.download(input_html=html)
    article.parse()
    return article.title or "", article.text or ""


def crawl_url(url: str, fetcher: Fetcher, slot_held: bool = False) -> dict:
    """The pages.jsonl or errors.jsonl record of one URL; never raises for a bad page."""
    try:
        final_url, reply = fetcher.fetch(url, slot_held)
        if not reply.body.strip():
            raise CrawlError("extract", "no article text", "empty body")
        try:
            title, text = extract_article(reply.body, reply.charset, final_url)
        except Exception as e:
            raise CrawlError("extract", f"extraction failed: {type(e).__name__}", str(e)) from e
        if not text.strip():
            raise CrawlError("extract", "no article text")
    except CrawlError as e:
        return error_record(url, e.stage, e.reason, e.detail)
    except Exception as e:  # a bug or a library surprise costs one URL, not the crawl
        log.exception("%s: unexpected error", url)
        return error_record(url, "fetch", f"unexpected error: {type(e).__name__}", str(e))
    record = {"url": url, "title": title, "text": text, "source": "crawl"}
    if final_url != url:
        record["final_url"] = final_url
    return record


def error_record(url: str, stage: str, reason: str, detail: str = "") -> dict:
    record = {"url": url, "stage": stage, "reason": reason}
    if detail:
        record["detail"] = detail
    return record
