"""The path a request is treated as, decided once on the raw request target: the same decoded path is classified
(which API, which project) and forwarded, so no encoding can make llama-server see a path the proxy did not check."""

from __future__ import annotations

from urllib.parse import quote, unquote

from adaptive_spec.requests.body.parse import RoutedPath, split_path
from adaptive_spec.requests.body.shapes import RequestProblem

# Kept as they are when the decided path is encoded again for llama-server (RFC 3986 pchar plus "/").
_PATH_SAFE = "/-._~!$&'()*+,;=:@"
_MAX_PATH = 8192


def _invalid(message: str) -> RequestProblem:
    return RequestProblem(message, "invalid_path")


def decide_path(target: str) -> RoutedPath | RequestProblem:
    """`target` is the request target as sent (path and query, still percent-encoded). The returned
    `upstream_path` is encoded again and forwarded as it is; anything ambiguous is refused instead."""
    raw = target.partition("?")[0]
    if not raw.startswith("/") or raw.startswith("//"):
        # Absolute-form ("http://host/x") and "//host/x" name another host: this is not a forward proxy.
        return _invalid("The request target must be a path starting with a single '/' (this is not a forward proxy).")
    if len(raw) > _MAX_PATH:
        return _invalid(f"The request path is longer than {_MAX_PATH} characters.")
    if "#" in raw or "%2f" in raw.lower() or "%5c" in raw.lower():
        return _invalid("The request path may not contain '#' or an encoded '/' or '\\'.")
    try:
        path = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        return _invalid("The request path is not valid UTF-8 once decoded.")
    if any(ord(c) < 0x20 or c in "\x7f\\?#" for c in path):
        return _invalid("The request path contains control characters, '\\', or an encoded '?' or '#'.")
    segments = path.split("/")[1:]
    if any(s in (".", "..") for s in segments) or any(s == "" for s in segments[:-1]):
        return _invalid("The request path may not contain '.' or '..' segments or empty segments ('//').")
    routed = split_path(path)
    if routed.project is None and (path == "/p" or path.startswith("/p/")):
        return RequestProblem(
            "Invalid project in /p/<project>/: use 1 to 128 letters, digits, '.', '_' or '-', starting with a "
            "letter or a digit.",
            "invalid_project",
        )
    return RoutedPath(routed.project, quote(routed.upstream_path, safe=_PATH_SAFE), routed.api)
