"""megadata crawl against a local web server (127.0.0.1 only, nothing else is ever touched).

The server serves real article pages (Python's own documentation as prose) and
every kind of page a crawl meets: slow, endless, huge, not HTML, redirects
(followed, to file://, to a blacklisted host, in a loop), a 500 that heals, a
503 that does not, a 404 and a page with no article. Timeouts are short so the
whole file runs in seconds.
"""

import contextlib
import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from megadata.cli import main
from megadata.crawl import CrawlSettings, crawl
from megadata.crawl.fetch import HostScheduler
from megadata.crawl.filters import (
    BadUrl,
    is_jsonl,
    load_blacklist,
    normalize_url,
    read_url_lists,
)
from megadata.sources.jsonl import read_jsonl

# Timeouts short enough for a fast test, long enough for a machine under load.
FAST = CrawlSettings(
    timeout=1.0,
    page_deadline=2.0,
    max_bytes=100_000,
    retries=2,
    backoff=0.01,
    concurrency=8,
    per_host=4,
    host_delay=0.0,
    allow_private=True,  # the site is on 127.0.0.1 (test_crawl_address.py: refused without it)
)
NO_ARTICLE = (
    "<html><head><title>Photos</title></head><body><nav><a href='/'>Home</a> | "
    "<a href='/about'>About</a></nav><div class='gallery'><img src='/a.png'>"
    "<img src='/b.png'></div><footer>(c) 2019</footer></body></html>"
)
ACCENTED = "The café served crème brûlée to every visitor who asked for it politely."


def article_html(doc: dict, extra: str = "") -> str:
    paragraphs = "".join(f"<p>{p}</p>" for p in doc["text"].split("\n\n"))
    if extra:
        paragraphs += f"<p>{extra}</p>"
    return (
        f"<html><head><title>{doc['title']}</title></head><body><nav>Home | About</nav>"
        f"<article><h1>{doc['title']}</h1>{paragraphs}</article><footer>(c)</footer></body></html>"
    )


