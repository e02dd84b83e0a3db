"""Profiles: named llama-server endpoints with a known speculation setup, and the argv that launches one."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from urllib.parse import urlsplit

from adaptive_spec.errors import ConfigError
from adaptive_spec.llama.binary import capabilities
from adaptive_spec.llama.binary.capabilities import Capabilities
from adaptive_spec.llama.speculation import PerRequestSupport, Speculation

DRAFT_TYPES = {"dflash": "draft-dflash", "mtp": "draft-mtp", "eagle3": "draft-eagle3", "simple": "draft-simple"}
# Drafters that read a separate draft GGUF (-md); MTP drafts with the target model's own heads.
_NEEDS_DRAFT_FILE = frozenset({"draft-dflash", "draft-eagle3", "draft-simple", "draft-dspark"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
# llama-server's options that choose a chat template: the user's own one wins over a shipped template.
_TEMPLATE_OPTIONS = frozenset({"--chat-template", "--chat-template-file"})


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A GGUF given as a local path, or as a Hugging Face `repo[:quant]` that llama-server downloads itself."""

    path: str | None = None
    hf_repo: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelSource:
        if text.startswith("hf:"):
            return cls(hf_repo=text[3:])
        return cls(path=text)

    def args(self, *, draft: bool) -> list[str]:
        if self.hf_repo is not None:
            return ["-hfd" if draft else "-hf", self.hf_repo]
        assert self.path is not None
        return ["-md" if draft else "-m", self.path]

    def __str__(self) -> str:
        return f"hf:{self.hf_repo}" if self.hf_repo is not None else str(self.path)


@dataclass(frozen=True, slots=True)
class NgramModParams:
    """ngram-mod's lookup: match `n_match` tokens of context, draft between `n_min` and `n_max` tokens."""

    n_match: int = 24
    n_min: int = 48
    n_max: int = 64

    def args(self) -> list[str]:
        return [
            "--spec-ngram-mod-n-match",
            str(self.n_match),
            "--spec-ngram-mod-n-min",
            str(self.n_min),
            "--spec-ngram-mod-n-max",
            str(self.n_max),
        ]


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """A profile that adaptive-spec launches itself: its name and speculation setup."""

    name: str
    spec_types: tuple[str, ...]
    ngram_mod: NgramModParams = field(default_factory=NgramModParams)
    # A setting offered only as a per-request setting of one server: a stock llama-server gets no process of its own
    # for it (another copy of the model for a setting the router seldom picks).
    shared_only: bool = False

    @property
    def uses_draft_file(self) -> bool:
        return uses_draft_model(self.spec_types)


