"""One path layer for every file the project reads or writes: local paths and gs:// URLs.

Every path goes through `resolve` first: a local path becomes absolute (as os.path.abspath),
`gs://bucket/key` stays a URL, and any other scheme (s3://, hdfs://, http://, or a mangled
`gs:/bucket`) is a `PathError` naming it, so a URL never silently turns into a local folder.
Files are then reached through `etils.epath` (what Orbax uses), which serves gs:// with gcsfs;
recursive listings (`find`, `glob` with `**`, which epath refuses on gs://) are one gcsfs object
listing there and os.walk locally.
Orbax writes arrays with tensorstore's own `gcs` driver; TensorBoard events go through
tensorboardX's google-cloud-storage writer.

Emulator: `STORAGE_EMULATOR_HOST=http://HOST:PORT` (the convention of Google's client
libraries, which gcsfs and google-cloud-storage read themselves) routes every gs:// access to
a GCS emulator. `configure_gcs` maps it once, before the first gs:// access, onto what
tensorstore reads (`TENSORSTORE_GCS_HTTP_URL`, and a fixed bearer token in
`GOOGLE_AUTH_TOKEN_FOR_TESTING` so it never asks a metadata server for credentials) and gives
gcsfs anonymous credentials.
"""

from __future__ import annotations

import fnmatch
import io
import os
import re

from etils import epath

SCHEMES = ("gs",)  # what this layer serves besides local paths
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//)?")
# Schemes that name remote storage even when written with one slash (`gs:/b/run`, what
# os.path.abspath leaves of a URL); any other `word:` prefix without `//` is a local name.
_KNOWN = ("gs", "gcs", "s3", "s3a", "hdfs", "http", "https", "az", "abfs", "file", "hf")
_configured = False


class PathError(ValueError):
    """A path this layer cannot serve (unknown URL scheme or a malformed gs:// URL)."""


def is_gcs(path) -> bool:
    return str(path).startswith("gs://")


def resolve(path) -> str:
    """The canonical form of `path`: absolute for a local path, `gs://bucket/key` for GCS."""
    text = os.fspath(path)
    m = _URL.match(text)
    if m is None or (not m.group(2) and m.group(1).lower() not in _KNOWN):
        return os.path.abspath(text)
    scheme, slashes = m.group(1).lower(), m.group(2)
    if scheme not in SCHEMES or m.group(1) != scheme:
        raise PathError(f"{text!r}: URL scheme {scheme}:// is not supported (supported: local paths, "
                        + ", ".join(f"{s}://" for s in SCHEMES) + ")")
    bucket = text[len(m.group(0)):].split("/", 1)[0]
    if not slashes or not bucket:
        raise PathError(f"{text!r}: not a gs:// URL; write gs://BUCKET/PATH")
    configure_gcs()
    return text.rstrip("/") if text.count("/") > 2 else text


def path(p) -> epath.Path:
    """The epath.Path of `p` (resolved): the object Orbax and file access take."""
    return epath.Path(resolve(p))


def join(base, *parts) -> str:
    base = resolve(base)
    if is_gcs(base):
        return "/".join([base.rstrip("/"), *(str(q).strip("/") for q in parts)])
    return os.path.join(base, *map(str, parts))


def dirname(p) -> str:
    p = resolve(p)
    if is_gcs(p):
        head = p.rsplit("/", 1)[0]
        return head if head.count("/") >= 2 else p  # gs://bucket is its own parent
    return os.path.dirname(p)


def basename(p) -> str:
    return resolve(p).rstrip("/").rsplit("/", 1)[-1]


def exists(p) -> bool:
    return path(p).exists()


def isdir(p) -> bool:
    return path(p).is_dir()


def isfile(p) -> bool:
    return path(p).is_file()


def makedirs(p) -> None:
    path(p).mkdir(parents=True, exist_ok=True)


def listdir(p) -> list[str]:
    """Names of the entries of directory `p`, sorted."""
    return sorted(q.name for q in path(p).iterdir())


def find(p) -> list[str]:
    """Every file under directory `p`, at any depth, sorted (full paths; [] when `p` is not a
    directory). On gs:// one recursive object listing (gcsfs `find`); locally os.walk."""
    p = resolve(p)
    if not is_gcs(p):
        return sorted(os.path.join(d, n) for d, _, names in os.walk(p) for n in names)
    import fsspec

    root = p.rstrip("/") + "/"
    keys = fsspec.filesystem("gs").find(root[len("gs://"):])
    return sorted(u for u in ("gs://" + k.rstrip("/") for k in keys) if u.startswith(root))


