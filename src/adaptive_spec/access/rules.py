"""Who may drive the proxy: the API keys it accepts, the Host names it answers to, the browser origins it lets in, and
the llama-server control endpoints it keeps to itself.

Pure checks; `requests/gate.py` applies them."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
ANY = "*"
# Headers that carry the client's key: not sent on to llama-server while the proxy checks keys itself.
KEY_HEADERS = ("authorization", "x-api-key", "x-goog-api-key")
# The query parameter Gemini clients may send their key in: never sent on to llama-server (which reads none).
KEY_PARAMETER = "key"
# A browser can send these cross-origin without a preflight (an HTML form can): never accepted where state changes.
SIMPLE_FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})
_HOST = re.compile(r"^(?P<name>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>[0-9]{1,5}))?$")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """What `serve` was told about access; the defaults are a loopback-only proxy without a key."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no key is asked for; never in a repr
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS  # "name" (any port) or "name:port"; "*" turns the check off
    cors_origins: tuple[str, ...] = ()  # origins a browser page may call from; "*" any
    forward_api_key: bool = False  # send the client's key on to llama-server (attached servers with their own key)
    allow_profile_control: bool = False  # let clients use llama-server's slot actions, model loading, POST /props

    @property
    def keys_required(self) -> bool:
        return bool(self.api_keys)


def _digest(value: str) -> bytes:
    # Equal-length digests: compare_digest then takes the same time whatever the key's length or prefix.
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def key_accepted(policy: AccessPolicy, sent: list[str]) -> bool:
    """Whether any key the client sent is one of the policy's, compared in constant time against every key."""
    accepted = False
    for candidate in sent:
        for key in policy.api_keys:
            accepted |= hmac.compare_digest(_digest(candidate), _digest(key))
    return accepted


def sent_keys(authorization: str | None, x_api_key: str | None, *plain: str | None) -> list[str]:
    """The keys a client sent: `Authorization: Bearer KEY` (OpenAI clients), `x-api-key: KEY` (Anthropic's) and
    any other key sent as it is (`plain`: Gemini's `x-goog-api-key` header and `?key=` parameter)."""
    keys = []
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            keys.append(token.strip())
    for key in (x_api_key, *plain):
        if key and key.strip():
            keys.append(key.strip())
    return keys


def split_host(value: str) -> tuple[str, str | None] | None:
    """`Host` header → (lower-case name, port or None); None when it is not a plain host[:port]."""
    match = _HOST.match(value.strip())
    if match is None:
        return None
    return match.group("name").lower().rstrip("."), match.group("port")


def host_allowed(policy: AccessPolicy, host_header: str | None) -> bool:
    """A DNS-rebinding page reaches 127.0.0.1 under its own name, which the browser sends as `Host`: only names
    the proxy was told about are answered. A request without `Host` (HTTP/1.0) comes from no browser."""
    if ANY in policy.allowed_hosts or host_header is None:
        return True
    split = split_host(host_header)
    if split is None:
        return False
    name, port = split
    for entry in policy.allowed_hosts:
        allowed = split_host(entry)
        if allowed is not None and allowed[0] == name and allowed[1] in (None, port):
            return True
    return False


def _origin_netloc(origin: str) -> str | None:
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{name.lower()}:{port or _DEFAULT_PORTS[parts.scheme]}"


def same_origin(origin: str, host_header: str | None) -> bool:
    """Whether a page at `origin` is the proxy itself (its own address in a browser tab)."""
    netloc = _origin_netloc(origin)
    split = split_host(host_header) if host_header else None
    return netloc is not None and split is not None and netloc == f"{split[0]}:{split[1] or '80'}"


def cors_allowed(policy: AccessPolicy, origin: str) -> bool:
    """Whether `--cors-origin` lets pages at `origin` call the proxy (and read its answers)."""
    if ANY in policy.cors_origins:
        return True
    return origin.strip().rstrip("/").lower() in {o.rstrip("/").lower() for o in policy.cors_origins}


def origin_allowed(policy: AccessPolicy, origin: str | None, host_header: str | None) -> bool:
    """No `Origin` (not a browser), the proxy's own origin, or one named with `--cors-origin`."""
    return origin is None or same_origin(origin, host_header) or cors_allowed(policy, origin)


def is_loopback(bind_host: str) -> bool:
    """Whether binding to this address keeps the port on this machine."""
    if bind_host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def hosts_for_bind(bind_host: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The loopback names, the address the proxy is bound to when it is a specific one, and the names given."""
    hosts = list(LOOPBACK_HOSTS)
    host = bind_host.strip()
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    if address is None:
        hosts.append(host.lower())
    elif not address.is_unspecified:
        hosts.append(f"[{address}]" if address.version == 6 else str(address))
    hosts.extend(e.strip().lower() for e in extra)
    return tuple(dict.fromkeys(h for h in hosts if h))


def control_refusal(policy: AccessPolicy, method: str, path: str, query: Mapping[str, str]) -> str | None:
    """Why a request for one of llama-server's control endpoints is refused, or None. The proxy owns the slots (KV
    placements, handoffs) and the router-mode presets; a client acting on them would pull them from under it."""
    if policy.allow_profile_control:
        return None
    bare = path[3:] if path.startswith("/v1/") else path
    if (bare == "/slots" or bare.startswith("/slots/")) and (method not in ("GET", "HEAD") or "action" in query):
        return "slot actions (save, restore, erase) belong to adaptive-spec, which places sessions in slots"
    bare = bare.rstrip("/")
    if bare in ("/models/load", "/models/unload") or (bare == "/models" and method not in ("GET", "HEAD")):
        return "loading, adding and unloading router-mode models belongs to adaptive-spec's profiles"
    if method not in ("GET", "HEAD") and bare in ("/props", "/lora-adapters"):
        return "changing a profile's server settings would change it for every session"
    if bare in ("/cors-proxy", "/tools"):
        return "llama-server would fetch URLs or run tools on a client's behalf"
    return None


def with_model(body: bytes, preset: str) -> bytes:
    """A router-mode profile (`URL#MODEL`) serves its preset whatever `model` the client names: llama-server's
    router would otherwise load another model for it. Bodies that are not JSON objects go as they are."""
    try:
        obj = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return body
    if not isinstance(obj, dict) or obj.get("model") == preset:
        return body
    return orjson.dumps({**obj, "model": preset})
