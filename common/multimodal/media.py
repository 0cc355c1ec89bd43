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
  gateway should not be an SSRF proxy by default); when allowed, fetched with
  urllib under a byte cap and a timeout.

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
import io
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

from PIL import Image, ImageOps

__all__ = [
    "ALLOWED_IMAGE_FORMATS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "MediaError",
    "decode_image_bytes",
    "load_image",
]

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
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
    timeout_s: float = 10,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Image.Image:
    """Load ``url`` (data:/file:/http(s):) into a fully decoded RGB PIL image."""
    if not isinstance(url, str) or not url:
        raise MediaError("The image URL must be a non-empty string.")
    # vLLM tests the first five characters case-insensitively.
    if url[:5].lower() == "data:":
        data = _read_data_url(url, max_bytes)
    else:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme.startswith("http"):  # vLLM: scheme.startswith("http")
            if not allow_remote:
                raise MediaError(
                    "Loading images from http(s) URLs is disabled on this server; "
                    "send the image inline as a base64 data URL "
                    "(data:image/png;base64,...)."
                )
            data = _read_http_url(url, max_bytes, timeout_s)
        elif scheme == "file":
            data = _read_file_url(parts.netloc, parts.path, allowed_local_media_path, max_bytes)
        else:
            raise MediaError("The URL must be either a HTTP, data or file URL.")
    return decode_image_bytes(data, max_pixels=max_pixels)


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


def _read_http_url(url: str, max_bytes: int, timeout_s: float) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "tokserve"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise _too_big(int(length), max_bytes)
            # Never trust Content-Length alone: read at most max_bytes + 1.
            chunks, total = [], 0
            while total <= max_bytes:
                chunk = resp.read(min(65536, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            if total > max_bytes:
                raise _too_big(f"more than {max_bytes}", max_bytes)
            return b"".join(chunks)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        # vLLM's wording (connector._wrap_media_fetch_error).
        raise MediaError(f"Failed to fetch media from URL: HTTP {e.code} error") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise MediaError(f"Failed to fetch media from URL: {reason}") from e


# -------------------------------------------------------------------- decoding


def decode_image_bytes(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode encoded image bytes as vLLM's ``ImageMediaIO.load_bytes`` + RGB mode."""
    try:
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
    except MediaError:
        raise
    except Image.DecompressionBombError as e:
        raise MediaError(f"Failed to load image: {e}") from e
    except Image.UnidentifiedImageError as e:
        # Pillow names the in-memory file by its repr (an object address): say what it means.
        raise MediaError("Failed to load image: cannot identify image file (not an image in a format Pillow "
                         "reads, e.g. PNG, JPEG, GIF, BMP, WebP)") from e
    except (OSError, SyntaxError, ValueError) as e:
        # Pillow raises SyntaxError/ValueError from some truncated/corrupt files.
        raise MediaError(f"Failed to load image: {e}") from e


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