def uses_draft_model(spec_types: tuple[str, ...] | None) -> bool:
    """Whether these speculation types run a separate draft model (-md), not the target's own heads or n-grams."""
    return any(t in _NEEDS_DRAFT_FILE for t in spec_types or ())


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Settings every launched profile shares: one model, so a session can move between profiles."""

    model: ModelSource
    draft: ModelSource | None = None
    draft_n_max: int = 15
    ctx_size: int = 32768
    threads: int = 1
    parallel: int = 1
    extra_args: tuple[str, ...] = ()
    chat_template_file: str | None = None  # a shipped template for the model, unless extra_args name their own


def server_argv(
    binary: str,
    spec: ProfileSpec,
    settings: ServerSettings,
    *,
    host: str,
    port: int,
    slot_save_path: str,
    offers: Capabilities | None = None,
) -> list[str]:
    """The llama-server command line for one launched profile. `offers`: what the binary accepts (probed from its
    `--help` once per build when not given)."""
    offers = capabilities.of_binary(binary) if offers is None else offers
    argv = [binary, *settings.model.args(draft=False)]
    argv += ["--host", host, "--port", str(port)]
    argv += ["-c", str(settings.ctx_size), "-t", str(settings.threads), "--parallel", str(settings.parallel)]
    argv += ["--jinja", "--metrics", "--slot-save-path", slot_save_path]
    argv += spec_type_args(spec.spec_types, offers)
    if spec.uses_draft_file:
        if settings.draft is None:
            raise ConfigError(f"profile {spec.name!r} uses {','.join(spec.spec_types)} but no --draft was given")
        argv += settings.draft.args(draft=True)
        argv += ["--spec-draft-n-max", str(settings.draft_n_max)]
        if "draft-dflash" in spec.spec_types:
            argv += ["-fa", "on"]
    if "ngram-mod" in spec.spec_types:
        argv += spec.ngram_mod.args()
    if settings.chat_template_file and not any(a.partition("=")[0] in _TEMPLATE_OPTIONS for a in settings.extra_args):
        argv += ["--chat-template-file", settings.chat_template_file]
    argv += list(settings.extra_args)
    return argv


def spec_type_args(spec_types: tuple[str, ...], offers: Capabilities) -> list[str]:
    """`--spec-type` for exactly these types. Where `--spec-type` adds to a default set (a binary that lists
    `--no-spec-type`, upstream's open #28391), the set is cleared first, so a draft-only or no-speculation profile
    does not silently gain the default ngram-mod."""
    if not offers.no_spec_type:
        return ["--spec-type", ",".join(spec_types)]
    chosen = [t for t in spec_types if t != "none"]
    return ["--no-spec-type", *(["--spec-type", ",".join(chosen)] if chosen else [])]


# Measured on the embedded Qwen2.5-Coder-0.5B (docs/benchmarks.md, "Choosing ngram-mod parameters").
SMALL_MODEL_NGRAM_MOD = NgramModParams(n_match=24, n_min=48, n_max=64)


def default_profiles(draft_type: str | None, ngram_mod: NgramModParams) -> tuple[ProfileSpec, ...]:
    """The pair from the public benchmark: `oneshot` without n-gram drafting, `iterative` with ngram-mod.

    With a drafter (`draft_type`), `oneshot` is the drafter alone and `iterative` the drafter + ngram-mod, and the
    server offers two more settings per request: `plain` (no speculation: prose whose drafts are rejected) and
    `ngram` (n-grams alone). Those two exist only as settings of one server (`shared_only`).
    """
    if draft_type is None:
        return (ProfileSpec("oneshot", ("none",)), ProfileSpec("iterative", ("ngram-mod",), ngram_mod))
    try:
        drafter = DRAFT_TYPES[draft_type]
    except KeyError:
        known = ", ".join(DRAFT_TYPES)
        raise ConfigError(f"unknown --draft-type {draft_type!r}; choose one of: {known}") from None
    return (
        ProfileSpec("oneshot", (drafter,)),
        ProfileSpec("iterative", (drafter, "ngram-mod"), ngram_mod),
        ProfileSpec("plain", ("none",), shared_only=True),
        ProfileSpec("ngram", ("ngram-mod",), ngram_mod, shared_only=True),
    )


@dataclass(frozen=True, slots=True)
class AttachedProfile:
    """A profile the user runs: `NAME=URL`, or `NAME=URL#MODEL` for a router-mode server's preset; either may end in
    `;types=T1,T2` and/or `;n_max=N`, the per-request speculation settings its requests carry to a server that takes
    them (profiles naming one such server are settings of it; without a suffix a profile names nothing)."""

    name: str
    base_url: str
    upstream_model: str | None = None
    speculation: Speculation = field(default_factory=Speculation)

    @classmethod
    def parse(cls, text: str) -> AttachedProfile:
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ConfigError(f"--profile {text!r}: expected NAME=URL or NAME=URL#MODEL")
        check_profile_name(name)
        rest, semi, settings = rest.partition(";")
        url, _, model = rest.partition("#")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--profile {text!r}: {url!r} is not an http(s) URL")
        speculation = Speculation.parse(settings, f"--profile {text!r}") if semi else Speculation()
        return cls(name, url.rstrip("/"), model or None, speculation)


def check_profile_name(name: str) -> None:
    if not _NAME.match(name):
        raise ConfigError(f"profile name {name!r}: use letters, digits, '_' and '-' (at most 64)")


@dataclass(frozen=True, slots=True)
class ProfileInfo:
    """What a running profile says about itself at start-up (from /props and /slots)."""

    name: str
    base_url: str
    upstream_model: str | None
    model_path: str
    model_alias: str
    n_ctx: int
    total_slots: int
    spec_types: tuple[str, ...] | None  # None until a slot has served a request
    speculative: bool | None
    replica: int = 0  # its place in the profile's pool (`--profile NAME=URL` given more than once)
    per_request: PerRequestSupport | None = None  # the server takes speculation settings per request (None: stock)
    speculation: Speculation = field(default_factory=Speculation)  # the settings this profile's requests carry
    server: str | None = None  # a server it shares with other profiles (None: a server of its own)

    @property
    def label(self) -> str:
        return f"{self.name}#{self.replica}" if self.replica else self.name

    @property
    def model_identity(self) -> str:
        """The model file's name: the same GGUF under different directories (or machines) still matches."""
        return PurePath(self.model_path).name if self.model_path else self.model_alias


def replica_mismatch(infos: list[ProfileInfo]) -> str | None:
    """A message naming two replicas of one profile that serve different models (or, when both say, different
    speculation types), or None: a pool's servers must be interchangeable."""
    first: dict[str, ProfileInfo] = {}
    for info in infos:
        head = first.setdefault(info.name, info)
        if head is info:
            continue
        what = None
        if info.model_identity != head.model_identity:
            what = ("models", head.model_identity, info.model_identity)
        elif head.spec_types and info.spec_types and head.spec_types != info.spec_types:
            what = ("speculation types", ",".join(head.spec_types), ",".join(info.spec_types))
        if what is not None:
            kind, a, b = what
            return (
                f"the replicas of profile {info.name!r} serve different {kind}: #{head.replica} at {head.base_url} "
                f"serves {a!r} but #{info.replica} at {info.base_url} serves {b!r}. Every replica of a profile must "
                "run the same model and setup (sessions move between them)."
            )
    return None


def model_mismatch(infos: list[ProfileInfo]) -> str | None:
    """A message naming two profiles that serve different models, or None when all serve the same one."""
    if not infos:
        return None
    first = infos[0]
    for other in infos[1:]:
        if other.model_identity != first.model_identity:
            return (
                f"profiles serve different models: {first.name!r} serves {first.model_identity!r} "
                f"({first.base_url}) but {other.name!r} serves {other.model_identity!r} ({other.base_url}). "
                "A session must be able to move between profiles, so every profile must serve the same model."
            )
    return None


@dataclass(frozen=True, slots=True)
class SharedServer:
    """Launched profiles as settings of one server: the profile whose own server hosts them all (it names nothing),
    and each profile's settings on it."""

    host: str
    settings: tuple[tuple[str, Speculation], ...]

    def speculation(self, profile: str) -> Speculation:
        return dict(self.settings).get(profile, Speculation())


def one_server(specs: Sequence[ProfileSpec]) -> SharedServer | None:
    """The one server that serves every launched profile, if one of theirs can: the first whose types include every
    other profile's (and whose ngram-mod parameters are theirs), the others restricted to their own types per
    request. None when no profile's server can stand in for the others (then each gets its own)."""
    for host in specs:
        offered = set(host.spec_types) - {"none"}
        same_ngram = all("ngram-mod" not in s.spec_types or s.ngram_mod == host.ngram_mod for s in specs)
        if same_ngram and all(set(s.spec_types) - {"none"} <= offered for s in specs):
            own = {s.name: tuple(t for t in s.spec_types if t != "none") for s in specs}
            settings = tuple((s.name, Speculation() if s is host else Speculation(types=own[s.name])) for s in specs)
            return SharedServer(host.name, settings)
    return None


def shared_servers(infos: Sequence[ProfileInfo]) -> dict[tuple[str, int], str]:
    """Profiles at one URL (and router preset) of a server that takes speculation per request are settings of that
    one server: (profile, replica) → the server, for each URL more than one profile names. Stock servers keep their
    meaning: each profile's own, whatever its URL."""
    by_server: dict[str, list[tuple[str, int]]] = {}
    for info in infos:
        if info.per_request is not None:
            server = info.base_url + (f"#{info.upstream_model}" if info.upstream_model else "")
            by_server.setdefault(server, []).append((info.name, info.replica))
    return {key: server for server, keys in by_server.items() if len(keys) > 1 for key in keys}


def speculation_problem(infos: Sequence[ProfileInfo]) -> str | None:
    """A message naming a profile whose settings its server cannot take (every request would fail), or None."""
    for info in infos:
        if not info.speculation.named:
            continue
        if info.per_request is None:
            return (
                f"profile {info.label!r} names speculation settings ({info.speculation.describe()}) but the server at "
                f"{info.base_url} does not take them per request (a stock llama-server): drop the ';types=' / "
                "';n_max=' suffix, or run the patched llama-server (adaptive-spec build-server)"
            )
        why = info.per_request.problem(info.speculation)
        if why is not None:
            return f"profile {info.label!r} at {info.base_url}: {why}"
    return None
