"""What the packages share, in one place each (imports no torch):

- `progress`: a tqdm bar on a terminal, plain periodic lines elsewhere;
- `errors`: `CommandError` and the exit codes every command uses;
- `files`: `sha256_file`, atomic writes, and `pip_download` (a file from the package index);
- `corpus_format`: the corpus directory (Arrow shards + manifest.json), its one writer and
  the manifest's reader, with its version.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megacommon")
except PackageNotFoundError:  # run from the source tree (PYTHONPATH), not installed
    __version__ = "0+source"
