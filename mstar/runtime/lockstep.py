"""Node groups split over several worker processes, run in lockstep.

Plans for a split group (``tp_size x sp_size > 1``) go to its first rank, the *leader*.
Every other member, a *follower*, holds its own shard of the same engines and must make
every ``Engine.run`` and ``Engine.release`` call the leader makes, with the same items and
in the same order, so that the collectives inside the model pair up. The leader's engines
are wrapped in ``LeaderEngine``, which hands each call to the followers over a ``Channel``
before making it; a follower's loop (``Follower.run``) does nothing else: it owns no other
node, receives no plans and sends nothing to the frontend.

Sessions: a follower keeps its own shard of a session's state (a kv rollout's committed
keys and values of its heads) in a ``SessionStore`` of its own. An item's session travels
with the call (its id and ``resume``), so the follower's engine gets a handle on that store
and takes the same path as the leader's (a resume reads the kept state; a session's last
kv window commits, with its collectives, on every member). The sessions a plan drops are
dropped on the followers too (``drop_followers_sessions``), before that plan's calls.

A follower's shard is its own size, so it reports it: after a call whose items have a
session, and after a ``DropSessions``, each follower answers with one small int64 tensor
(a gather to the leader over the channel's group): the bytes each of those sessions holds
in its store, and its session gauges per node. The leader keeps the latest answers
(``FollowerReport``, per follower rank) and its worker sends them up with the plan's
``StepResult``, so the frontend's book and ``/metrics`` see each rank's own figure. A call
without sessions costs nothing more.

``join_world`` is what every member process does at startup, before building engines: join
the process group of all members, then create the TP x SP groups of every split layout and
the channel of every leader, in the same order on every member (creating a group is a
collective over the whole world).
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from mstar.distributed.collectives import broadcast
from mstar.distributed.state import Group, ParallelState, build_mesh, init_distributed
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.runtime.protocol import ChunkRef, SessionRef
from mstar.runtime.sessions import SessionHandle, SessionStore

log = logging.getLogger(__name__)

# A follower waits on its channel for as long as the server is idle; the leader's process
# going away closes the connection, so a long wait never hides a dead leader.
CHANNEL_TIMEOUT = timedelta(days=365)

Layout = tuple[tuple[int, ...], int, int]  # (global ranks, tp_size, sp_size) of a split group


# ------------------------------------------------------------------ messages
class _TensorMeta(msgspec.Struct, array_like=True):
    port: str
    dtype: str  # the torch dtype's name, e.g. "int64"
    shape: list[int]


class _Item(msgspec.Struct, array_like=True):
    request_id: str
    op: str
    iteration: int
    params: dict[str, Any]
    chunk: ChunkRef | None
    inputs: list[_TensorMeta]  # their bytes follow the message, in this order
    session: SessionRef | None = None  # the follower's engine gets a handle on its own store


class Run(msgspec.Struct, tag=True):
    node: str
    items: list[_Item]


class Release(msgspec.Struct, tag=True):
    node: str
    request_id: str


class DropSessions(msgspec.Struct, tag=True):
    session_ids: list[str]
    nodes: list[str] = []  # the nodes the leader leads: each follower answers its gauges of each


class Stop(msgspec.Struct, tag=True):
    pass


Message = Run | Release | DropSessions | Stop

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


@dataclass
class FollowerReport:
    """What a follower last told its leader of its sessions: per session, the bytes its
    state holds there (since the leader's worker last took them), and its session gauges
    (``"node.sessions_held"``, ``"node.session_bytes"``)."""

    session_bytes: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


class Channel:
    """Messages from a leader to its followers over a gloo group. Each message is two
    broadcasts from the leader: its length, then its bytes (msgpack metadata followed by
    the raw bytes of its tensors). The followers answer some (``answer`` / ``gather``).
    ``members``: the deployment's worker ranks of the group's members, leader first (they
    name the followers in ``reports``)."""

    def __init__(self, group: Group, members: Sequence[int] | None = None):
        self.group = group  # the leader is group.ranks[0]
        self.members = tuple(members) if members is not None else tuple(range(group.size))
        self.reports: dict[int, FollowerReport] = {}  # follower's worker rank -> its latest answers (leader)

    def send(self, message: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
        meta = _encoder.encode(message)
        parts = [torch.frombuffer(bytearray(meta), dtype=torch.uint8)]
        parts += [_bytes_of(t) for t in tensors]
        data = torch.cat(parts)
        broadcast(torch.tensor([len(meta), data.numel()], dtype=torch.int64), self.group)
        broadcast(data, self.group)

    def recv(self) -> tuple[Message, torch.Tensor]:
        """The next message and the bytes of its tensors."""
        header = broadcast(torch.zeros(2, dtype=torch.int64), self.group)
        meta_len, total = header.tolist()
        data = broadcast(torch.empty(total, dtype=torch.uint8), self.group)
        return _decoder.decode(data[:meta_len].numpy().tobytes()), data[meta_len:]

    def answer(self, values: Sequence[int]) -> None:
        """A follower's answer to the message it just handled (int64s, as many as the
        leader expects of it)."""
        dist.gather(torch.tensor(list(values), dtype=torch.int64), None, dst=self.group.ranks[0],
                    group=self.group.process_group)

    def gather(self, count: int) -> dict[int, list[int]]:
        """The leader's side of ``answer``: each follower's ``count`` int64s, by its worker rank."""
        own = torch.zeros(count, dtype=torch.int64)
        parts = [torch.empty(count, dtype=torch.int64) for _ in range(self.group.size)]
        dist.gather(own, parts, dst=self.group.ranks[0], group=self.group.process_group)
        return {rank: part.tolist() for rank, part in zip(self.members[1:], parts[1:])}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def run_sessions(session_ids: Iterable[str | None]) -> list[str]:
    """The distinct sessions of a call's items, in order: what the followers answer for. The
    leader and each follower count them alike (the gather's sizes must agree)."""
    return list(dict.fromkeys(s for s in session_ids if s is not None))


def session_gauges(store: SessionStore, nodes: Sequence[str], own: Container[str]) -> list[int]:
    """A follower's session gauges for ``nodes``: (sessions held, bytes held) for each, or
    (-1, -1) for a node it does not run (``own``: the nodes it does)."""
    held, size = store.held(), store.held_bytes()
    out: list[int] = []
    for node in nodes:
        out += [held.get(node, 0), size.get(node, 0)] if node in own else [-1, -1]
    return out


def _note_gauges(report: FollowerReport, nodes: Sequence[str], values: Sequence[int]) -> None:
    for i, node in enumerate(nodes):
        count, size = values[2 * i], values[2 * i + 1]
        if count >= 0:
            report.gauges[f"{node}.sessions_held"], report.gauges[f"{node}.session_bytes"] = float(count), float(size)


def encode_run(node: str, items: list[EngineItem]) -> tuple[Run, list[torch.Tensor]]:
    """The message for ``engine.run(items)`` and the tensors that travel with it."""
    metas, tensors = [], []
    for item in items:
        ports = sorted(item.inputs)
        session = None if item.session is None else SessionRef(item.session.session_id, item.session.resume)
        metas.append(_Item(item.request_id, item.op, item.iteration, item.params, item.chunk,
                           [_TensorMeta(p, str(item.inputs[p].dtype).removeprefix("torch."),
                                        list(item.inputs[p].shape)) for p in ports], session))
        tensors += [item.inputs[p] for p in ports]
    return Run(node, metas), tensors


def decode_run(message: Run, data: torch.Tensor, sessions: SessionStore | None = None) -> list[EngineItem]:
    """The items of a ``Run`` message, their tensors cut from ``data`` (on the CPU); an item
    of a session gets a handle on ``sessions`` (the follower's own store)."""
    items, offset = [], 0
    for meta in message.items:
        inputs = {}
        for t in meta.inputs:
            dtype = getattr(torch, t.dtype)
            size = dtype.itemsize
            for dim in t.shape:
                size *= dim
            inputs[t.port] = data[offset:offset + size].clone().view(dtype).reshape(t.shape)
            offset += size
        session = None if meta.session is None or sessions is None else \
            SessionHandle(sessions, meta.session.id, message.node, meta.session.resume)
        items.append(EngineItem(meta.request_id, meta.op, meta.iteration, inputs, meta.params, meta.chunk, session))
    return items


# ------------------------------------------------------------ both roles
class LeaderEngine(Engine):
    """A leader's engine of a split group: every call goes to the followers first."""

    def __init__(self, node: str, engine: Engine, channel: Channel):
        self.node = node
        self.engine = engine
        self.channel = channel

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        self.channel.send(*encode_run(self.node, items))
        sessions = run_sessions(None if item.session is None else item.session.session_id for item in items)
        if not sessions:
            return self.engine.run(items)
        try:
            return self.engine.run(items)
        finally:  # the followers answer whether or not the call failed (theirs fails alike)
            for rank, values in self.channel.gather(len(sessions) + 2).items():
                report = self.channel.reports.setdefault(rank, FollowerReport())
                report.session_bytes.update(zip(sessions, values))
                _note_gauges(report, [self.node], values[len(sessions):])

    def release(self, request_id: str) -> None:
        self.channel.send(Release(self.node, request_id))
        self.engine.release(request_id)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


class Follower:
    """A follower's whole job: make the calls its leader makes, until it says stop."""

    def __init__(self, rank: int, channel: Channel, engines: dict[str, Engine]):
        self.rank = rank
        self.channel = channel
        self.engines = engines
        self.sessions = SessionStore()  # its shard of the sessions' state, as the leader's worker keeps its own

    def run(self) -> None:
        """Returns on ``Stop``; raises when the leader's process is gone."""
        while True:
            message, data = self.channel.recv()
            if isinstance(message, Stop):
                return
            if isinstance(message, DropSessions):
                for session_id in message.session_ids:
                    self.sessions.drop(session_id)
                self.channel.answer(session_gauges(self.sessions, message.nodes, self.engines))
                continue
            engine = self.engines.get(message.node)
            try:
                if engine is None:  # a node of another group this leader runs
                    pass
                elif isinstance(message, Release):
                    engine.release(message.request_id)
                else:
                    engine.run(decode_run(message, data, self.sessions))
            except Exception as err:  # the leader fails the same way, and reports it
                log.warning("rank %d: %s failed in lockstep with its leader: %s", self.rank, message.node, err)
            sessions = [] if isinstance(message, Release) else \
                run_sessions(None if m.session is None else m.session.id for m in message.items)
            if sessions:  # the leader waits for this answer, as for a call's (``LeaderEngine.run``)
                self.channel.answer([self.sessions.nbytes(s) for s in sessions]
                                    + session_gauges(self.sessions, [message.node], self.engines))

    def stats(self) -> dict[str, float]:
        return {f"{node}.{name}": value for node, engine in self.engines.items()
                for name, value in engine.stats().items()}


def _led_channels(engines: dict[str, Engine]) -> list[Channel]:
    """The channels of the groups these engines lead, each once."""
    return list({id(e.channel): e.channel for e in engines.values() if isinstance(e, LeaderEngine)}.values())


def stop_followers(engines: dict[str, Engine]) -> None:
    """Tell the followers of every group these engines lead to end their loops."""
    for channel in _led_channels(engines):
        channel.send(Stop())


def drop_followers_sessions(engines: dict[str, Engine], session_ids: list[str]) -> None:
    """The followers of every group these engines lead free these sessions' state (sent before
    the calls of the plan that dropped them, so a fresh start under an old name finds none),
    and answer their session gauges."""
    for channel in _led_channels(engines):
        nodes = sorted(node for node, e in engines.items() if isinstance(e, LeaderEngine) and e.channel is channel)
        channel.send(DropSessions(list(session_ids), nodes))
        for rank, values in channel.gather(2 * len(nodes)).items():
            report = channel.reports.setdefault(rank, FollowerReport())
            for session_id in session_ids:
                report.session_bytes.pop(session_id, None)
            _note_gauges(report, nodes, values)


def take_follower_reports(engines: dict[str, Engine]) -> dict[int, FollowerReport]:
    """The followers' latest answers, per follower rank, for the plan's ``StepResult``: the
    session bytes they reported since the last take (taken: the next plan sends only new
    ones), and their session gauges."""
    out = {}
    for channel in _led_channels(engines):
        for rank, report in channel.reports.items():
            out[rank] = FollowerReport(report.session_bytes, dict(report.gauges))
            report.session_bytes = {}
    return out


# ----------------------------------------------------------------- startup
@dataclass
class World:
    """This process's part in the split groups of a deployment."""

    states: dict[Layout, ParallelState]  # the layouts it is a member of
    channel: Channel | None = None  # the channel it leads or follows
    leads: bool = False

    @property
    def follows(self) -> bool:
        return self.channel is not None and not self.leads


def join_world(rank: int, layouts: Sequence[Layout], init_method: str, device: torch.device | str,
               timeout: timedelta | None = None) -> World:
    """Join the split ``layouts`` (in the same order on every rank) as global ``rank``.

    The world is every rank of some layout, numbered in rank order; a rank in none joins
    nothing. A follower must be led by one leader only (placement checks it).
    """
    members = sorted({r for ranks, _, _ in layouts for r in ranks})
    if rank not in members:
        return World({})
    init_distributed(members.index(rank), len(members), init_method, device, timeout)
    states: dict[Layout, ParallelState] = {}
    for layout in dict.fromkeys(layouts):  # each distinct layout once, in order
        ranks, tp_size, sp_size = layout
        state = build_mesh([members.index(r) for r in ranks], tp_size, sp_size)
        if state is not None:
            states[layout] = state
    followers: dict[int, set[int]] = {}
    for ranks, _, _ in layouts:
        followers.setdefault(ranks[0], set()).update(ranks[1:])
    world = World(states)
    for leader, led in sorted(followers.items()):
        ranks = [leader, *sorted(led)]
        process_group = dist.new_group([members.index(r) for r in ranks], timeout=CHANNEL_TIMEOUT, backend="gloo")
        if rank in ranks:
            group = Group(ranks.index(rank), len(ranks), tuple(members.index(r) for r in ranks), process_group)
            world.channel, world.leads = Channel(group, ranks), rank == leader
    return world
