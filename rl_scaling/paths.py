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

Deadlines: every gs:// call this layer makes runs under one deadline, `storage.timeout_s`
(configs/common.py, default 120 s; `configure_storage`; $RL_SCALING_STORAGE_TIMEOUT_S overrides
both, for tools such as fit.py and convert.py that read no config). Inside it each HTTP request that goes silent for timeout_s / (1 + retries)
is abandoned and retried (gcsfs's bounded retry, which also covers 429/5xx answers and refused
connections); a call still unfinished at the deadline is cancelled and raises `StorageError`
naming the operation, the path and the endpoint. The same per-request silence limit reaches
every other gcsfs user (etils.epath for Orbax, the workdir lock) through fsspec's defaults, and
tensorstore's curl transport (TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS, ..._CONNECT_TIMEOUT_...).

Appends: a GCS object cannot be appended to, so `append_bytes` uploads only the new bytes as a
temporary object and composes it onto the target (a server-side concatenation); readers see one
ordinary object. metrics.jsonl and the TensorBoard event files grow this way on gs://.
"""

from __future__ import annotations

import asyncio
import fnmatch
import io
import os
import re
import uuid

from etils import epath

SCHEMES = ("gs",)  # what this layer serves besides local paths
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//)?")
# Schemes that name remote storage even when written with one slash (`gs:/b/run`, what
# os.path.abspath leaves of a URL); any other `word:` prefix without `//` is a local name.
_KNOWN = ("gs", "gcs", "s3", "s3a", "hdfs", "http", "https", "az", "abfs", "file", "hf")
_configured = False
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RETRIES = 2
TIMEOUT_ENV = "RL_SCALING_STORAGE_TIMEOUT_S"


def _env_timeout() -> float | None:
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"${TIMEOUT_ENV}={text!r}: give a number of seconds > 0")
    return value


_storage = {"timeout_s": None, "retries": DEFAULT_RETRIES}  # timeout_s None: the default


class PathError(ValueError):
    """A path this layer cannot serve (unknown URL scheme or a malformed gs:// URL)."""


class StorageError(OSError):
    """A gs:// call that did not finish within storage.timeout_s, or failed after its retries;
    the message names the operation, the path and the endpoint."""


def endpoint() -> str:
    """The GCS endpoint gs:// calls go to: $STORAGE_EMULATOR_HOST, else Google's."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if host:
        return host if host.startswith(("http://", "https://")) else "http://" + host
    return "https://storage.googleapis.com"


def timeout_s() -> float:
    """The deadline of one gs:// call: $RL_SCALING_STORAGE_TIMEOUT_S when set (it overrides the
    config, for tools without one), else config.storage.timeout_s, else 120 s."""
    env = _env_timeout()
    if env is not None:
        return env
    return _storage["timeout_s"] if _storage["timeout_s"] is not None else DEFAULT_TIMEOUT_S


def configure_storage(storage=None, *, timeout_s: float | None = None, retries: int | None = None) -> None:
    """Set the deadline of every gs:// call (config.storage: `timeout_s`, `retries`). Call it before
    the first gs:// access: tensorstore reads its curl limits once."""
    if storage is not None:
        timeout_s = storage.get("timeout_s", timeout_s) if timeout_s is None else timeout_s
        retries = storage.get("retries", retries) if retries is None else retries
    if timeout_s is not None:
        timeout_s = float(timeout_s)
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"config.storage.timeout_s={timeout_s}: give a number of seconds > 0")
        _storage["timeout_s"] = timeout_s
    if retries is not None:
        if int(retries) != retries or not 0 <= int(retries) <= 10:
            raise ValueError(f"config.storage.retries={retries}: give an integer in 0..10")
        _storage["retries"] = int(retries)
    global _configured
    if _configured:  # already mapped: apply the new limits to clients made from now on
        _configured = False
        configure_gcs()


def _request_timeout() -> float:
    """How long one HTTP request may stay silent before it is abandoned and retried."""
    return max(timeout_s() / (1 + _storage["retries"]), 1.0)


