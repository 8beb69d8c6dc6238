"""Fetch Llama 3's own tokenizer from the package index and convert it to a tokenizer.json.

`make data RECIPE=llama3` and `make test` run this.  It needs only the package registry
(pip), not the open internet: pip downloads the wheel of Meta's `llama-models` once into
`--cache` (checked against its sha256), and its `llama_models/llama3/tokenizer.model`
(tiktoken format: 128,000 byte-level BPE ranks; checked against its sha256) is written to
OUT/tokenizer.model and converted once by `megadata.llama3_tokenizer.convert` into
OUT/tokenizer.json (Llama 3's split pattern, its 256 special tokens at 128000-128255),
which pipelines/corpus/llama3.toml reads.  OUT/SOURCE.json says where both came from and
their sha256; a second run with both files in place and unchanged does nothing.
"""

import argparse
import json
import sys
import zipfile
from pathlib import Path

from megacommon.files import atomic_write_bytes, atomic_write_json, pip_download, sha256_file
from megadata.llama3_tokenizer import BOS_TOKEN, CONVERSION_VERSION, EOS_TOKEN, convert

PACKAGE = "llama-models==0.3.0"
WHEEL = "llama_models-0.3.0-py3-none-any.whl"
WHEEL_SHA256 = "7f77f78ff13fca09f70d76a376aff6414cd901623fb9d57e69c2f8367a73032f"
MEMBER = "llama_models/llama3/tokenizer.model"
MODEL_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
# Meta's tokenizer.model says "Hello world" in these ids; the conversion must too.
HELLO_WORLD = [9906, 1917]


def _fail(message: str) -> int:
    print(f"fetch_llama3_tokenizer: {message}", file=sys.stderr)
    return 1


def _in_place(out: Path) -> bool:
    try:
        source = json.loads((out / "SOURCE.json").read_text())
        files = {"tokenizer.model": MODEL_SHA256, "tokenizer.json": source["tokenizer_json_sha256"]}
        if source["conversion_version"] != CONVERSION_VERSION:
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((out / f).is_file() and sha256_file(out / f) == d for f, d in files.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/raw/llama3"))
    parser.add_argument("--cache", type=Path, default=Path("data/downloads"))
    args = parser.parse_args()
    out = args.out
    if _in_place(out):
        print(f"Llama 3 tokenizer: already in {out} (SOURCE.json says where from)")
        return 0
    wheel = pip_download(PACKAGE, WHEEL, WHEEL_SHA256, args.cache)
    if isinstance(wheel, str):
        return _fail(wheel)
    try:
        with zipfile.ZipFile(wheel) as zf:
            model = zf.read(MEMBER)
    except (KeyError, zipfile.BadZipFile) as e:
        return _fail(f"{wheel}: not the layout this script knows ({e})")
    atomic_write_bytes(out / "tokenizer.model", model)
    if sha256_file(out / "tokenizer.model") != MODEL_SHA256:
        (out / "tokenizer.model").unlink()
        return _fail(f"{MEMBER} in {WHEEL} has another sha256 than {MODEL_SHA256}")

    tok = convert(out / "tokenizer.model", out / "tokenizer.json")
    said = tok.encode("Hello world", add_special_tokens=False).ids
    if said != HELLO_WORLD:
        (out / "tokenizer.json").unlink()
        return _fail(f"the converted tokenizer says 'Hello world' as {said}, not {HELLO_WORLD}")
    record = {
        "package": PACKAGE,
        "wheel": WHEEL,
        "wheel_sha256": WHEEL_SHA256,
        "wheel_page": "https://pypi.org/project/llama-models/0.3.0/#files",
        "member": MEMBER,
        "tokenizer_model_sha256": MODEL_SHA256,
        "tokenizer_json_sha256": sha256_file(out / "tokenizer.json"),
        "converted_by": "megadata.llama3_tokenizer.convert",
        "conversion_version": CONVERSION_VERSION,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "bos": [BOS_TOKEN, tok.token_to_id(BOS_TOKEN)],
        "eos": [EOS_TOKEN, tok.token_to_id(EOS_TOKEN)],
        "licence": "the Llama 3 Community License Agreement (as the wheel's llama3/tokenizer.py "
        "states)",
    }
    atomic_write_json(out / "SOURCE.json", record)
    print(
        f"Llama 3 tokenizer: {MEMBER} of {WHEEL} -> {out}/tokenizer.json "
        f"({record['vocab_size']} tokens; SOURCE.json says where from)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