class Site(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, docs: list[dict]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.docs = docs
        self.lock = threading.Lock()
        self.hits: Counter = Counter()
        self.in_flight = self.max_in_flight = 0
        self.starts: list[float] = []
        self.user_agents: set[str] = set()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_port}{path}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output quiet
        pass

    def do_GET(self):
        site = self.server
        with site.lock:
            site.hits[self.path] += 1
            hit = site.hits[self.path]
            site.starts.append(time.monotonic())
            site.user_agents.add(self.headers.get("User-Agent", ""))
        # The crawler hangs up on an endless or huge page, as it should.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.route(hit)

    def send(self, status, body=b"", content_type="text/html; charset=utf-8", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def stream(self, chunk: bytes, count: int, pause: float):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()  # no Content-Length: the body ends when the connection does
        for _ in range(count):
            self.wfile.write(chunk)
            self.wfile.flush()
            time.sleep(pause)

    def route(self, hit: int):
        path, docs = self.path, self.server.docs
        if path.startswith("/polite/"):
            site = self.server
            with site.lock:
                site.in_flight += 1
                site.max_in_flight = max(site.max_in_flight, site.in_flight)
            time.sleep(0.1)
            with site.lock:  # counted out before the answer leaves: never more than the client has
                site.in_flight -= 1
            self.send(200, article_html(docs[int(path.rsplit("/", 1)[1])]).encode())
        elif path.startswith("/article/"):
            self.send(200, article_html(docs[int(path.rsplit("/", 1)[1])]).encode())
        elif path == "/xhtml":
            self.send(200, article_html(docs[10]).encode(), "application/xhtml+xml; charset=utf-8")
        elif path == "/latin1":
            html = article_html(docs[11], extra=ACCENTED).encode("latin-1")
            self.send(200, html, "text/html; charset=ISO-8859-1")
        elif path == "/slow":
            time.sleep(2.5)  # past the client's 1 s read timeout
            self.send(200, article_html(docs[12]).encode())
        elif path == "/forever":
            self.stream(b"<p>more</p>\n", count=1200, pause=0.05)  # 60 s if nobody hangs up
        elif path == "/huge":
            self.stream(b"<p>" + b"x" * 16_000 + b"</p>\n", count=20, pause=0)
        elif path == "/huge-declared":
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
        elif path == "/picture":
            self.send(200, b"\x89PNG\r\n\x1a\n" + bytes(64), "image/png")
        elif path == "/redirect":
            self.send(302, headers=[("Location", "/article/7")])
        elif path == "/redirect-file":
            self.send(302, headers=[("Location", "file:///etc/passwd")])
        elif path == "/redirect-blacklisted":
            self.send(301, headers=[("Location", "https://i.imgur.com/cat.html")])
        elif path.startswith("/loop/"):
            self.send(302, headers=[("Location", f"/loop/{int(path[6:]) + 1}")])
        elif path == "/flaky":
            if hit == 1:
                self.send(500, b"<html><body>try again</body></html>")
            else:
                self.send(200, article_html(docs[13]).encode())
        elif path == "/unavailable":
            self.send(503, b"<html><body>down for maintenance</body></html>")
        elif path == "/empty":
            self.send(200, NO_ARTICLE.encode())
        else:
            self.send(404, b"<html><body>Not found</body></html>")


@pytest.fixture
def site(documents):
    server = Site(documents)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """A proxy from the environment must not carry requests for 127.0.0.1 elsewhere."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_records(out: Path) -> tuple[list[dict], list[dict]]:
    def lines(name):
        path = out / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return lines("pages.jsonl"), lines("errors.jsonl")


def outcomes(out: Path) -> dict[str, object]:
    """URL -> "page" or (stage, reason); fails on a URL recorded twice."""
    pages, errors = read_records(out)
    urls = [r["url"] for r in pages + errors]
    assert len(urls) == len(set(urls)), Counter(urls).most_common(3)
    result = {r["url"]: "page" for r in pages}
    result.update({r["url"]: (r["stage"], r["reason"]) for r in errors})
    return result


def words(text: str) -> str:
    return " ".join(text.split())  # newspaper joins the lines of a paragraph


def write_list(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------- the whole crawl


def test_every_url_ends_in_pages_or_errors_with_its_reason(site, documents, tmp_path):
    unreachable = f"http://127.0.0.1:{closed_port()}/story"
    fetched = {
        "/article/0": "page",
        "/article/1": "page",
        "/article/2": "page",
        "/xhtml": "page",
        "/latin1": "page",
        "/redirect": "page",
        "/flaky": "page",
        "/slow": ("fetch", "timeout after 2 retries"),
        "/forever": ("fetch", "exceeded page deadline of 2 s"),
        "/huge": ("fetch", "exceeds 100000 bytes"),
        "/huge-declared": ("fetch", "exceeds 100000 bytes"),
        "/picture": ("fetch", "not html: image/png"),
        "/redirect-file": ("fetch", "redirect to non-http scheme file"),
        "/redirect-blacklisted": ("fetch", "redirect to blacklisted domain imgur.com"),
        "/loop/0": ("fetch", "more than 5 redirects"),
        "/unavailable": ("fetch", "http 503 after 2 retries"),
        "/gone": ("fetch", "http 404"),
        "/empty": ("extract", "no article text"),
    }
    filtered = {
        site.url("/report.PDF?download=1"): ("filter", "blacklisted extension .pdf"),
        "https://i.imgur.com/abc": ("filter", "blacklisted domain imgur.com"),
        "ftp://127.0.0.1/file.txt": ("filter", "non-http scheme ftp"),
        "http://127.0.0.1:99999/": ("filter", "malformed URL"),
        "http://exa mple.com/page": ("filter", "malformed URL"),
    }
    lines = ["# a comment, then a blank line", ""]
    lines += [site.url(p) for p in fetched] + [unreachable] + list(filtered)
    lines += [
        site.url("/article/0#comments"),  # the same page as /article/0
        site.url("/article/1").replace("http://", "HTTP://"),  # and as /article/1
        "this line is not a URL",
    ]
    url_list = write_list(tmp_path / "urls.txt", lines)

    started = time.monotonic()
    summary = crawl([url_list], tmp_path / "out", FAST, progress=False)
    seconds = time.monotonic() - started

    expected = {site.url(p): outcome for p, outcome in fetched.items()}
    expected[unreachable] = ("fetch", "connection error after 2 retries")
    expected.update(filtered)
    assert outcomes(tmp_path / "out") == expected
    assert seconds < 20, "a bounded wait took far longer than its bound"

    pages, errors = read_records(tmp_path / "out")
    by_url = {p["url"]: p for p in pages}
    for path, doc in [("/article/0", documents[0]), ("/article/2", documents[2])]:
        page = by_url[site.url(path)]
        assert page["title"] == doc["title"] and page["source"] == "crawl"
        assert words(doc["text"])[:200] in words(page["text"])
    redirected = by_url[site.url("/redirect")]
    assert redirected["final_url"] == site.url("/article/7")
    assert words(documents[7]["text"])[:200] in words(redirected["text"])
    assert ACCENTED in by_url[site.url("/latin1")]["text"]
    assert "detail" in next(e for e in errors if e["url"] == unreachable)

    # Retries only where they can help; filtered URLs are never requested.
    assert site.hits["/slow"] == 3 and site.hits["/unavailable"] == 3
    assert site.hits["/flaky"] == 2
    assert site.hits["/gone"] == 1 and site.hits["/picture"] == 1
    assert site.hits["/redirect-file"] == 1 and site.hits["/article/7"] == 1
    assert site.hits["/forever"] == 1 and site.hits["/loop/5"] == 1 and "/loop/6" not in site.hits
    assert not any(path.startswith("/report") for path in site.hits)
    assert site.user_agents == {"megadata/0.1.0 (corpus crawler)"}

    assert summary["input"] == {
        "files": 1,
        "url_lines": len(expected) + 2,
        "unique_urls": len(expected),
        "duplicates": 2,
        "garbage_lines": {"not a URL": 1},
    }
    assert summary["output"] == {"pages": len(pages), "errors": len(errors)}
    reasons = Counter(outcome for outcome in expected.values() if outcome != "page")
    assert {(s, r): n for s, rs in summary["reasons"].items() for r, n in rs.items()} == reasons
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary

    # The output is a jsonl source as the ingest stage reads it.
    problems: dict = {}
    docs = list(read_jsonl(tmp_path / "out" / "pages.jsonl", problems))
    assert problems == {}
    assert [d["url"] for d in docs] == [p["url"] for p in pages]
    assert all(d["text"].strip() and d["source"] == "crawl" for d in docs)


def test_reddit_dump_keeps_submissions_with_score_at_least_min(site, tmp_path):
    submissions = [
        {"url": site.url("/article/0"), "score": 5},
        {"url": site.url("/article/1"), "score": 3},
        {"url": site.url("/article/2"), "score": 2},
        {"url": site.url("/article/3"), "score": 1},
        {"url": site.url("/article/3"), "score": 10},  # posted again, and liked this time
        {"url": "https://www.youtube.com/watch?v=abc", "score": 99},
        {"url": site.url("/article/4")},
        {"title": "a self post", "score": 50},
    ]
    lines = [json.dumps(s) for s in submissions] + ["{not json"]
    dump = write_list(tmp_path / "RS_2019-01", lines)  # no extension: detected by its first line

    summary = crawl([dump], tmp_path / "out", FAST, progress=False)

    assert outcomes(tmp_path / "out") == {
        site.url("/article/0"): "page",
        site.url("/article/1"): "page",
        site.url("/article/3"): "page",
        site.url("/article/2"): ("filter", "score below 3"),
        "https://www.youtube.com/watch?v=abc": ("filter", "blacklisted domain youtube.com"),
    }
    assert "/article/2" not in site.hits
    assert summary["input"]["duplicates"] == 1
    assert summary["input"]["garbage_lines"] == {
        "no numeric 'score'": 1,
        "no 'url' string": 1,
        "not JSON": 1,
    }

    crawl([dump], tmp_path / "low", replace(FAST, min_score=2), progress=False)
    assert outcomes(tmp_path / "low")[site.url("/article/2")] == "page"


# ------------------------------------------------------------------- politeness


def test_per_host_limit_is_respected(site, tmp_path):
    url_list = write_list(tmp_path / "urls.txt", [site.url(f"/polite/{i}") for i in range(12)])
    crawl([url_list], tmp_path / "polite", replace(FAST, per_host=2), progress=False)
    assert site.max_in_flight == 2  # never more, and both slots were used

    site.max_in_flight = 0
    crawl([url_list], tmp_path / "eager", replace(FAST, per_host=6), progress=False)
    assert site.max_in_flight > 2  # the same check sees a looser limit


def test_host_delay_spaces_request_starts(site, tmp_path):
    url_list = write_list(tmp_path / "urls.txt", [site.url(f"/article/{i}") for i in range(8)])
    polite = replace(FAST, per_host=8, host_delay=0.1)
    crawl([url_list], tmp_path / "polite", polite, progress=False)
    # Measured where the requests arrive, where a loaded machine can delay any one of them
    # (the exact spacing is checked on the scheduler below): 8 starts span 7 delays.
    starts = sorted(site.starts)
    assert starts[-1] - starts[0] >= 7 * 0.1 - 0.03

    site.starts = []
    crawl([url_list], tmp_path / "eager", replace(polite, host_delay=0.0), progress=False)
    starts = sorted(site.starts)
    assert statistics.median(b - a for a, b in itertools.pairwise(starts)) < 0.05


def test_a_waiting_host_does_not_hold_up_the_others():
    hosts = HostScheduler(per_host=1, delay=0.2, window=10)
    for host, url in [("a", "a1"), ("a", "a2"), ("b", "b1")]:
        hosts.put(host, url)
    assert hosts.take() == ("a", "a1")
    assert hosts.take() == ("b", "b1")  # a is busy, b goes ahead
    started = time.monotonic()
    hosts.release("a")
    assert hosts.take() == ("a", "a2")
    assert time.monotonic() - started >= 0.15  # a's delay since a1 started
    hosts.close()
    assert hosts.take() is None


def test_scheduler_spaces_starts_to_a_host_by_the_delay():
    hosts = HostScheduler(per_host=8, delay=0.05, window=10)
    for i in range(6):
        hosts.put("a", f"a{i}")
    hosts.close()
    starts = []
    while hosts.take():
        starts.append(time.monotonic())
        hosts.release("a")
    assert len(starts) == 6
    # The scheduler spaces its own clock readings by the delay; ours come after take() returns,
    # each late by a thread switch (tens of microseconds on a busy CPU), so allow 1 ms of that.
    assert min(b - a for a, b in itertools.pairwise(starts)) >= 0.05 - 1e-3


# ------------------------------------------------------------------- resuming


def small_list(site, tmp_path) -> list[str]:
    return [site.url(f"/article/{i}") for i in range(6)] + [
        site.url("/gone"),
        site.url("/picture"),
        site.url("/empty"),
        "https://twitter.com/someone/status/1",
    ]


def test_rerun_fetches_nothing_new(site, tmp_path):
    url_list = write_list(tmp_path / "urls.txt", small_list(site, tmp_path))
    out = tmp_path / "out"
    crawl([url_list], out, FAST, progress=False)
    files = {name: (out / name).read_bytes() for name in ("pages.jsonl", "errors.jsonl")}
    hits = Counter(site.hits)

    summary = crawl([url_list], out, FAST, progress=False)

    assert site.hits == hits
    assert {name: (out / name).read_bytes() for name in files} == files
    assert summary["this_run"]["already_done"] == 10 and summary["this_run"]["fetched"] == 0
    assert summary["output"] == {"pages": 6, "errors": 4}


def test_files_cut_mid_line_resume_without_loss_or_duplicates(site, tmp_path):
    url_list = write_list(tmp_path / "urls.txt", small_list(site, tmp_path))
    out = tmp_path / "out"
    crawl([url_list], out, FAST, progress=False)
    complete = outcomes(out)
    cut_urls = []
    for name in ("pages.jsonl", "errors.jsonl"):  # as if killed while writing the last lines
        data = (out / name).read_bytes()
        last_start = data.rstrip(b"\n").rfind(b"\n") + 1
        cut_urls.append(json.loads(data[last_start:])["url"])
        (out / name).write_bytes(data[: last_start + 20])
    hits = Counter(site.hits)

    summary = crawl([url_list], out, FAST, progress=False)

    assert outcomes(out) == complete
    refetched = {site.url(p): n - hits[p] for p, n in site.hits.items() if n != hits[p]}
    assert refetched == {url: 1 for url in cut_urls if url.startswith("http://127")}
    assert all(line for line in (out / "pages.jsonl").read_text().split("\n")[:-1])
    assert summary["this_run"]["already_done"] == 8


def test_half_list_then_whole_list(site, tmp_path):
    urls = small_list(site, tmp_path)
    out = tmp_path / "out"
    crawl([write_list(tmp_path / "half.txt", urls[:5])], out, FAST, progress=False)
    summary = crawl([write_list(tmp_path / "all.txt", urls)], out, FAST, progress=False)
    assert len(outcomes(out)) == len(urls)
    assert all(site.hits[f"/article/{i}"] == 1 for i in range(6))
    assert summary["this_run"]["already_done"] == 5


def test_a_killed_crawl_resumes(site, tmp_path):
    urls = [site.url(f"/polite/{i}") for i in range(24)]
    url_list = write_list(tmp_path / "urls.txt", urls)
    out = tmp_path / "out"
    args = [str(url_list), "--out", str(out), "--per-host", "2", "--host-delay", "0"]
    args.append("--allow-private")
    code = "import sys; from megadata.crawl import crawl_command; crawl_command(sys.argv[1:])"
    process = subprocess.Popen([sys.executable, "-c", code, *args, "--no-progress"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # kill -9 once a few pages are written, mid-crawl
        pages = out / "pages.jsonl"
        if pages.exists() and pages.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    first_run = len(read_records(out)[0])
    assert 3 <= first_run < len(urls), "the kill did not land mid-crawl"

    crawl([url_list], out, FAST, progress=False)
    assert outcomes(out) == {url: "page" for url in urls}


def test_a_second_crawl_into_the_same_directory_is_refused(tmp_path):
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".crawl.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="another megadata crawl"):
            crawl([write_list(tmp_path / "urls.txt", [])], out, FAST, progress=False)


# ------------------------------------------------------------------- URL lists and filters


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("HTTP://Example.COM:80/a?b=1#frag", "http://example.com/a?b=1"),
        ("https://example.com:443", "https://example.com/"),
        ("https://example.com:8443/x", "https://example.com:8443/x"),
        ("http://bücher.de/x", "http://xn--bcher-kva.de/x"),
        ("  http://example.com/path  ", "http://example.com/path"),
    ],
)
def test_normalize_url(raw, expected):
    assert normalize_url(raw) == expected


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("http://example.com:99999/", "malformed URL"),
        ("http://example.com:port/", "malformed URL"),
        ("http:///no-host", "malformed URL"),
        ("http://exa mple.com/", "malformed URL"),
        ("http://bad_host!.com/", "malformed URL"),
        ("ftp://example.com/file", "non-http scheme ftp"),
        ("javascript:alert(1)", "non-http scheme javascript"),
        ("file:///etc/passwd", "non-http scheme file"),
    ],
)
def test_bad_urls_are_refused_with_a_reason(raw, reason):
    with pytest.raises(BadUrl) as caught:
        normalize_url(raw)
    assert caught.value.reason == reason


def test_blacklists_cover_subdomains_and_extensions_and_extend(tmp_path):
    shipped = load_blacklist()
    assert shipped.problem("https://m.youtube.com/watch") == "blacklisted domain youtube.com"
    assert shipped.problem("https://notyoutube.com/story") is None
    assert shipped.problem("http://example.com/photo.JPG?size=2") == "blacklisted extension .jpg"
    assert shipped.problem("http://example.com/a.pdf.html") is None
    assert shipped.problem("http://example.com/story") is None

    domains = write_list(tmp_path / "domains.txt", ["# mine", "*.Example.com", "news.test # x"])
    extensions = write_list(tmp_path / "ext.txt", ["html", ".PHP"])
    mine = load_blacklist([domains], [extensions])
    assert mine.problem("http://www.example.com/a") == "blacklisted domain example.com"
    assert mine.problem("http://news.test/a") == "blacklisted domain news.test"
    assert mine.problem("http://other.org/index.php") == "blacklisted extension .php"
    assert mine.problem("http://other.org/a.html") == "blacklisted extension .html"
    assert mine.problem("https://youtu.be/x") == "blacklisted domain youtu.be"  # shipped kept

    bad = write_list(tmp_path / "bad.txt", ["good.com", "http://not a domain/"])
    with pytest.raises(ValueError, match=r"bad\.txt:2: expected a domain name"):
        load_blacklist([bad])


def test_list_formats_are_detected_per_file(tmp_path):
    plain = write_list(tmp_path / "a.txt", ["", "# {not json}", "http://a.org/1"])
    braces = write_list(tmp_path / "b.txt", ['{"url": "http://a.org/2", "score": 4}'])
    named = write_list(tmp_path / "c.jsonl", ["", '{"url": "http://a.org/3", "score": 4}'])
    assert [is_jsonl(p) for p in (plain, braces, named)] == [False, True, True]
    lists = read_url_lists([plain, braces, named])
    assert list(lists.scores) == ["http://a.org/1", "http://a.org/2", "http://a.org/3"]
    assert lists.garbage == Counter()


# ------------------------------------------------------------------- command line


def test_cli_crawls_and_prints_the_reasons(site, tmp_path):
    url_list = write_list(tmp_path / "urls.txt", small_list(site, tmp_path))
    out = tmp_path / "out"
    args = ["crawl", str(url_list), "--out", str(out), "--host-delay", "0", "--timeout", "1"]
    args += ["--allow-private", "--backoff", "0", "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "URL lists: 1 file, 10 URLs (0 duplicates" in result.output
    assert "http 404" in result.output and "not html: image/png" in result.output
    assert "blacklisted domain twitter.com" in result.output
    assert json.loads((out / "summary.json").read_text())["output"] == {"pages": 6, "errors": 4}


def test_cli_bad_input_is_named(tmp_path):
    runner = CliRunner()
    empty = write_list(tmp_path / "empty.txt", [])
    out = str(tmp_path / "out")
    result = runner.invoke(main, ["crawl", str(empty), "--out", out])
    assert result.exit_code == 0 and "1 file, 0 URLs" in result.output

    result = runner.invoke(main, ["crawl", str(empty), "--out", out, "--per-host", "0"])
    assert result.exit_code == 2 and "--per-host" in result.output
    result = runner.invoke(main, ["crawl", str(tmp_path / "missing.txt"), "--out", out])
    assert result.exit_code == 2 and "missing.txt" in result.output
    bad = write_list(tmp_path / "ext.txt", ["not an extension!"])
    result = runner.invoke(
        main, ["crawl", str(empty), "--out", out, "--blacklist-extensions", str(bad)]
    )
    assert result.exit_code == 2 and "ext.txt:1: expected a file extension" in result.output