def _fs():
    import fsspec

    configure_gcs()
    return fsspec.filesystem("gs")


def _key(p: str) -> str:
    return p[len("gs://"):]


def storage_call(op: str, p: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, a gcsfs call about `p` (the lock's conditional writes go through gcsfs's
    `call`), under the whole deadline: fsspec's sync wrapper gives up after `timeout` seconds.
    FileNotFoundError and FileExistsError (a failed precondition) pass through; anything else
    becomes one StorageError naming the operation, the path and the endpoint."""
    limit = timeout_s()
    try:
        return fn(*args, timeout=limit, **kwargs)
    except (FileNotFoundError, FileExistsError):
        raise
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise StorageError(f"gs:// {op} {p}: no answer within {limit:.0f} s (storage.timeout_s) from {endpoint()}; "
                           "is the storage endpoint reachable?") from e
    except Exception as e:  # noqa: BLE001 - client, network and HTTP errors, after gcsfs's retries
        raise StorageError(f"gs:// {op} {p} failed at {endpoint()}: {type(e).__name__}: {str(e)[:300]}") from e


_gcs = storage_call


def gcs_filesystem():
    """The configured gcsfs filesystem (deadlines, emulator) for requests this layer has no call for."""
    return _fs()


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


def _info(p: str) -> dict | None:
    """gcsfs's info of a gs:// object or prefix; None when there is neither."""
    try:
        return _gcs("stat", p, _fs().info, _key(p))
    except FileNotFoundError:
        return None


def exists(p) -> bool:
    p = resolve(p)
    if is_gcs(p):
        return _info(p) is not None
    return os.path.exists(p)


def isdir(p) -> bool:
    p = resolve(p)
    if is_gcs(p):
        info = _info(p)
        return info is not None and info.get("type") == "directory"
    return os.path.isdir(p)


def isfile(p) -> bool:
    p = resolve(p)
    if is_gcs(p):
        info = _info(p)
        return info is not None and info.get("type") == "file"
    return os.path.isfile(p)


def makedirs(p) -> None:
    p = resolve(p)
    if is_gcs(p):
        _gcs("makedirs", p, _fs().makedirs, _key(p), exist_ok=True)  # GCS has no folders: creates nothing
    else:
        os.makedirs(p, exist_ok=True)


def listdir(p) -> list[str]:
    """Names of the entries of directory `p`, sorted."""
    p = resolve(p)
    if not is_gcs(p):
        return sorted(os.listdir(p))
    root = _key(p).rstrip("/")
    names = _gcs("list", p, _fs().ls, root, detail=False)
    return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in names if n.rstrip("/") != root})


def find(p) -> list[str]:
    """Every file under directory `p`, at any depth, sorted (full paths; [] when `p` is not a
    directory). On gs:// one recursive object listing (gcsfs `find`); locally os.walk."""
    p = resolve(p)
    if not is_gcs(p):
        return sorted(os.path.join(d, n) for d, _, names in os.walk(p) for n in names)
    root = p.rstrip("/") + "/"
    keys = _gcs("list", p, _fs().find, _key(root))
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
        hits = _gcs("glob", pattern, _fs().glob, _key(pattern))
        return sorted(q for q in ("gs://" + h.rstrip("/") for h in hits) if fnmatch.fnmatchcase(q, pattern))
    files = find(root)
    dirs = {f.rsplit("/", i)[0] for f in files for i in range(1, f[len(root):].count("/"))}
    regex = _glob_regex(pattern)
    return sorted(q for q in set(files) | dirs if regex.match(q))


