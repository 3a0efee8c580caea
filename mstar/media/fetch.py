"""Resolve a media reference from a request (an image, an audio clip) to its bytes.

``await fetch_media(ref, max_bytes=..., field=...)`` accepts:

* a data URI (``data:image/png;base64,...``) or bare base64: always;
* an ``http://`` or ``https://`` URL: only when the server runs with ``MSTAR_ALLOW_REMOTE=1``,
  and then only when every address its host resolves to is a public one (not private,
  loopback, link-local, multicast, reserved or unspecified). The connection goes to the
  address that was checked (so a second DNS answer cannot swap it), redirects are
  followed by hand and checked the same way, the body is capped at ``max_bytes`` while it
  streams in, and the whole fetch has a time limit.

Paths on the server, ``file://`` and every other scheme are always refused. Every refusal
is a ``MediaError``: a ``RequestError`` (HTTP 4xx) naming ``field`` and the rule.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import re
import socket
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import anyio
import httpx

from mstar.contract import RequestError

ALLOW_REMOTE_ENV = "MSTAR_ALLOW_REMOTE"
"""Set to ``1`` to let requests name media by http(s) URL (off by default: the server would
otherwise fetch whatever a client points it at)."""

DEFAULT_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_BASE64 = re.compile(r"^[A-Za-z0-9+/_-]*={0,2}$")
_WINDOWS_PATH = re.compile(r"^[A-Za-z]:[\\/]")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class MediaError(RequestError):
    """A media reference the server will not or cannot resolve (4xx naming the field)."""


def remote_allowed() -> bool:
    return os.environ.get(ALLOW_REMOTE_ENV, "") == "1"


def is_public_address(ip: Address) -> bool:
    """Whether the server may connect to ``ip`` on a client's behalf."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified)


async def fetch_media(ref: str, *, max_bytes: int, field: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
    """The bytes ``ref`` stands for (see the module doc); at most ``max_bytes`` of them."""
    ref = ref.strip()
    if not ref:
        raise MediaError(field, "is empty; send a data URI, base64 or an http(s) URL")
    if ref.startswith(("/", "./", "../", "~", "\\")) or _WINDOWS_PATH.match(ref):
        raise MediaError(field, "paths on the server are refused; send the bytes as a data URI or base64")
    scheme = _SCHEME.match(ref)
    if scheme is None:
        return _from_base64(ref, max_bytes, field)
    name = scheme.group(1).lower()
    if name == "data":
        return _from_data_uri(ref, max_bytes, field)
    if name == "file":
        raise MediaError(field, "file:// URLs are refused: paths on the server are never read")
    if name not in ("http", "https"):
        raise MediaError(field, f"the URL scheme {name!r} is not allowed; use a data URI, base64, or http(s)")
    if not remote_allowed():
        raise MediaError(field, f"remote media URLs are refused (the server allows them only with "
                                f"{ALLOW_REMOTE_ENV}=1); send the bytes as a data URI or base64")
    try:
        with anyio.fail_after(timeout_s):
            return await _download(ref, max_bytes, field)
    except TimeoutError:
        raise MediaError(field, f"fetching the URL took longer than {timeout_s:g} s") from None


# ----------------------------------------------------------------------- inline bytes


def _too_large(field: str, max_bytes: int) -> MediaError:
    return MediaError(field, f"the media is larger than the limit of {max_bytes} bytes", 413)


def _from_base64(text: str, max_bytes: int, field: str) -> bytes:
    text = "".join(text.split())
    if not _BASE64.match(text):
        raise MediaError(field, "is neither a data URI, base64, nor an http(s) URL (paths on the server are refused)")
    if len(text) // 4 * 3 > max_bytes + 2:  # refuse by its length, before decoding it
        raise _too_large(field, max_bytes)
    urlsafe = "-" in text or "_" in text
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_" if urlsafe else None, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(field, f"invalid base64: {exc}") from None
    if len(data) > max_bytes:
        raise _too_large(field, max_bytes)
    if not data:
        raise MediaError(field, "holds no bytes")
    return data


def _from_data_uri(ref: str, max_bytes: int, field: str) -> bytes:
    header, comma, payload = ref.partition(",")
    if not comma:
        raise MediaError(field, "a data URI needs a comma before its payload (data:<type>;base64,<data>)")
    if header.lower().endswith(";base64"):
        return _from_base64(payload, max_bytes, field)
    if len(payload) > 3 * max_bytes:  # percent-encoding takes at most three characters a byte
        raise _too_large(field, max_bytes)
    data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(field, max_bytes)
    if not data:
        raise MediaError(field, "holds no bytes")
    return data


# ------------------------------------------------------------------------ remote URLs


async def _public_address(url: str, field: str) -> tuple[httpx.URL, str]:
    """``url`` with its host replaced by a checked public address of it, and the host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise MediaError(field, f"the URL scheme {parts.scheme!r} is not allowed; use http or https")
    host = parts.hostname
    if not host:
        raise MediaError(field, "the URL has no host")
    if parts.username or parts.password:
        raise MediaError(field, "URLs with credentials are refused")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise MediaError(field, f"invalid URL: {exc}") from None
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(field, f"the host {host!r} cannot be resolved: {exc}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise MediaError(field, f"the host {host!r} has no address")
    for ip in addresses:  # every answer, so that no later connection can pick a private one
        if not is_public_address(ip):
            raise MediaError(field, f"the host {host!r} resolves to {ip}, a private, loopback, link-local, "
                                    "multicast or reserved address: refused")
    return httpx.URL(url).copy_with(host=str(addresses[0]), port=port), host


async def _download(url: str, max_bytes: int, field: str) -> bytes:
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target, host = await _public_address(url, field)
            headers = {"Host": urlsplit(url).netloc.rpartition("@")[2], "Accept-Encoding": "identity"}
            request = client.build_request("GET", target, headers=headers, extensions={"sni_hostname": host})
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise MediaError(field, f"fetching the URL failed: {exc}") from None
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaError(field, f"the URL answered HTTP {response.status_code} without a Location")
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise MediaError(field, f"the URL answered HTTP {response.status_code}")
                return await _capped_body(response, max_bytes, field)
            finally:
                await response.aclose()
        raise MediaError(field, f"the URL redirected more than {MAX_REDIRECTS} times")


async def _capped_body(response: httpx.Response, max_bytes: int, field: str) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(field, max_bytes)
    body = bytearray()
    try:
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(field, max_bytes)
    except httpx.HTTPError as exc:
        raise MediaError(field, f"fetching the URL failed: {exc}") from None
    if not body:
        raise MediaError(field, "the URL returned no bytes")
    return bytes(body)
