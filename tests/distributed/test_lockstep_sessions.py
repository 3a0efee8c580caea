"""A split group's follower reports its own session bytes to its leader (two processes, gloo).

The leader (group rank 0, worker rank 4) and its follower (group rank 1, worker rank 7) run an
engine that keeps, per session, a float32 tensor of ``width x steps`` values: 3 wide on the
leader, 5 on the follower, so a shard of each size and the follower's figure cannot be the
leader's. After calls with sessions the leader's channel holds the follower's own bytes per
session and its per-node gauges; a call without sessions is answered by nobody (no gather),
``take_follower_reports`` hands the session bytes over once, and a ``DropSessions`` is
answered with the follower's gauges after the drop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mstar.distributed.state import Group
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.runtime.lockstep import (
    Channel,
    Follower,
    LeaderEngine,
    drop_followers_sessions,
    stop_followers,
    take_follower_reports,
)
from mstar.runtime.sessions import SessionHandle, SessionStore
from tests.distributed.helpers import run_ranks

WIDTH = {0: 3, 1: 5}  # float32 values kept per step of a session, by group rank


class Keeper(Engine):
    """Keeps ``width`` more float32 values per call for each item's session (a growing cache)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.session is not None:
                kept = item.session.get()
                before = kept if kept is not None else torch.zeros(0)
                item.session.put(torch.cat([before, torch.ones(self.width)]))
        return [EngineOutput({"y": item.inputs["x"] + 1}) for item in items]


def _roles(rank: int, world: int) -> dict:
    channel = Channel(Group(rank, world, (0, 1), dist.group.WORLD), members=(4, 7))
    if rank == 1:
        follower = Follower(7, channel, {"keep": Keeper(WIDTH[1])})
        follower.run()
        return {"sizes": {s: follower.sessions.nbytes(s) for s in follower.sessions.sessions}}
    store = SessionStore()
    engines: dict[str, Engine] = {"keep": LeaderEngine("keep", Keeper(WIDTH[0]), channel)}

    def call(*sessions: str | None) -> None:
        items = [EngineItem(f"r{i}", "step", 0, {"x": torch.zeros(2)}, {},
                            session=None if s is None else SessionHandle(store, s, "keep", False))
                 for i, s in enumerate(sessions)]
        engines["keep"].run(items)

    out = {}
    call("a")
    call("a", "b", None)
    out["after_calls"] = take_follower_reports(engines)
    out["taken_again"] = take_follower_reports(engines)
    call(None)  # no sessions: the follower answers nothing (a gather here would hang the test)
    out["after_plain"] = take_follower_reports(engines)
    drop_followers_sessions(engines, ["a"])
    out["after_drop"] = take_follower_reports(engines)
    out["leader_sizes"] = {s: store.nbytes(s) for s in store.sessions}
    stop_followers(engines)
    return out


def test_the_follower_reports_its_own_session_bytes_and_gauges():
    leader, follower = run_ranks(_roles, 2, timeout=60)
    four = 4  # bytes of a float32
    assert leader["leader_sizes"] == {"a": 2 * WIDTH[0] * four, "b": WIDTH[0] * four}
    report = leader["after_calls"][7]
    assert set(leader["after_calls"]) == {7}  # named by its worker rank, not its group rank
    assert report.session_bytes == {"a": 2 * WIDTH[1] * four, "b": WIDTH[1] * four}
    assert report.gauges == {"keep.sessions_held": 2.0, "keep.session_bytes": 3.0 * WIDTH[1] * four}
    assert leader["taken_again"][7].session_bytes == {}  # handed over once
    assert leader["taken_again"][7].gauges == report.gauges  # gauges stay until new ones come
    assert leader["after_plain"][7].session_bytes == {}
    assert leader["after_drop"][7].gauges == {"keep.sessions_held": 1.0, "keep.session_bytes": 1.0 * WIDTH[1] * four}
    assert follower["sizes"] == {"b": WIDTH[1] * four}  # the drop reached its store
