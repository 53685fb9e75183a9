"""Settings: one dataclass, loaded from arguments, then ``CKPT_*`` variables, then a TOML file.

Precedence (first wins): explicit arguments (CLI flags, ``Checkpointer(...)``
keywords) → environment variables ``CKPT_<FIELD>`` (upper case, e.g.
``CKPT_DISK=/nvme/ckpt``) → the TOML file named by ``CKPT_CONFIG`` (default
``./tierckpt.toml`` if present) → the defaults below. The TOML file holds the
same field names at top level or under a ``[tierckpt]`` table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tiers.memory import default_shm_root

__all__ = ["Settings", "SettingsConflictError", "SettingsError", "given_settings", "private_socket_folder",
           "setting_conflicts", "socket_path_for"]

#: longest filesystem path a Unix socket may have (``sun_path`` is 108 bytes with its NUL; kept below it)
_MAX_SOCKET_PATH = 100


class SettingsError(ValueError):
    """A setting has a bad value; the message names it and says what is accepted."""


class SettingsConflictError(SettingsError):
    """A job's own settings differ from those of the agent already running on its memory folder."""


@dataclass
class Settings:
    """Where checkpoints go and how the agent drains them.

    Every size is in bytes, every duration in seconds.
    """

    #: host-memory folder (tmpfs) that holds this node's memory tier and staging slots
    shm: str = field(default_factory=default_shm_root)
    #: local NVMe folder for the disk tier; None = no disk tier
    disk: str | None = None
    #: ``s3://bucket/prefix`` for the S3 tier; None = no S3 tier
    s3: str | None = None
    #: S3-compatible endpoint URL (else boto3's ``AWS_ENDPOINT_URL*`` variables)
    s3_endpoint: str | None = None
    #: write every Nth save to disk / to S3 (1 = every save)
    disk_every: int = 1
    s3_every: int = 1
    #: newest complete steps kept per tier
    keep_memory: int = 2
    keep_disk: int = 3
    keep_s3: int = 3
    #: LZ4-compress shards on disk
    compress: bool = False
    #: a rank holding chunks that other ranks hold too (data-parallel replicas, TP-replicated tensors) keeps
    #: its whole shard on this node's disk, so a restore from disk reads no other node's; by default it keeps
    #: its durable part only (the chunks it writes for all their holders): each chunk is once in the job's
    #: disks, and a disk restore reads the rest from the other nodes' disks through their agents
    disk_whole: bool = False
    #: when no staging slot is free: "wait" for one (up to slot_wait seconds) or "skip" the save
    full_policy: str = "wait"
    slot_wait: float = 300.0
    #: bound on shard bytes being written to disk/S3 or copied to peers at once
    max_inflight_bytes: int = 8 << 30
    #: S3 retry deadline: after this long a failing upload is reported as an error
    s3_retry_deadline: float = 120.0
    #: Unix socket of the node agent; None = derived from ``shm``
    socket: str | None = None
    #: seconds SIGTERM waits for in-flight writes before abandoning them
    grace: float = 30.0
    #: this node's rank among the job's agents (its line in the peers list, from 0)
    node_rank: int = 0
    #: the job's agents: a file with one ``host:port [domain=LABEL]`` per line in node-rank
    #: order, or the same entries comma-separated inline; None = this node alone
    peers: str | None = None
    #: etcd endpoints (``http://host:2379``, comma-separated): membership comes from etcd instead of a peers file
    #: (see agents/directory.py); needs ``nodes``, ``advertise`` and this node's ``node_rank``
    etcd: str | None = None
    #: the cluster's name in etcd (its key prefix)
    cluster: str = "default"
    #: how many nodes the cluster has (with ``etcd``)
    nodes: int = 0
    #: ``host:port`` other nodes reach this agent at, registered in etcd
    advertise: str | None = None
    #: this node's failure domain (a rack), registered in etcd
    domain: str | None = None
    #: a node that trains nothing and offers its host memory as replica targets (its peers-file line says
    #: ``role=memory``; with etcd, it registers so); trainers' saves are refused here
    memory_only: bool = False
    #: most bytes of replicas this node's memory takes from its peers (0: as much as its folder has room for);
    #: past it, a copy is refused (507) and stays with its primary
    memory_limit: int = 0
    #: seconds this node's etcd lease lives without a keep-alive (once it runs out, the others hold the node
    #: dead); 0 = ``dead_after``
    etcd_lease: float = 0.0
    #: file holding the per-job secret that signs every peer request (required whenever ``peers`` is set,
    #: loopback included: without it any local user could read, overwrite or delete the node's checkpoints)
    secret_file: str | None = None
    #: copies of every shard in host memory, the node's own included
    replicas: int = 2
    #: "group" (GEMINI) or "ring"
    placement: str = "group"
    #: cap on this node's replication traffic, bytes/s; 0 = no cap
    peer_bandwidth: int = 0
    #: seconds between heartbeats; a peer silent for ``dead_after`` seconds is declared dead
    heartbeat: float = 1.0
    dead_after: float = 5.0
    #: seconds a peer that never answered since this agent started has before it is declared dead (agents of
    #: a large cluster start over a minute or more); once it answered, ``dead_after`` applies
    startup_grace: float = 120.0
    #: nodes whose votes elect the commit root; 0 = a majority of the peers file (1 of 2 nodes). Below it no
    #: root is elected and nothing commits (a partition's minority side waits for the link); 1 lets any node
    #: be root alone
    quorum: int = 0
    #: seconds a peer request may take before the peer counts as unreachable
    peer_timeout: float = 10.0
    #: warm restore: at start, pull from peers this node's ranks' shards of each job's newest step
    prefetch: bool = True
    #: children per node in the tree that carries commit records up and manifests down
    fanout: int = 8
    #: seconds a layout object that no retained step names is kept in this node's memory and disk before
    #: retention removes it (a layout is stored before the manifest that names it)
    layout_grace: float = 600.0
    #: optional TLS for the peer protocol: this node's certificate and key, and the CA that signed every node's
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    #: when a job ends cleanly (every trainer's Checkpointer closed without error), an agent started for it
    #: (the embedded one) keeps the job's memory tier; by default it frees it once a lower tier holds the
    #: newest step (it is kept, and the log says so, when memory is the only tier that holds it)
    keep_memory_after_close: bool = False
    #: seconds an agent keeps the memory tier of a job that crashed (a trainer left without a clean end: an
    #: exception, a kill, a lost peer), so its restart restores from memory; an embedded agent stays up that
    #: long. When it runs out the newest step is written to disk first (where disk is set and lacks it), then
    #: memory is freed as at a clean end. The default covers a torchrun restart and a Slurm requeue on a busy
    #: queue; ``ckpt gc JOB`` frees it sooner
    keep_after_crash: float = 3600.0

    def validate(self) -> "Settings":
        for name in ("disk_every", "s3_every", "keep_memory", "keep_disk", "keep_s3"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SettingsError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.keep_after_crash, (int, float)) or self.keep_after_crash < 0:
            raise SettingsError(f"keep_after_crash must be a number of seconds >= 0, got {self.keep_after_crash!r}")
        if self.full_policy not in ("wait", "skip"):
            raise SettingsError(f"full_policy must be 'wait' or 'skip', got {self.full_policy!r}")
        if self.s3 is not None and not self.s3.startswith("s3://"):
            raise SettingsError(f"s3 must look like s3://bucket/prefix, got {self.s3!r}")
        if self.replicas < 1:
            raise SettingsError(f"replicas must be >= 1, got {self.replicas}")
        if self.placement not in ("group", "ring"):
            raise SettingsError(f"placement must be 'group' or 'ring', got {self.placement!r}")
        if self.heartbeat <= 0 or self.dead_after <= self.heartbeat:
            raise SettingsError("heartbeat must be > 0 and dead_after larger than heartbeat")
        if self.startup_grace < 0:
            raise SettingsError(f"startup_grace must be >= 0 seconds, got {self.startup_grace!r}")
        if not isinstance(self.quorum, int) or self.quorum < 0:
            raise SettingsError(f"quorum must be an integer >= 0 (0: a majority of the peers), got {self.quorum!r}")
        if not isinstance(self.fanout, int) or self.fanout < 1:
            raise SettingsError(f"fanout must be an integer >= 1, got {self.fanout!r}")
        if self.max_inflight_bytes < 1:
            raise SettingsError("max_inflight_bytes must be >= 1")
        if self.etcd is not None:
            if not isinstance(self.nodes, int) or self.nodes < 1:
                raise SettingsError("with etcd, give the cluster's size: --nodes N")
            if not self.advertise or ":" not in self.advertise:
                raise SettingsError("with etcd, give the host:port the other nodes reach this agent at: --advertise")
            if not 0 <= self.node_rank < self.nodes:
                raise SettingsError(f"node rank {self.node_rank} is not one of the {self.nodes} nodes (0..{self.nodes - 1})")
        if (self.peers or self.etcd) and not self.secret_file:
            raise SettingsError(
                "peers need a secret, even on loopback: create one with (umask 077; head -c 32 /dev/urandom "
                "| base64 > job.secret), the same file on every node, and pass --secret-file job.secret "
                "(or CKPT_SECRET_FILE)")
        if self.socket is not None and (self.socket.startswith(("\0", "@")) or not self.socket.strip()):
            raise SettingsError(
                f"socket {self.socket!r} is not a filesystem path: the abstract namespace has no permissions, so "
                "any local user could reach the agent; give a path in a folder only you can enter")
        if self.socket is not None and len(os.path.abspath(self.socket).encode()) >= _MAX_SOCKET_PATH:
            raise SettingsError(f"socket path {self.socket!r} is {len(os.path.abspath(self.socket).encode())} "
                                f"bytes, over the {_MAX_SOCKET_PATH - 1} a Unix socket allows: give a shorter one")
        return self

    @property
    def socket_path(self) -> str:
        return self.socket or socket_path_for(self.shm)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Settings":
        """Settings from :meth:`to_dict` output (an agent's, over its socket): fields this version does not
        know are ignored; nothing is read from the environment or a config file."""
        known = {f.name: f for f in fields(cls)}
        out = cls()
        for name, v in values.items():
            if name in known:
                setattr(out, name, _coerce(name, known[name].type, v))
        return out.validate()

    @classmethod
    def load(
        cls,
        args: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | None = None,
    ) -> "Settings":
        """Merge arguments (None values ignored), ``CKPT_*`` variables and the TOML file."""
        out = cls()
        for name, v in given_settings(args, env, config_file).items():
            setattr(out, name, v)
        return out.validate()


