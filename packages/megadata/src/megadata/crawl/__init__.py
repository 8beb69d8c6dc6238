"""`megadata crawl`: URL lists -> article texts of their pages, as OpenWebText was built.

URL lists (plain, or Reddit submission dumps filtered by score) are filtered
(megadata.crawl.filters), the pages fetched by a pool of threads, polite per host, and
their article text extracted with newspaper3k (megadata.crawl.fetch). Each URL ends as
one line of `DIR/pages.jsonl` (url, title, text, source="crawl", and final_url
after a redirect: a `jsonl` source for a recipe) or of `DIR/errors.jsonl` (url,
stage = filter | fetch | extract, reason, maybe detail), keyed by the
normalised URL; a URL listed twice is fetched once and counted as a duplicate.
`DIR/summary.json` holds the counts per reason.

Only hosts on the public internet are fetched: a URL or redirect whose host resolves to
a loopback, private, link-local or other non-global address ends in errors.jsonl with
that reason, unless `--allow-private` (an intranet crawl; the tests' local server):
megadata.crawl.addresses.

`crawler` runs a crawl, `command` is its command line.

Lines are appended whole and flushed, so a crawl killed at any moment resumes
from the two files: a rerun drops a cut-off last line, skips every URL the files
hold and does the rest.
"""

from megadata.crawl.command import crawl_command
from megadata.crawl.crawler import crawl
from megadata.crawl.fetch import CrawlSettings

__all__ = ["CrawlSettings", "crawl", "crawl_command"]