def _glob_regex(pattern: str) -> re.Pattern:
    """A regex for a shell pattern with glob.glob(recursive=True)'s meaning: `*`, `?` and `[...]`
    stay inside one path component, a whole `**` component spans zero or more of them."""
    out, parts = [], pattern.split("/")
    for i, part in enumerate(parts):
        if part == "**":
            out.append(".*" if i == len(parts) - 1 else "(?:[^/]+/)*")
            continue
        j = 0
        while j < len(part):
            c = part[j]
            close = part.find("]", j + 2) if c == "[" else -1
            if c == "*":
                out.append("[^/]*")
            elif c == "?":
                out.append("[^/]")
            elif close > 0:
                body = part[j + 1:close]
                out.append("[" + ("^" + body[1:] if body[0] == "!" else body).replace("\\", "\\\\") + "]")
                j = close
            else:
                out.append(re.escape(c))
            j += 1
        if i < len(parts) - 1:
            out.append("/")
    return re.compile("".join(out) + r"\Z", re.S)


def glob(pattern: str) -> list[str]:
    """Paths matching a shell pattern (`*`, `?`, `[...]`, `**` for any depth), sorted, files and
    directories alike; on gs:// the pattern's directory part before the first wildcard is listed
    (recursively when the pattern has `**`)."""
    pattern = resolve(pattern)
    if not is_gcs(pattern):
        import glob as glob_lib

        return sorted(glob_lib.glob(pattern, recursive=True))
    cut = min([pattern.find(c) for c in "*?[" if c in pattern] or [len(pattern)])
    root = pattern[:cut].rsplit("/", 1)[0]
    if cut == len(pattern):
        return [pattern] if exists(pattern) else []
    rest = pattern[len(root) + 1:]
    if "**" not in rest.split("/"):
        return sorted(str(q) for q in path(root).glob(rest) if fnmatch.fnmatchcase(str(q), pattern))
    files = find(root)
    dirs = {f.rsplit("/", i)[0] for f in files for i in range(1, f[len(root):].count("/"))}
    regex = _glob_regex(pattern)
    return sorted(q for q in set(files) | dirs if regex.match(q))


def open_file(p, mode: str = "r", encoding: str | None = None, newline: str | None = None):
    """`open` for local and gs:// files (text is UTF-8 unless told). GCS objects cannot be
    appended to: mode 'a' is an error there (rewrite the whole object instead)."""
    p = resolve(p)
    binary = "b" in mode
    if not is_gcs(p):
        if "w" in mode:
            os.makedirs(os.path.dirname(p), exist_ok=True)
        return open(p, mode) if binary else open(p, mode, encoding=encoding or "utf-8", newline=newline)
    if "a" in mode:
        raise PathError(f"{p}: gs:// objects cannot be appended to (mode {mode!r})")
    f = epath.Path(p).open(mode.replace("t", "").replace("b", "") + "b")
    return f if binary else io.TextIOWrapper(f, encoding=encoding or "utf-8", newline=newline)


def read_text(p) -> str:
    with open_file(p) as f:
        return f.read()


def read_bytes(p) -> bytes:
    with open_file(p, "rb") as f:
        return f.read()


def write_text(p, text: str) -> None:
    with open_file(p, "w") as f:
        f.write(text)


def remove(p) -> None:
    path(p).unlink()


def configure_gcs() -> None:
    """Point every GCS client at STORAGE_EMULATOR_HOST when it is set; once, before the first
    gs:// access (tensorstore and gcsfs read their settings when their first client is made)."""
    global _configured
    if _configured:
        return
    _configured = True
    import fsspec

    # gcsfs's default class asks a gRPC control plane for each bucket's layout (zonal or
    # hierarchical) and waits 60 s for an answer an emulator never gives; the JSON-API class
    # serves every bucket kind. Listings are not cached: tensorstore and other hosts write too.
    fsspec.register_implementation("gs", "gcsfs.core.GCSFileSystem", clobber=True)
    fsspec.register_implementation("gcs", "gcsfs.core.GCSFileSystem", clobber=True)
    options = fsspec.config.conf.setdefault("gs", {})
    options.setdefault("use_listings_cache", False)
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host:
        url = host if host.startswith(("http://", "https://")) else "http://" + host
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # tensorstore: no credential lookup
        options.setdefault("token", "anon")  # gcsfs reads STORAGE_EMULATOR_HOST itself
