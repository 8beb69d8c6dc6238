"""Fetch the default recipe's inputs: real English text from the gensim wheel's test data.

`make data` runs this before `megadata run`.  It needs only the package
registry (pip), not the open internet: pip downloads gensim's wheel (no install)
and the files below are taken out of it and checked against their sha256.

- a shortened English Wikipedia XML dump (206 pages; Wikipedia text is CC BY-SA);
- the Lee background corpus: 300 ABC news articles, one per line (Lee, Pincombe and
  Welsh 2005, shipped with gensim under its LGPL terms).
"""

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from megacommon.files import sha256_file

WHEEL = "gensim==4.4.0"
FILES = {
    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2": (
        "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
    ),
    "lee_background.cor": "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/raw"))
    out = parser.parse_args().out
    if all((out / n).exists() and sha256_file(out / n) == digest for n, digest in FILES.items()):
        print(f"sample data: already in {out}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
        proc = subprocess.run([*cmd, "-d", tmp, WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("gensim-*.whl"))
        if proc.returncode != 0 or not wheels:
            print(
                f"fetch_sample_data: pip could not download {WHEEL} "
                f"({proc.stderr.strip()[-300:]}); "
                "the default recipe needs it: check the package index settings (PIP_INDEX_URL)",
                file=sys.stderr,
            )
            return 1
        with zipfile.ZipFile(wheels[0]) as zf:
            for name, digest in FILES.items():
                target = out / name
                target.write_bytes(zf.read(f"gensim/test/test_data/{name}"))
                if sha256_file(target) != digest:
                    target.unlink()
                    print(
                        f"fetch_sample_data: {name} in {wheels[0].name} has another sha256",
                        file=sys.stderr,
                    )
                    return 1
    print(f"sample data: {', '.join(FILES)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