def given_settings(args: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                   config_file: str | None = None) -> dict[str, Any]:
    """The settings given explicitly (arguments, ``CKPT_*`` variables, the TOML file; first wins), by name,
    with their types checked; a field given nowhere is absent."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = config_file or env.get("CKPT_CONFIG") or ("tierckpt.toml" if os.path.exists("tierckpt.toml") else None)
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError as e:
            raise SettingsError(f"config file {path} does not exist: fix CKPT_CONFIG or create it") from e
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"config file {path} is not valid TOML: {e}") from e
        values.update(doc.get("tierckpt", doc))
    known = {f.name: f for f in fields(Settings)}
    for name in known:
        raw = env.get(f"CKPT_{name.upper()}")
        if raw is not None:
            values[name] = raw
    for name, v in (args or {}).items():
        if v is not None and name in known:
            values[name] = v
    unknown = set(values) - set(known)
    if unknown:
        raise SettingsError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    return {name: _coerce(name, known[name].type, v) for name, v in values.items()}


#: settings that say how to reach an agent, not how it works: never a conflict with a running one
_REACH = ("socket",)


def _same(name: str, a: Any, b: Any) -> bool:
    if name in ("shm", "disk", "secret_file", "tls_cert", "tls_key", "tls_ca", "peers") and a and b:
        if name != "peers" or os.path.exists(str(a)):
            return os.path.realpath(str(a)) == os.path.realpath(str(b))
    if name == "s3" and a and b:
        return str(a).rstrip("/") == str(b).rstrip("/")
    return a == b


def setting_conflicts(given: Mapping[str, Any], running: Settings) -> list[str]:
    """``name=<given> (the agent: <its value>)`` for each setting in ``given`` that the running agent has
    otherwise (paths compared after resolving them; ``shm`` only when the agent was reached by ``socket``,
    since otherwise its socket is found inside that very folder)."""
    out = []
    for name, mine in given.items():
        if name in _REACH or (name == "shm" and not given.get("socket")):
            continue
        theirs = getattr(running, name, None)
        if not _same(name, mine, theirs):
            out.append(f"{name}={mine!r} (the agent: {theirs!r})")
    return out


def _coerce(name: str, typ: Any, v: Any) -> Any:
    typ = str(typ)
    try:
        if isinstance(v, str) and "None" in typ and v.strip().lower() in ("", "none"):
            return None
        if typ.startswith("int"):
            return int(v)
        if typ.startswith("float"):
            return float(v)
        if typ.startswith("bool"):
            if isinstance(v, str):
                if v.lower() in ("1", "true", "yes", "on"):
                    return True
                if v.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(v)
            return bool(v)
        return None if v is None else str(v)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"setting {name} = {v!r} is not a valid {typ}") from e


def socket_path_for(shm: str) -> str:
    """The agent's Unix socket for a memory folder: ``<shm>/.agent.sock``.

    When that path is too long for a Unix socket, a file named by a hash of the
    folder in :func:`private_socket_folder` instead; never the abstract
    namespace, which has no permissions. Creates nothing.
    """
    path = os.path.join(os.path.abspath(shm), ".agent.sock")
    if len(path.encode()) < _MAX_SOCKET_PATH:
        return path
    name = hashlib.sha1(os.path.abspath(shm).encode()).hexdigest()[:24] + ".sock"
    return os.path.join(_short_socket_folder(), name)


def _short_socket_folder() -> str:
    return f"/tmp/tierckpt-{os.getuid()}"


def private_socket_folder(socket_path: str) -> str:
    """Make sure the folder of ``socket_path`` exists, is owned by this user and only this user can enter it.

    Creates it (mode 0700) when missing, and tightens a folder of this user's to 0700. Raises
    :class:`SettingsError` when it belongs to another user (who could then replace the socket). Returns the folder.
    """
    folder = os.path.dirname(os.path.abspath(socket_path))
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError as e:
        raise SettingsError(f"cannot create the agent's socket folder {folder}: {e.strerror}; give --socket "
                            "a path in a folder you own") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SettingsError(f"the agent's socket folder {folder} is not a folder owned by uid {os.getuid()}: "
                            "remove it, or give --socket a path in a folder you own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(folder, 0o700)
    return folder
