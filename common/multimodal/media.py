"""Load an image from an OpenAI-style ``image_url`` string, following vLLM.

This mirrors ``vllm/multimodal/media/connector.py`` (``MediaConnector``) and
``vllm/multimodal/media/image.py`` (``ImageMediaIO``) of vLLM 0.32 so that a
request accepted/refused by vLLM is accepted/refused here too, with vLLM's
error wording where vLLM has one:

* ``data:[<mediatype>][;<param>]*;base64,<data>`` -- only base64 (RFC 2397
  split exactly as vLLM: the part after the last ``;`` must be ``base64``);
  strict base64 (``validate=True``, as vLLM's ``pybase64`` call).  Like vLLM,
  the declared media type is not trusted: the decoder decides.
* ``file://`` -- only with ``--allowed-local-media-path``; the *resolved* path
  (symlinks and ``..`` collapsed) must lie strictly under the resolved
  allowed directory.
* ``http(s)://`` -- refused unless ``allow_remote`` (a tokens-in/tokens-out
  gateway should not be an SSRF proxy by default); when allowed, fetched under a
  ``FetchPolicy``: every redirect hop re-checked (http/https only, vLLM's
  allowed-domains list, no private/loopback/link-local address unless opted in,
  the connection made to the address checked), a byte cap and one deadline for
  the whole fetch.

Decoding uses vLLM's Pillow format allow-list (no EPS/Ghostscript etc.), a
pixel-count cap checked on the header *before* decoding (decompression
bombs; vLLM's ``VLLM_MAX_IMAGE_PIXELS`` default), EXIF orientation
normalisation and vLLM's RGB conversion (transparent pixels pasted onto
white).  Every failure is a ``MediaError`` (a ``ValueError``), which the
gateway maps to a 400, as vLLM does for ``ValueError``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit
from urllib.request import url2pathname

from PIL import Image, ImageOps

__all__ = [
    "ALLOWED_IMAGE_FORMATS",
    "DEFAULT_FETCH_TIMEOUT_S",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "FetchPolicy",
    "MediaError",
    "decode_image_bytes",
    "fetch_http",
    "image_size",
    "load_image",
    "parse_networks",
    "read_image_bytes",
]

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
# vLLM's VLLM_IMAGE_FETCH_TIMEOUT default; here it bounds the whole fetch, not each read.
DEFAULT_FETCH_TIMEOUT_S = 5.0
MAX_REDIRECTS = 5
# vLLM's VLLM_MAX_IMAGE_PIXELS default (== Pillow's own bomb threshold).
DEFAULT_MAX_PIXELS = 178_956_970

# Copied from vllm/multimodal/image.py: Pillow readers that decode in-process.
# Denied there (and so here): EPS (Ghostscript), WMF, BUFR/GRIB/HDF5 stubs, MPEG.
ALLOWED_IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX",
    "GBR", "GIF", "ICNS", "ICO", "IM", "IMT", "IPTC", "JPEG", "JPEG2000",
    "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI",
    "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB",
)  # fmt: skip


class MediaError(ValueError):
    """A media URL could not be loaded (bad URL, refused, too big, not an image)."""


def load_image(
    url: str,
    *,
    allowed_local_media_path: str | None,
    allow_remote: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    allowed_domains: tuple[str, ...] | list[str] = (),
    private_networks: tuple = (),
) -> Image.Image:
    """Load ``url`` (data:/file:/http(s):) into a fully decoded RGB PIL image."""
    policy = FetchPolicy(allow_remote=allow_remote, allowed_domains=tuple(allowed_domains),
                         private_networks=parse_networks(private_networks), timeout_s=timeout_s)
    data = read_image_bytes(url, allowed_local_media_path=allowed_local_media_path, policy=policy,
                            max_bytes=max_bytes)
    return decode_image_bytes(data, max_pixels=max_pixels)


def read_image_bytes(url: str, *, allowed_local_media_path: str | None, policy: "FetchPolicy",
                     max_bytes: int = DEFAULT_MAX_BYTES, deadline: float | None = None) -> bytes:
    """The encoded bytes behind ``url`` (nothing decoded).  ``deadline``: a
    ``time.monotonic()`` instant an http(s) fetch must end by (default: ``policy.timeout_s``
    from now)."""
    if not isinstance(url, str) or not url:
        raise MediaError("The image URL must be a non-empty string.")
    # vLLM tests the first five characters case-insensitively.
    if url[:5].lower() == "data:":
        return _read_data_url(url, max_bytes)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme.startswith("http"):  # vLLM: scheme.startswith("http")
        if not policy.allow_remote:
            raise MediaError(
                "Loading images from http(s) URLs is disabled on this server; "
                "send the image inline as a base64 data URL "
                "(data:image/png;base64,...)."
            )
        if deadline is None:
            deadline = time.monotonic() + policy.timeout_s
        return fetch_http(url, policy, max_bytes, deadline)
    if scheme == "file":
        return _read_file_url(parts.netloc, parts.path, allowed_local_media_path, max_bytes)
    raise MediaError("The URL must be either a HTTP, data or file URL.")


# --------------------------------------------------------------------- sources


def _too_big(n: int | str, max_bytes: int) -> MediaError:
    return MediaError(f"Image data is too large: {n} bytes exceeds the limit of {max_bytes} bytes.")


def _read_data_url(url: str, max_bytes: int) -> bytes:
    # RFC 2397, split exactly as vLLM's MediaConnector._load_data_url.
    data_spec, sep, data = url[5:].partition(",")
    if not sep:
        raise MediaError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    _media_type, sep, encoding = data_spec.rpartition(";")
    if not sep or encoding != "base64":
        raise MediaError("Only base64 data URLs are supported for now.")
    # Reject before decoding so a huge payload is never materialised twice.
    # Exact decoded length of valid base64 is 3*len/4 minus padding.
    approx = len(data) * 3 // 4 - data[-2:].count("=")
    if approx > max_bytes:
        raise _too_big(approx, max_bytes)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"Invalid base64 data in image data URL: {e}") from e
    if len(raw) > max_bytes:
        raise _too_big(len(raw), max_bytes)
    return raw


def _read_file_url(netloc: str, path: str, allowed: str | None, max_bytes: int) -> bytes:
    if not allowed:
        raise MediaError("Cannot load local files without `--allowed-local-media-path`.")
    root = Path(allowed).resolve()
    # vLLM validates these at startup; we check per call since there is no
    # connector object -- same wording.
    if not root.exists():
        raise MediaError(
            f"Invalid `--allowed-local-media-path`: The path {root} does not exist."
        )
    if not root.is_dir():
        raise MediaError(
            f"Invalid `--allowed-local-media-path`: The path {root} must be a directory."
        )
    filepath = Path(url2pathname(netloc + path))
    resolved = filepath.resolve()
    # Same test as vLLM: the resolved path (symlinks, '..' collapsed) must have
    # the allowed dir among its parents -- the dir itself is not a file.
    if root not in resolved.parents:
        raise MediaError(
            f"The file path {filepath} must be a subpath "
            f"of `--allowed-local-media-path {root}`."
        )
    # Read the *resolved* path so a symlink swapped after the check cannot
    # redirect the read outside the allowed directory.
    try:
        with open(resolved, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise MediaError(f"Cannot read local media file {filepath}: {e.strerror or e}") from e
    if len(raw) > max_bytes:
        raise _too_big(f"more than {max_bytes}", max_bytes)
    return raw


# ------------------------------------------------------------------ http(s)

def parse_networks(values) -> tuple:
    """CIDR strings (or networks) -> ``ip_network`` objects; ValueError on a bad one."""
    return tuple(v if isinstance(v, (ipaddress.IPv4Network, ipaddress.IPv6Network))
                 else ipaddress.ip_network(v, strict=False) for v in values)


@dataclass(frozen=True)
class FetchPolicy:
    """Where http(s) media may be fetched from (vLLM's ``--allowed-media-domains`` and
    ``VLLM_MEDIA_EGRESS_BLOCK_PRIVATE``), checked on the first URL and on every redirect hop."""

    allow_remote: bool = False
    # Exact host names, as vLLM compares them (``url.hostname in allowed_media_domains``);
    # empty: any host.
    allowed_domains: tuple[str, ...] = ()
    # Private/loopback/link-local addresses are refused unless inside one of these (an
    # operator's explicit opt-in, e.g. an internal image store on 10.0.0.0/8).
    private_networks: tuple = ()
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # the whole fetch, redirects included
    max_redirects: int = MAX_REDIRECTS


# Beyond ``is_private``: RFC 6598 shared space (CGNAT) and the IPv6 forms that embed an
# IPv4 destination (6to4, NAT64), as vLLM blocks them.
_BLOCKED_EXTRA = (ipaddress.ip_network("100.64.0.0/10"), ipaddress.ip_network("2002::/16"),
                  ipaddress.ip_network("64:ff9b::/96"))


def _blocked(addr, opted_in: tuple) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if any(addr.version == net.version and addr in net for net in opted_in):
        return False
    return (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_reserved or addr.is_multicast
            or addr.is_unspecified or any(addr.version == n.version and addr in n for n in _BLOCKED_EXTRA))


def _check_hop(url: str, policy: FetchPolicy):
    """One URL hop against the policy -> (scheme, host, port, path, the address to
    connect to).  The host is resolved here and the connection goes to the checked
    address, so a DNS answer that changes between check and connect (rebinding) cannot
    steer the fetch to an address the policy refuses."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        # checked on every hop: a redirect to file:, ftp:, gopher:... is refused like the first URL
        raise MediaError(f"Failed to fetch media from URL: {scheme or 'scheme-less'}: URLs are not fetched "
                         "(only http and https, redirects included).")
    try:
        host, port = parts.hostname, parts.port or (443 if scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number or out of range
        raise MediaError(f"Failed to fetch media from URL: Invalid URL ({e})") from None
    if not host:
        raise MediaError("Failed to fetch media from URL: the URL has no host.")
    if policy.allowed_domains and host not in policy.allowed_domains:
        # vLLM's message (MediaConnector._assert_url_in_allowed_media_domains)
        raise MediaError(f"The URL must be from one of the allowed domains: {list(policy.allowed_domains)}. "
                         f"Input URL domain: {host}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise MediaError(f"Failed to fetch media from URL: cannot resolve host {host!r}: {e}") from None
    addrs = [info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]
    if not addrs:
        raise MediaError(f"Failed to fetch media from URL: cannot resolve host {host!r}")
    for a in addrs:  # every answer, as vLLM: a host with one private answer is refused
        if _blocked(ipaddress.ip_address(a.split("%", 1)[0]), policy.private_networks):
            raise MediaError(
                f"Failed to fetch media from URL: host {host!r} resolves to a blocked address: {a}. Private, "
                "loopback, link-local and multicast destinations are refused (the gateway's "
                "--allow-media-private-networks CIDR opts networks in).")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return scheme, host, port, path, addrs[0]


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to the address the policy checked; ``Host`` stays the URL's host."""

    def __init__(self, host, port, addr, timeout):
        super().__init__(host, port, timeout=timeout)
        self._addr = addr

    def connect(self):
        # kept apart from .sock, which http.client drops once a closing response owns the socket
        self.raw_sock = self.sock = socket.create_connection((self._addr, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host, port, addr, timeout):
        super().__init__(host, port, timeout=timeout)
        self._addr = addr

    def connect(self):
        sock = socket.create_connection((self._addr, self.port), self.timeout)
        # the certificate is checked against the URL's host name (SNI too)
        self.raw_sock = self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _remaining(deadline: float, timeout_s: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaError(f"Failed to fetch media from URL: timed out after {timeout_s:g} s "
                         "(the gateway's --image-fetch-timeout, VLLM_IMAGE_FETCH_TIMEOUT)")
    return left


def fetch_http(url: str, policy: FetchPolicy, max_bytes: int, deadline: float) -> bytes:
    """GET ``url`` under ``policy``: every redirect hop re-checked, the whole fetch
    (connects, headers, body, redirects) ending by ``deadline``, at most ``max_bytes``.

    Socket timeouts are per operation, so a server sending a byte a second never trips
    one: each operation gets only what is left of the deadline, and a watchdog shuts the
    socket at the deadline for the reads http.client makes on its own (status line,
    headers)."""
    for _hop in range(policy.max_redirects + 1):
        scheme, host, port, path, addr = _check_hop(url, policy)
        cls = _PinnedHTTPS if scheme == "https" else _PinnedHTTP
        conn = cls(host, port, addr, _remaining(deadline, policy.timeout_s))
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn,))
        watchdog.daemon = True
        watchdog.start()
        resp = None
        try:
            conn.request("GET", path, headers={"User-Agent": "tokserve", "Accept-Encoding": "identity"})
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308):
                location = resp.getheader("Location")
                if not location:
                    raise MediaError(f"Failed to fetch media from URL: HTTP {resp.status} without a Location")
                url = urljoin(url, location)
                continue
            if resp.status >= 400:
                # vLLM's wording (connector._wrap_media_fetch_error).
                raise MediaError(f"Failed to fetch media from URL: HTTP {resp.status} error")
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise _too_big(int(length), max_bytes)
            # Never trust Content-Length alone: read at most max_bytes + 1.
            chunks, total = [], 0
            while total <= max_bytes:
                conn.raw_sock.settimeout(_remaining(deadline, policy.timeout_s))
                chunk = resp.read1(min(65536, max_bytes + 1 - total))  # one recv: returns what came
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            _remaining(deadline, policy.timeout_s)  # the watchdog may have ended the body early
            if total > max_bytes:
                raise _too_big(f"more than {max_bytes}", max_bytes)
            if length is not None and length.isdigit() and total != int(length):
                raise MediaError(f"Failed to fetch media from URL: the body ended after {total} of {length} bytes")
            return b"".join(chunks)
        except MediaError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            if time.monotonic() >= deadline:
                _remaining(deadline, policy.timeout_s)
            reason = getattr(e, "reason", None) or e
            raise MediaError(f"Failed to fetch media from URL: {reason}") from e
        finally:
            watchdog.cancel()
            if resp is not None:
                resp.close()
            conn.close()
    raise MediaError(f"Failed to fetch media from URL: more than {policy.max_redirects} redirects")


def _shut(conn) -> None:
    sock = getattr(conn, "raw_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


# -------------------------------------------------------------------- decoding


def image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the image's header; no pixel is decoded (Pillow's
    ``open`` is lazy).  The size is before EXIF orientation, which may swap the sides:
    everything the gateway derives from it (pixel count, patch grid size, placeholder
    count) is the same either way."""
    with _pillow_errors(), Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS) as image:
        return image.size


_UNIDENTIFIED = ("Failed to load image: cannot identify image file (not an image in a format Pillow reads, "
                 "e.g. PNG, JPEG, GIF, BMP, WebP)")


@contextlib.contextmanager
def _pillow_errors():
    """Pillow's exceptions as MediaErrors (400s) that say what they mean."""
    try:
        yield
    except MediaError:
        raise
    except Image.DecompressionBombError as e:
        raise MediaError(f"Failed to load image: {e}") from e
    except Image.UnidentifiedImageError as e:
        # Pillow names the in-memory file by its repr (an object address): say what it means.
        raise MediaError(_UNIDENTIFIED) from e
    except (OSError, SyntaxError, ValueError) as e:
        # Pillow raises SyntaxError/ValueError from some truncated/corrupt files.
        raise MediaError(f"Failed to load image: {e}") from e


def decode_image_bytes(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode encoded image bytes as vLLM's ``ImageMediaIO.load_bytes`` + RGB mode."""
    with _pillow_errors():
        image = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
        # Header-only so far: refuse bombs before any pixel is decoded.
        w, h = image.size
        if max_pixels > 0 and w * h > max_pixels:
            raise MediaError(
                f"Image dimensions {w}x{h} ({w * h} pixels) exceed "
                f"the maximum of {max_pixels} pixels."
            )
        with contextlib.suppress(Exception):  # vLLM's normalize_image
            image = ImageOps.exif_transpose(image)
        image.load()
        return _to_rgb(image)


def _to_rgb(image: Image.Image, background=(255, 255, 255)) -> Image.Image:
    """vLLM's ``convert_image_mode(image, "RGB")``: paste transparency on white."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        out = Image.new("RGB", image.size, background)
        out.paste(image, mask=image.split()[3])
        return out
    return image.convert("RGB")