def open_file(p, mode: str = "r", encoding: str | None = None, newline: str | None = None):
    """`open` for local and gs:// files (text is UTF-8 unless told). On gs:// a file being written
    is uploaded whole on close, and reads are byte-range requests, each under the deadline. GCS
    objects cannot be appended to: mode 'a' is an error there (`append_bytes` adds to an object)."""
    p = resolve(p)
    binary = "b" in mode
    if not is_gcs(p):
        if "w" in mode:
            os.makedirs(os.path.dirname(p), exist_ok=True)
        return open(p, mode) if binary else open(p, mode, encoding=encoding or "utf-8", newline=newline)
    if "a" in mode:
        raise PathError(f"{p}: gs:// objects cannot be appended to (mode {mode!r})")
    if "w" in mode or "x" in mode:
        f = _Upload(p)
    elif "+" in mode:
        raise PathError(f"{p}: gs:// objects cannot be opened for update (mode {mode!r})")
    else:
        f = io.BufferedReader(_RangeReader(p), buffer_size=1 << 20)
    return f if binary else io.TextIOWrapper(f, encoding=encoding or "utf-8", newline=newline)


class _Upload(io.BytesIO):
    """A gs:// object being written: uploaded in one request, under the deadline, on close."""

    def __init__(self, p: str):
        super().__init__()
        self.url = p

    def close(self):
        if not self.closed:
            data = self.getvalue()
            super().close()
            _gcs("write", self.url, _fs().pipe_file, _key(self.url), data)


class _RangeReader(io.RawIOBase):
    """A gs:// object read by byte ranges (one request per buffer fill, under the deadline)."""

    def __init__(self, p: str):
        info = _info(p)
        if info is None or info.get("type") != "file":
            raise FileNotFoundError(f"{p}: no such object")
        self.url, self.size, self.pos = p, int(info["size"]), 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buf):
        end = min(self.pos + len(buf), self.size)
        if end <= self.pos:
            return 0
        data = _gcs("read", self.url, _fs().cat_file, _key(self.url), start=self.pos, end=end)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


def read_text(p) -> str:
    p = resolve(p)
    if is_gcs(p):
        return read_bytes(p).decode("utf-8")
    with open_file(p) as f:
        return f.read()


def read_bytes(p) -> bytes:
    p = resolve(p)
    if is_gcs(p):
        return _gcs("read", p, _fs().cat_file, _key(p))
    with open_file(p, "rb") as f:
        return f.read()


def write_text(p, text: str) -> None:
    with open_file(p, "w") as f:
        f.write(text)


def write_bytes(p, data: bytes) -> None:
    with open_file(p, "wb") as f:
        f.write(data)


def append_bytes(p, data: bytes) -> None:
    """Add `data` at the end of file `p` (created if absent). Locally an append and a flush; on
    gs:// only `data` is uploaded, as a temporary object composed onto `p` (GCS concatenates
    server-side) and then deleted, so appending n times uploads the bytes once, not n^2/2 times."""
    p = resolve(p)
    if not is_gcs(p):
        with open(p, "ab") as f:
            f.write(data)
        return
    fs = _fs()
    if _info(p) is None:
        _gcs("write", p, fs.pipe_file, _key(p), data)
        return
    if not data:
        return
    part = f"{dirname(p)}/.append-{uuid.uuid4().hex}"  # no reader globs this name
    _gcs("write", part, fs.pipe_file, _key(part), data)
    try:
        _gcs("compose", p, fs.merge, _key(p), [_key(p), _key(part)])
    finally:
        try:
            _gcs("delete", part, fs.rm_file, _key(part))
        except (StorageError, FileNotFoundError):
            pass  # a stray temporary object costs nothing; the compose error is what matters


def remove(p) -> None:
    p = resolve(p)
    if is_gcs(p):
        _gcs("delete", p, _fs().rm_file, _key(p))
    else:
        os.remove(p)


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
    # Every gcsfs request (this layer's, epath's for Orbax, the lock's) gives up after this long
    # without an answer and is retried by gcsfs; this layer's calls also have the whole deadline.
    import aiohttp

    silence = _request_timeout()
    options["requests_timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=silence, sock_read=silence)
    for name, value in (("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", silence),
                        ("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", 1),
                        ("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", silence)):
        os.environ.setdefault(name, str(int(max(value, 1))))
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host:
        url = host if host.startswith(("http://", "https://")) else "http://" + host
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # tensorstore: no credential lookup
        options.setdefault("token", "anon")  # gcsfs reads STORAGE_EMULATOR_HOST itself
