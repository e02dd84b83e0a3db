"""What `adaptive-spec serve` runs, as the command line decided it: the profiles to launch or attach, the sessions,
the trace, the policies, the KV moves and the connections (values: `proxy/run.py` carries them out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adaptive_spec.access.rules import AccessPolicy
from adaptive_spec.kv.heads.values import HeadsConfig
from adaptive_spec.kv.movers import RelayMoverSettings
from adaptive_spec.kv.remote_prefill.shell import RemotePrefillSettings
from adaptive_spec.llama.binary.cpu_faults import RepackMode
from adaptive_spec.llama.launch import HUNG_RESTART_S
from adaptive_spec.llama.profiles import AttachedProfile, ProfileSpec, ServerSettings
from adaptive_spec.proxy.app import ProxySettings
from adaptive_spec.proxy.connection_book import ConnectionLimits
from adaptive_spec.sessions.grouping import ECHO_FINGERPRINTS
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.shared_state.options import SharedStateSettings


@dataclass(frozen=True)
class LaunchSettings:
    binary: str
    specs: list[ProfileSpec]
    settings: ServerSettings
    start_timeout_s: float = 600.0  # each profile's time to become healthy
    device_memory_mib: int | None = None  # fit the launch to a device of this size instead of asking nvidia-smi
    one_server: bool = True  # the profiles as per-request settings of one llama-server, when it takes them
    repack: RepackMode = "auto"  # CPU weight repacking (llama/binary/cpu_faults.py): --cpu-repack
    hung_restart_s: float = HUNG_RESTART_S  # a server marked down this long is killed and restarted


@dataclass(frozen=True)
class SessionSettings:
    tokenizer: str = "auto"  # auto | gguf | endpoint | tiktoken | off
    ngram: NgramParams = field(default_factory=NgramParams)
    key_projects: dict[str, str] = field(default_factory=dict)
    max_sessions: int = 64
    max_tokens: int = 131_072
    idle_expiry_s: float = 3600.0
    echo_fingerprints: int = ECHO_FINGERPRINTS  # the reply echo's bound (sessions/grouping.py)


@dataclass(frozen=True)
class ServeSettings:
    host: str
    port: int
    proxy: ProxySettings
    default_profile: str | None
    launch: LaunchSettings | None = None
    attach: list[AttachedProfile] = field(default_factory=list)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    trace_path: Path | None = None
    trace_content: bool = False
    trace_max_bytes: int = 64 * 1024 * 1024
    policy_file: Path | None = None  # None: the shipped policies/default.toml
    workspace_policies: bool = True  # read .adaptive-spec.toml in the workspace an agent reveals
    slot_dir: Path | None = None  # attached profiles' shared --slot-save-path (launched ones get their own)
    verbose: bool = False  # let native libraries (llama.cpp loading the tokenizer) log to the terminal
    access: AccessPolicy = field(default_factory=AccessPolicy)
    remote_prefill: RemotePrefillSettings | None = None  # --pp-server
    relays: RelayMoverSettings | None = None  # --relay SERVER_URL=RELAY_URL: KV moves between hosts
    heads: HeadsConfig | None = None  # warm starts (kv/heads/): None with --no-heads
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)  # slow and idle clients, the cap
    event_loop: str = "asyncio"  # proxy/event_loop.py: asyncio or uvloop
    shared_state: SharedStateSettings | None = None  # --shared-state: sessions, placements, bookings among proxies
    agents_note: str | None = None  # which embedded model suits coding agents, said after start
