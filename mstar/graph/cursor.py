"""Where a request is in its walk: an immutable cursor and the pure functions that move it.

The cursor mirrors the walk's tree. A step is ``PENDING`` (ready to dispatch), ``RUNNING``
or ``DONE``; a Sequential remembers its current part, a Parallel the state of every
branch, a Loop its iteration. Every function returns a new cursor; nothing is mutated,
so the conductor can compute plans as pure functions of (state, events).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class ReadyStep:
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
    # told apart by their exact type (no section type has subclasses), cheaper than isinstance.
    if cursor == DONE:
        return []
    kind = type(section)
    if kind is Step:
        return [ReadyStep(section, iteration)] if cursor == PENDING else []
    if kind is Sequential:
        _, index, child = cursor
        return ready(section.parts[index], child, iteration)
    if kind is Loop:
        _, it, child = cursor
        return ready(section.body, child, it)
    if kind is Parallel:
        out: list[ReadyStep] = []
        for branch, child in zip(section.branches, cursor[1]):
            out += ready(branch, child, iteration)
        return out
    raise TypeError(f"not a walk section: {section!r}")


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
    return _update(section, cursor, step, lambda state: RUNNING if state == PENDING else state, None)


def mark_pending(section: Section, cursor: Any, step: Step) -> Any:
    """The cursor with a running ``step`` ready again (its engine gave it back unrun)."""
    return _update(section, cursor, step, lambda state: PENDING if state == RUNNING else state, None)


def complete(section: Section, cursor: Any, step: Step, ctx: LoopContext) -> Any:
    """The cursor after ``step`` finished; sequences and loops advance past it."""
    return _update(section, cursor, step, lambda state: DONE, ctx)


def _update(section: Section, cursor: Any, step: Step, change, ctx: LoopContext | None) -> Any:
    if cursor == DONE:
        return cursor
    kind = type(section)  # exact types, as in ``ready``
    if kind is Step:
        return change(cursor) if section is step else cursor
    if kind is Sequential:
        _, index, child = cursor
        child = _update(section.parts[index], child, step, change, ctx)
        if child == DONE and ctx is not None:
            return _seq_from(section, index + 1, ctx)
        return ("seq", index, child)
    if kind is Loop:
        _, it, child = cursor
        child = _update(section.body, child, step, change, ctx)
        if child == DONE and ctx is not None:
            return _loop_from(section, it + 1, ctx)
        return ("loop", it, child)
    if kind is Parallel:
        children = tuple(_update(b, c, step, change, ctx) for b, c in zip(section.branches, cursor[1]))
        return _par(children)
    raise TypeError(f"not a walk section: {section!r}")


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
    child = start(section.body, ctx)
    if child == DONE:  # a body with nothing to do would spin forever
        return DONE
    return ("loop", iteration, child)
