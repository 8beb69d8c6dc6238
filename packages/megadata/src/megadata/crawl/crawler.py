"""The crawl: URL lists filtered (megadata.crawl.filters), their pages fetched by a pool of
threads, polite per host (megadata.crawl.fetch), each URL's outcome appended to pages.jsonl
or errors.jsonl as it comes, and the summary of the counts."""

import contextlib
import json
import logging
import socket
import threading
import time
from collections import Counter
from pathlib import Path

from megacommon.files import atomic_write_json
from megacommon.progress import progress_bar
from megadata.crawl.addresses import AddressCheck, Resolver, check_address
from megadata.crawl.fetch import CrawlSettings, Fetcher, HostScheduler, crawl_url, error_record
from megadata.crawl.filters import Blacklist, load_blacklist, read_url_lists, url_host

log = logging.getLogger("megadata.crawl")

PAGES, ERRORS, SUMMARY = "pages.jsonl", "errors.jsonl", "summary.json"


class CrawlOutput:
    """pages.jsonl and errors.jsonl: the URLs they already hold, and whole-line appends."""

    def __init__(self, out_dir: Path):
        self.done: set[str] = set()
        self.pages = 0
        self.reasons: Counter = Counter()  # (stage, reason) -> URLs
        self._lock = threading.Lock()
        self._files: dict = {}
        for name in (PAGES, ERRORS):
            path = out_dir / name
            if path.exists():
                self._load(path, name)
            # Closed by close(); "replace" writes a lone surrogate as "?" instead of failing.
            self._files[name] = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115

    def _load(self, path: Path, name: str) -> None:
        complete = 0  # bytes up to the end of the last whole line
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    break
                complete += len(line)
                try:
                    record = json.loads(line)
                    self._count(record["url"], record, name)
                except (ValueError, KeyError, TypeError):
                    log.warning(
                        "%s:%d: unreadable record skipped; its URL is done again", path, number
                    )
        if complete < path.stat().st_size:  # the line a killed run was writing
            log.warning("%s: cut-off last line removed; its URL is done again", path)
            with open(path, "r+b") as f:
                f.truncate(complete)

    def _count(self, url: str, record: dict, name: str) -> None:
        if url in self.done:
            return
        self.done.add(url)
        if name == PAGES:
            self.pages += 1
        else:
            self.reasons[record["stage"], record["reason"]] += 1

    def write(self, record: dict) -> None:
        name = ERRORS if "stage" in record else PAGES
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            if not self._files:  # closed by an interrupted crawl: the URL is done next time
                return
            self._files[name].write(line)
            self._files[name].flush()
            self._count(record["url"], record, name)

    def close(self) -> None:
        with self._lock:  # never while a line is half written
            for f in self._files.values():
                f.close()
            self._files = {}


@contextlib.contextmanager
def _only_crawl_of(out_dir: Path):
    """Refuses a second crawl writing to the same directory (it would fetch URLs twice)."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock
        yield
        return
    with open(out_dir / ".crawl.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"{out_dir}: another megadata crawl is writing there") from None
        yield


def fetch_all(
    urls: list[str],
    settings: CrawlSettings,
    blacklist: Blacklist,
    output: CrawlOutput,
    progress: bool,
    check: AddressCheck | None = check_address,
    resolve: Resolver = socket.getaddrinfo,
) -> None:
    """Fetch `urls` with `settings.concurrency` threads, each URL's record written as it ends."""
    if not urls:
        return
    hosts = HostScheduler(settings.per_host, settings.host_delay, window=64 * settings.concurrency)
    fetcher = Fetcher(settings, blacklist, hosts, check, resolve)
    bar = progress_bar(len(urls), "crawl", "url", enabled=progress)
    bar_lock, failures = threading.Lock(), []

    def work() -> None:
        try:
            while (taken := hosts.take()) is not None:
                output.write(crawl_url(taken[1], fetcher, slot_held=True))
                with bar_lock:
                    bar.set_postfix(pages=output.pages, refresh=False)
                    bar.update()
        except BaseException as e:  # a full disk, say: stop the crawl, not just this thread
            failures.append(e)
            hosts.close(drop_waiting=True)

    threads = [
        threading.Thread(target=work, name=f"crawl-{i}", daemon=True)
        for i in range(min(settings.concurrency, len(urls)))
    ]
    for thread in threads:
        thread.start()
    try:
        for url in urls:
            hosts.put(url_host(url), url)
        hosts.close()
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl-C: requests in flight end within their deadline
        hosts.close(drop_waiting=True)
        raise
    finally:
        bar.close()
    if failures:
        raise failures[0]


def crawl(
    url_files,
    out_dir,
    settings: CrawlSettings | None = None,
    progress: bool = True,
    *,
    check: AddressCheck | None = check_address,
    resolve: Resolver = socket.getaddrinfo,
) -> dict:
    """Crawl the URLs of `url_files` into `out_dir`, resuming what is there; the summary.
    `check` and `resolve` decide where requests may connect (ignored with allow_private)."""
    settings = settings or CrawlSettings()
    started = time.monotonic()
    out_dir = Path(out_dir)
    blacklist = load_blacklist(settings.blacklist_domains, settings.blacklist_extensions)
    lists = read_url_lists(url_files)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _only_crawl_of(out_dir):
        output = CrawlOutput(out_dir)
        try:
            to_fetch, already_done, filtered = [], 0, 0
            for url, score in lists.scores.items():
                if url in output.done:
                    already_done += 1
                    continue
                reason = lists.rejected.get(url)
                if reason is None and score < settings.min_score:
                    reason = f"score below {settings.min_score:g}"
                reason = reason or blacklist.problem(url)
                if reason:
                    output.write(error_record(url, "filter", reason))
                    filtered += 1
                else:
                    to_fetch.append(url)
            fetch_all(to_fetch, settings, blacklist, output, progress, check, resolve)
        finally:
            output.close()
    reasons: dict = {}
    for (stage, reason), count in sorted(output.reasons.items(), key=lambda kv: (kv[0][0], -kv[1])):
        reasons.setdefault(stage, {})[reason] = count
    summary = {
        "input": {
            "files": len(url_files),
            "url_lines": lists.url_lines,
            "unique_urls": len(lists.scores),
            "duplicates": lists.duplicates,
            "garbage_lines": dict(lists.garbage),
        },
        "output": {"pages": output.pages, "errors": sum(output.reasons.values())},
        "reasons": reasons,
        "this_run": {
            "already_done": already_done,
            "filtered": filtered,
            "fetched": len(to_fetch),
            "seconds": round(time.monotonic() - started, 2),
        },
    }
    atomic_write_json(out_dir / SUMMARY, summary)
    return summary


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_summary(summary: dict) -> str:
    inp, run, out = summary["input"], summary["this_run"], summary["output"]
    garbage = sum(inp["garbage_lines"].values())
    lines = [
        f"URL lists: {_plural(inp['files'], 'file')}, {_plural(inp['unique_urls'], 'URL')} "
        f"({_plural(inp['duplicates'], 'duplicate')}, {_plural(garbage, 'garbage line')})",
        f"this run: {run['already_done']} already done, {run['filtered']} filtered, "
        f"{run['fetched']} fetched in {run['seconds']:.1f} s",
        f"{'stage':<9}{'URLs':>8}  reason",
        f"{'page':<9}{out['pages']:>8}  article text in pages.jsonl",
    ]
    for stage in ("filter", "fetch", "extract"):
        for reason, count in summary["reasons"].get(stage, {}).items():
            lines.append(f"{stage:<9}{count:>8}  {reason}")
    return "\n".join(lines)
