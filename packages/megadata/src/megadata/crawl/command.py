"""`megadata crawl URL_FILE... --out DIR`: the command's options, and its summary printed."""

from pathlib import Path

import click

from megacommon.errors import CommandError
from megadata.crawl.crawler import ERRORS, PAGES, SUMMARY, crawl, format_summary
from megadata.crawl.fetch import CrawlSettings

_defaults = CrawlSettings()
_seconds = click.FloatRange(min=0, min_open=True)
_list_file = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("crawl")
@click.argument("url_files", nargs=-1, required=True, type=_list_file)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output directory: pages.jsonl, errors.jsonl, summary.json (resumed if there).",
)
@click.option(
    "--min-score",
    default=_defaults.min_score,
    show_default=True,
    type=int,
    help="Keep Reddit submissions (jsonl lists) with at least this score.",
)
@click.option(
    "--blacklist-domains",
    multiple=True,
    type=_list_file,
    help="More domains to skip (with their subdomains), one a line.",
)
@click.option(
    "--blacklist-extensions",
    multiple=True,
    type=_list_file,
    help="More URL file extensions to skip, one a line.",
)
@click.option("--user-agent", default=_defaults.user_agent, show_default=True)
@click.option(
    "--timeout",
    default=_defaults.timeout,
    show_default=True,
    type=_seconds,
    help="Seconds to connect, and to wait for each read.",
)
@click.option(
    "--page-deadline",
    default=_defaults.page_deadline,
    show_default=True,
    type=_seconds,
    help="Seconds from a request to the last byte of its page.",
)
@click.option(
    "--max-bytes",
    default=_defaults.max_bytes,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest page kept (bytes after decompression).",
)
@click.option(
    "--retries",
    default=_defaults.retries,
    show_default=True,
    type=click.IntRange(min=0),
    help="Retries on connection errors, timeouts, 429, 5xx.",
)
@click.option(
    "--backoff",
    default=_defaults.backoff,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds before the first retry, then doubled.",
)
@click.option(
    "--concurrency",
    default=_defaults.concurrency,
    show_default=True,
    type=click.IntRange(min=1),
    help="Threads fetching at once.",
)
@click.option(
    "--per-host",
    default=_defaults.per_host,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests in flight to one host at most.",
)
@click.option(
    "--host-delay",
    default=_defaults.host_delay,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds between request starts to one host.",
)
@click.option(
    "--allow-private",
    is_flag=True,
    help="Also fetch hosts on loopback, private, link-local and other non-global addresses "
    "(off: such URLs and redirects are refused, the reason in errors.jsonl).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def crawl_command(url_files, out_dir, no_progress, **options):
    """Fetch the web pages of URL lists and keep their article text (OpenWebText's step).

    URL_FILE: one URL a line (blank lines and # comments skipped), or a Reddit
    submission dump in jsonl (url, score; .jsonl/.json, or a first line starting
    with {). Compressed .gz/.bz2/.xz lists are read as well.
    """
    options["blacklist_domains"] = tuple(options["blacklist_domains"])
    options["blacklist_extensions"] = tuple(options["blacklist_extensions"])
    try:
        summary = crawl(url_files, out_dir, CrawlSettings(**options), progress=not no_progress)
    except (ValueError, OSError) as e:
        raise CommandError(str(e)) from None
    click.echo(format_summary(summary))
    click.echo(f"output: {out_dir / PAGES}, {out_dir / ERRORS}, {out_dir / SUMMARY}")
