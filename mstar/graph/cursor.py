"""Where a request is in its walk: an immutable cursor and the pure functions that move it.

The cursor mirrors the walk's tree. A step is ``PENDING`` (ready to dispatch), ``RUNNING``
or ``DONE``; a Sequential remembers its current part, a Parallel the state of every
branch, a Loop its iteration. Every function returns a new cursor; nothing is mutated,
so the conductor can compute plans as pure functions of (state, events).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from mstar.graph.nodes import Step
from mstar.graph.walk import Loop, Parallel, Section, Sequential

PENDING = "pending"
RUNNING = "running"
DONE = "done"


@dataclass(frozen=True)
class LoopContext:
    """What a Loop consults at each iteration boundary."""

    flags: frozenset[str]
    params: Mapping[str, Any]

    def loop_exits(self, loop: Loop, iteration: int) -> bool:
        if loop.until is not None and loop.until in self.flags:
            return True
        limit = self.limit(loop)
        return limit is not None and iteration >= limit

    def limit(self, loop: Loop) -> int | None:
        """The loop's ``max_iters`` for this request (a number, or a walk parameter's value)."""
        limit = loop.max_iters
        return int(self.params[limit]) if isinstance(limit, str) else limit


class ReadyStep(NamedTuple):
    """A step that can be dispatched (a tuple: one is made per request and tick, and a
    frozen dataclass takes half as long again to make)."""

    step: Step
    iteration: int  # iteration of the innermost enclosing Loop (0 outside loops)


def start(section: Section, ctx: LoopContext) -> Any:
    """The cursor of a section that is just entered (may already be DONE)."""
    if isinstance(section, Step):
        return PENDING
    if isinstance(section, Sequential):
        return _seq_from(section, 0, ctx)
    if isinstance(section, Parallel):
        return _par(tuple(start(b, ctx) for b in section.branches))
    if isinstance(section, Loop):
        return _loop_from(section, 0, ctx)
    raise TypeError(f"not a walk section: {section!r}")


def is_done(cursor: Any) -> bool:
    return cursor == DONE


def ready(section: Section, cursor: Any, iteration: int = 0) -> list[ReadyStep]:
    """The steps that can be dispatched now."""
    # ``ready`` and ``_update`` run for every request every tick: the kinds of section are
    # told apart by their exact type (no section type has subclasses), cheaper than isinstance,
    # and a Sequential's or Loop's one current part is walked down in a loop, not by a call
    # per level; only a Parallel recurses, into each branch.
    while cursor != DONE:
        kind = type(section)
        if kind is Step:
            return [ReadyStep(section, iteration)] if cursor == PENDING else []
        if kind is Sequential:
            _, index, cursor = cursor
            section = section.parts[index]
        elif kind is Loop:
            _, iteration, cursor = cursor
            section = section.body
        elif kind is Parallel:
            out: list[ReadyStep] = []
            for branch, child in zip(section.branches, cursor[1]):
                out += ready(branch, child, iteration)
            return out
        else:
            raise TypeError(f"not a walk section: {section!r}")
    return []


def has_progress(section: Section) -> bool:
    """Whether ``section`` holds a Loop that reports its progress."""
    if isinstance(section, Loop):
        return section.progress or has_progress(section.body)
    if isinstance(section, Sequential):
        return any(has_progress(part) for part in section.parts)
    if isinstance(section, Parallel):
        return any(has_progress(branch) for branch in section.branches)
    return False


def progress(section: Section, cursor: Any, ctx: LoopContext) -> tuple[int, int] | None:
    """``(iteration, limit)`` of the first Loop with ``progress`` that the cursor is inside
    (None when it is in none): the iterations it has finished and how many it may run."""
    if cursor in (DONE, PENDING, RUNNING) or isinstance(section, Step):
        return None
    if isinstance(section, Sequential):
        _, index, child = cursor
        return progress(section.parts[index], child, ctx)
    if isinstance(section, Parallel):
        return next((p for b, c in zip(section.branches, cursor[1]) if (p := progress(b, c, ctx))), None)
    if isinstance(section, Loop):
        _, it, child = cursor
        if section.progress:
            return it, ctx.limit(section) or 0
        return progress(section.body, child, ctx)
    raise TypeError(f"not a walk section: {section!r}")


def mark_running(section: Section, cursor: Any, step: Step) -> Any:
    return _update(section, cursor, step, PENDING, RUNNING, None)


def mark_pending(section: Section, cursor: Any, step: Step) -> Any:
    """The cursor with a running ``step`` ready again (its engine gave it back unrun)."""
    return _update(section, cursor, step, RUNNING, PENDING, None)


def complete(section: Section, cursor: Any, step: Step, ctx: LoopContext) -> Any:
    """The cursor after ``step`` finished; sequences and loops advance past it."""
    return _update(section, cursor, step, None, DONE, ctx)


def _update(section: Section, cursor: Any, step: Step, was: str | None, now: str,
            ctx: LoopContext | None) -> Any:
    """The cursor with ``step`` turned to state ``now`` if it is in state ``was`` (None: in
    any); with ``ctx``, a Sequential or Loop whose current part is done moves on."""
    # Down through the Sequential and Loop levels in a loop (as in ``ready``), noting each
    # level's cursor; then the new cursor is built back up through them.
    levels: list[tuple[Section, Any]] = []
    while cursor != DONE:
        kind = type(section)  # exact types, as in ``ready``
        if kind is Step:
            if section is step and (was is None or cursor == was):
                cursor = now
            break
        if kind is Sequential:
            levels.append((section, cursor))
            section, cursor = section.parts[cursor[1]], cursor[2]
        elif kind is Loop:
            levels.append((section, cursor))
            section, cursor = section.body, cursor[2]
        elif kind is Parallel:
            cursor = _par(tuple(_update(b, c, step, was, now, ctx) for b, c in zip(section.branches, cursor[1])))
            break
        else:
            raise TypeError(f"not a walk section: {section!r}")
    for section, outer in reversed(levels):
        tag, n, _ = outer
        if cursor == DONE and ctx is not None:
            cursor = _seq_from(section, n + 1, ctx) if tag == "seq" else _loop_from(section, n + 1, ctx)
        else:
            cursor = (tag, n, cursor)
    return cursor


def _seq_from(section: Sequential, index: int, ctx: LoopContext) -> Any:
    while index < len(section.parts):
        child = start(section.parts[index], ctx)
        if child != DONE:
            return ("seq", index, child)
        index += 1
    return DONE


def _par(children: tuple) -> Any:
    return DONE if all(c == DONE for c in children) else ("par", children)


def _loop_from(section: Loop, iteration: int, ctx: LoopContext) -> Any:
    if ctx.loop_exits(section, iteration):
        return DONE
    child = PENDING if type(section.body) is Step else start(section.body, ctx)
    if child == DONE:  # a body with nothing to do would spin forever
        return DONE
    return ("loop", iteration, child)
