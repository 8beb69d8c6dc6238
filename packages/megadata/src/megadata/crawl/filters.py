"""What `megadata crawl` fetches: URL lists read, URLs normalised, blacklists applied.

The OpenWebText recipe of the paper: URLs of Reddit submissions with a score
(karma) of at least 3, minus domains that serve no prose (image and video hosts,
social networks, shops, ...) and links to files that are not web pages (.jpg,
.pdf, .zip, ...). The two blacklists ship as data files in the package
(`megadata/data/blacklist_*.txt`) and can be extended with files of one's own.
"""

import bz2
import gzip
import ipaddress
import json
import logging
import lzma
import math
import posixpath
import re
from collections import Counter
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

log = logging.getLogger("megadata.crawl")

DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_GARBAGE_WARNINGS_PER_FILE = 5


class BadUrl(ValueError):
    """A URL that cannot be fetched; `reason` is what errors.jsonl records."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _ascii_host(host: str) -> str:
    """The host in ASCII (IDNA for international names), or BadUrl when it is no host name."""
    if ":" in host:  # urlsplit leaves IPv6 literals without their brackets
        try:
            return f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise BadUrl("malformed URL") from None
    try:
        host = host.rstrip(".").encode("idna").decode("ascii")
    except UnicodeError:
        raise BadUrl("malformed URL") from None
    labels = host.split(".")
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        raise BadUrl("malformed URL")
    return host


def normalize_url(raw: str) -> str:
    """The canonical form of an http(s) URL: scheme and host lower-cased, default port and
    fragment dropped, an empty path made "/". Raises BadUrl for anything else."""
    text = raw.strip()
    if not text or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text):
        raise BadUrl("malformed URL")
    try:
        parts = urlsplit(text)
        port = parts.port  # raises for a port out of range or not a number
    except ValueError:
        raise BadUrl("malformed URL") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise BadUrl(f"non-http scheme {scheme}" if scheme else "malformed URL")
    if not parts.hostname or port == 0:
        raise BadUrl("malformed URL")
    netloc = _ascii_host(parts.hostname)
    if "@" in parts.netloc:
        netloc = parts.netloc.rpartition("@")[0] + "@" + netloc
    if port is not None and port != DEFAULT_PORTS[scheme]:
        netloc += f":{port}"
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def url_host(url: str) -> str:
    """The host of a normalised URL: the key of the per-host politeness limits."""
    return urlsplit(url).hostname or ""


# ---------------------------------------------------------------- blacklists


def _blacklist_lines(text: str, origin: str):
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip().lower()
        if entry:
            yield f"{origin}:{number}", entry


def _domain_entry(where: str, entry: str) -> str:
    try:
        return _ascii_host(entry.removeprefix("*.").strip("."))
    except BadUrl:
        raise ValueError(
            f"{where}: expected a domain name like example.com, got {entry!r}"
        ) from None


def _extension_entry(where: str, entry: str) -> str:
    extension = "." + entry.lstrip(".")
    if not re.fullmatch(r"\.[a-z0-9_+-]+", extension):
        raise ValueError(f"{where}: expected a file extension like .pdf, got {entry!r}")
    return extension


@dataclass(frozen=True)
class Blacklist:
    domains: frozenset[str]
    extensions: frozenset[str]

    def domain_of(self, host: str) -> str | None:
        """The listed domain that `host` is or is a subdomain of, if any."""
        labels = host.split(".")
        for i in range(len(labels)):
            candidate = ".".join(labels[i:])
            if candidate in self.domains:
                return candidate
        return None

    def extension_of(self, path: str) -> str | None:
        """The listed extension the URL path's last segment ends in, if any."""
        extension = posixpath.splitext(unquote(path))[1].lower()
        return extension if extension in self.extensions else None

    def problem(self, url: str) -> str | None:
        """Why a normalised URL must not be fetched ("blacklisted domain x.com"), or None."""
        parts = urlsplit(url)
        domain = self.domain_of(parts.hostname or "")
        if domain:
            return f"blacklisted domain {domain}"
        extension = self.extension_of(parts.path)
        if extension:
            return f"blacklisted extension {extension}"
        return None


def _entries(shipped: str, extra_files, parse) -> frozenset[str]:
    sources = [(shipped, (files("megadata") / "data" / shipped).read_text(encoding="utf-8"))]
    for path in extra_files:
        try:
            sources.append((str(path), Path(path).read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None
    return frozenset(
        parse(where, entry)
        for origin, text in sources
        for where, entry in _blacklist_lines(text, origin)
    )


def load_blacklist(domain_files=(), extension_files=()) -> Blacklist:
    """The shipped lists plus the entries of the given files (one per line, `#` comments)."""
    return Blacklist(
        _entries("blacklist_domains.txt", domain_files, _domain_entry),
        _entries("blacklist_extensions.txt", extension_files, _extension_entry),
    )


# ---------------------------------------------------------------- URL lists


@dataclass
class UrlLists:
    """Every URL of the input files once, in order of first appearance.

    `scores` maps a URL (normalised; the raw text when it cannot be) to the best
    score any line gave it (inf for plain lists, which have none), so a link
    posted twice is kept when either submission reached the minimum score.
    """

    scores: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # URL -> malformed / scheme reason
    url_lines: int = 0
    duplicates: int = 0
    garbage: Counter = field(default_factory=Counter)  # kind of garbage line -> count

    def add(self, raw: str, score: float) -> None:
        self.url_lines += 1
        try:
            url = normalize_url(raw)
        except BadUrl as e:
            url = raw.strip()
            self.rejected[url] = e.reason
        if url in self.scores:
            self.duplicates += 1
            self.scores[url] = max(self.scores[url], score)
        else:
            self.scores[url] = score


def _open_text(path: Path):
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rt", encoding="utf-8", errors="replace")


def is_jsonl(path: Path) -> bool:
    """A Reddit submission dump (jsonl) by its extension, else by its first non-blank line."""
    name = path.name.lower()
    for compression in (".gz", ".bz2", ".xz"):
        name = name.removesuffix(compression)
    if name.endswith((".jsonl", ".json")):
        return True
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def _score_of(obj: dict) -> float | None:
    score = obj.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or math.isnan(score):
        return None
    return float(score)


def read_url_file(path: Path, lists: UrlLists) -> None:
    """Add the URLs of one list (plain text or Reddit jsonl) to `lists`; garbage is counted."""
    jsonl = is_jsonl(path)
    warned = 0

    def garbage(number: int, kind: str) -> None:
        nonlocal warned
        lists.garbage[kind] += 1
        if warned < _GARBAGE_WARNINGS_PER_FILE:
            log.warning("%s:%d: %s; line skipped", path, number, kind)
            warned += 1

    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or (not jsonl and line.startswith("#")):
                continue
            if not jsonl:
                if "://" in line:
                    lists.add(line, math.inf)
                else:
                    garbage(number, "not a URL")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                garbage(number, "not JSON")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("url"), str):
                garbage(number, "no 'url' string")
            elif (score := _score_of(obj)) is None:
                garbage(number, "no numeric 'score'")
            else:
                lists.add(obj["url"], score)
    if warned == _GARBAGE_WARNINGS_PER_FILE:
        log.warning("%s: further garbage lines counted but not named", path)


def read_url_lists(paths) -> UrlLists:
    lists = UrlLists()
    for path in paths:
        read_url_file(Path(path), lists)
    return lists
