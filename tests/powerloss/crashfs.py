"""The states a power cut may leave a directory in, rebuilt from a recorded op log (oplog.py), and the sweep.

Why: a SIGKILL keeps the page cache, so a kill test can't tell a commit that fsyncs its directory from one that
doesn't. Here every crash point of a recorded save is turned into the on-disk states the persistence model
allows, each is written into a fresh directory, and a check (a fresh coordinator restoring) runs on it. In the
spirit of ALICE (Pillai et al., OSDI'14) and SQLite's crash-test VFS.

Persistence model (what POSIX and Linux promise, no more; docs/TESTING.md, "Power loss"):

* The tree before the log is durable.
* A data op on a file (write, ftruncate, fallocate, open with O_TRUNC) is durable once an fsync or fdatasync
  of that file (through any fd) has returned after it.
* An entry op on a directory (a name created, linked, unlinked, renamed; mkdir, rmdir) is durable once an
  fsync of that directory has returned after it. A rename is one op on two directories, durable once both are
  fsynced after it, and otherwise kept or lost whole.
* sync and syncfs make everything durable; sync_file_range makes nothing durable.
* An op that is not durable may be kept or lost independently of every other op: a rename kept while the data
  of the renamed file is lost, a file's entry kept in a directory whose own entry is lost (the directory is
  then unreachable, with everything in it). A write that is not durable may also be kept as zeros (its size
  persisted, its data not) or torn (its first half, in whole 4 KiB blocks, persisted and the rest lost; with
  every_tear, each block boundary inside the write is a place it may tear).
* Inodes are tracked by identity, not by name: fsync through an fd reaches the file it was opened on, whatever
  its name is now.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import pathlib
import random
import shutil
from collections.abc import Callable, Iterator, Mapping

import oplog

Tree = dict[str, bytes | None]  # path relative to the root -> file contents, or None for a directory
Inodes = dict[int, "bytes | dict[str, int]"]  # file contents, or a directory's entries (name -> inode)
History = tuple[tuple[int, str], ...]  # the data effects kept on a file, in order: (position in effects, outcome)

ROOT = 0
NEVER = 1 << 62
BLOCK = 4096
TORN = "torn at "  # an outcome "torn at N": the write's first N bytes persisted, the rest lost


@dataclasses.dataclass(frozen=True)
class CrashState:
    """One state a crash may leave, by name: its directories, and each file as (path, inode, history)."""

    dirs: tuple[str, ...]
    files: tuple[tuple[str, int, History], ...]


@dataclasses.dataclass
class Effect:
    """What one op does to the tree, and when it becomes durable.

    kind "data": `action` on file `inode`: ("write", offset, bytes), ("size", n) (truncate or extend to n), or
    ("grow", n) (extend to at least n). kind "entries": every (directory, name, inode or None) in `entries`
    is set (None: removed), all or nothing."""

    op: oplog.Op
    label: str
    kind: str
    syncs_on: frozenset[int]
    inode: int = -1
    action: tuple[object, ...] = ()
    entries: tuple[tuple[int, str, int | None], ...] = ()
    tears: tuple[int, ...] = ()  # a write: where it may tear (bytes kept)
    durable_after: int = NEVER  # index of the barrier op that made it durable

    def outcomes(self) -> tuple[str, ...]:
        """What a crash state may do with this op when it is not durable: "lost", "kept", and for a write
        also "zeros" and "torn at N"."""
        if self.kind == "data" and self.action[0] == "write":
            return ("lost", "kept", "zeros", *(f"{TORN}{n}" for n in self.tears))
        return ("lost", "kept")


def tears(length: int, every: bool) -> tuple[int, ...]:
    """Where a write of `length` bytes may tear: after its first half in whole blocks, or (every) after each
    whole block inside it."""
    if every:
        return tuple(range(BLOCK, length, BLOCK))
    half = length // 2 // BLOCK * BLOCK
    return (half,) if half else ()


# ---- trees on disk ----------------------------------------------------------------------------------------


def read_tree(root: str | os.PathLike[str]) -> Tree:
    """Everything under `root` (which must hold only directories and regular files)."""
    tree: Tree = {}
    base = os.fspath(root)
    for directory, dirs, files in os.walk(base):
        relative = os.path.relpath(directory, base)
        prefix = "" if relative == "." else relative + "/"
        for name in dirs:
            assert not os.path.islink(os.path.join(directory, name)), f"a symlink in the tree: {prefix}{name}"
            tree[prefix + name] = None
        for name in files:
            path = os.path.join(directory, name)
            assert os.path.isfile(path) and not os.path.islink(path), f"not a regular file: {prefix}{name}"
            with open(path, "rb") as f:
                tree[prefix + name] = f.read()
    return tree


def write_tree(tree: Tree, dest: pathlib.Path) -> None:
    dest.mkdir(parents=True)
    for path, contents in sorted(tree.items()):
        if contents is None:
            (dest / path).mkdir()
        else:
            (dest / path).write_bytes(contents)


def describe_tree(tree: Tree) -> str:
    return "\n".join(f"    {path}/" if contents is None else f"    {path} ({len(contents)} B)"
                     for path, contents in sorted(tree.items())) or "    (empty)"


# ---- replay -----------------------------------------------------------------------------------------------


class Replay:
    """The op log replayed on the model: every op's effect, and for each effect the barrier that made it durable.

    Raises oplog.RecordingError when the log can't be followed (a path the model doesn't have, an unknown fd):
    the recording missed something."""

    def __init__(self, initial: Tree, ops: list[oplog.Op], *, every_tear: bool = False):
        self.ops = ops
        self.every_tear = every_tear
        self.kinds: dict[int, str] = {ROOT: "dir"}
        self.initial: Inodes = {ROOT: {}}
        for path, contents in sorted(initial.items()):
            parent, name = self._parent(self.initial, path)
            inode = self._new_inode("dir" if contents is None else "file")
            self.initial[inode] = {} if contents is None else contents
            _entries(self.initial, parent)[name] = inode
        self.volatile: Inodes = _copy(self.initial)
        self.effects: list[Effect] = []
        self.labels: list[str] = []  # one per op, for messages
        self.barriers: list[tuple[int, frozenset[int] | None]] = []  # (op index, inodes made durable; None: all)
        self.direct_writes = self.buffered_writes = 0
        self._contents: dict[tuple[int, History], bytes] = {}
        self._fds: dict[int, int] = {}
        self._direct: set[int] = set()
        for op in ops:
            try:
                self.labels.append(self._replay(op))
            except (KeyError, ValueError, AssertionError) as e:
                what = f"{op.kind} {op.path or f'fd {op.fd}'}"
                raise oplog.RecordingError(f"op {op.index} ({what}) can't be replayed: {e!r}") from None
        for effect in self.effects:
            effect.durable_after = self._durable_after(effect)

    # -- the ops --

    def _new_inode(self, kind: str) -> int:
        inode = len(self.kinds)
        self.kinds[inode] = kind
        return inode

    def _parent(self, inodes: Inodes, path: str) -> tuple[int, str]:
        parts = path.split("/")
        directory = ROOT
        for part in parts[:-1]:
            directory = _entries(inodes, directory)[part]
        return directory, parts[-1]

    def _lookup(self, path: str) -> int | None:
        if path == "":
            return ROOT
        parent, name = self._parent(self.volatile, path)
        return _entries(self.volatile, parent).get(name)

    def path_of(self, inode: int) -> str:
        """The inode's name in the volatile tree now ("<gone>" when it has none)."""
        if inode == ROOT:
            return "(the root)"
        stack: list[tuple[int, str]] = [(ROOT, "")]
        while stack:
            directory, prefix = stack.pop()
            for name, child in _entries(self.volatile, directory).items():
                if child == inode:
                    return prefix + name
                if self.kinds[child] == "dir":
                    stack.append((child, prefix + name + "/"))
        return "<gone>"

    def _add(self, effect: Effect) -> str:
        self.effects.append(effect)
        _apply(self.volatile, self.kinds, effect)
        return effect.label

    def _data(self, op: oplog.Op, inode: int, action: tuple[object, ...], label: str,
              tears: tuple[int, ...] = ()) -> str:
        assert self.kinds[inode] == "file", f"a data op on directory {self.path_of(inode)}"
        return self._add(Effect(op, label, "data", frozenset({inode}), inode=inode, action=action, tears=tears))

    def _names(self, op: oplog.Op, label: str, *entries: tuple[int, str, int | None]) -> str:
        return self._add(Effect(op, label, "entries", frozenset(d for d, _, _ in entries), entries=entries))

    def _replay(self, op: oplog.Op) -> str:
        match op.kind:
            case "open":
                inode = self._lookup(op.path)
                label = f"open {op.path or '.'} as fd {op.fd}"
                if inode is None:
                    assert op.flags & os.O_CREAT, f"{op.path} does not exist"
                    inode = self._new_inode("file")
                    parent, name = self._parent(self.volatile, op.path)
                    label = self._names(op, f"create {op.path}", (parent, name, inode))
                elif op.flags & os.O_TRUNC and op.flags & (os.O_WRONLY | os.O_RDWR):
                    label = self._data(op, inode, ("size", 0), f"open {op.path} with O_TRUNC")
                self._fds[op.fd] = inode
                self._direct.discard(op.fd)
                if op.flags & os.O_DIRECT:
                    self._direct.add(op.fd)
                return label
            case "close":
                del self._fds[op.fd]
                self._direct.discard(op.fd)
                return f"close fd {op.fd}"
            case "dup":
                self._fds[op.fd2] = self._fds[op.fd]
                return f"dup fd {op.fd} as {op.fd2}"
            case "setfl":
                inode = self._fds[op.fd]
                if op.flags & os.O_DIRECT:
                    self._direct.add(op.fd)
                else:
                    self._direct.discard(op.fd)
                return f"fcntl F_SETFL {self.path_of(inode)}{' O_DIRECT' if op.flags & os.O_DIRECT else ''}"
            case "write":
                inode = self._fds[op.fd]
                direct = op.fd in self._direct
                self.direct_writes += direct
                self.buffered_writes += not direct
                how = "O_DIRECT" if direct else "buffered"
                return self._data(op, inode, ("write", op.offset, op.data),
                                  f"write {len(op.data)} B at {op.offset} ({how}) to {self.path_of(inode)}",
                                  tears(len(op.data), self.every_tear))
            case "trunc" | "truncpath":
                inode = self._fds[op.fd] if op.kind == "trunc" else self._lookup(op.path)
                assert inode is not None, f"{op.path} does not exist"
                return self._data(op, inode, ("size", op.length), f"truncate {self.path_of(inode)} to {op.length} B")
            case "falloc":
                inode = self._fds[op.fd]
                if op.flags:  # FALLOC_FL_KEEP_SIZE (the shim refuses other modes): nothing visible changes
                    return f"fallocate {self.path_of(inode)}, keeping its size"
                end = op.offset + op.length
                return self._data(op, inode, ("grow", end), f"fallocate {self.path_of(inode)} to {end} B")
            case "fsync" | "fdatasync":
                inode = self._fds[op.fd]
                self.barriers.append((op.index, frozenset({inode})))
                return f"{op.kind} {self.path_of(inode)}{'/' if self.kinds[inode] == 'dir' and inode else ''}"
            case "sync" | "syncfs":
                self.barriers.append((op.index, None))
                return op.kind
            case "mark":
                return f"mark: {op.path}"
            case "syncrange":
                return f"sync_file_range {self.path_of(self._fds[op.fd])} (not a durability barrier)"
            case "mkdir":
                inode = self._new_inode("dir")
                parent, name = self._parent(self.volatile, op.path)
                assert name not in _entries(self.volatile, parent), f"{op.path} exists"
                return self._names(op, f"mkdir {op.path}", (parent, name, inode))
            case "unlink" | "rmdir":
                parent, name = self._parent(self.volatile, op.path)
                inode = _entries(self.volatile, parent)[name]
                assert self.kinds[inode] == ("dir" if op.kind == "rmdir" else "file"), f"{op.kind} of {op.path}"
                assert op.kind == "unlink" or not _entries(self.volatile, inode), f"rmdir of non-empty {op.path}"
                return self._names(op, f"{op.kind} {op.path}", (parent, name, None))
            case "rename" | "link":
                source_dir, source_name = self._parent(self.volatile, op.path)
                inode = _entries(self.volatile, source_dir)[source_name]
                target_dir, target_name = self._parent(self.volatile, op.path2)
                if op.kind == "link":
                    return self._names(op, f"link {op.path} as {op.path2}", (target_dir, target_name, inode))
                return self._names(op, f"rename {op.path} -> {op.path2}", (source_dir, source_name, None),
                                   (target_dir, target_name, inode))
        raise AssertionError(f"unknown op kind {op.kind}")

    def _durable_after(self, effect: Effect) -> int:
        """The index of the barrier after which the effect is durable (NEVER if none is)."""
        when = []
        for inode in effect.syncs_on:
            later = [i for i, covers in self.barriers if i > effect.op.index and (covers is None or inode in covers)]
            when.append(min(later, default=NEVER))
        return max(when)

    # -- crash states --

    def split(self, crash_point: int) -> tuple[list[int], list[int]]:
        """The effects of the ops before `crash_point` (an op index: that op and the later ones never ran), as
        (durable, not durable) lists of positions in self.effects."""
        done = [i for i, e in enumerate(self.effects) if e.op.index < crash_point]
        durable = [i for i in done if self.effects[i].durable_after < crash_point]
        return durable, [i for i in done if self.effects[i].durable_after >= crash_point]

    def crash_state(self, crash_point: int, outcomes: Mapping[int, str]) -> CrashState:
        """The state after a crash at `crash_point`, with each effect that is not durable handled as `outcomes`
        says (by position in self.effects; missing: lost). Names only: no file's bytes are built yet."""
        directories = {i: dict(v) for i, v in self.initial.items() if isinstance(v, dict)}
        histories: dict[int, list[tuple[int, str]]] = {}
        durable, unsynced = self.split(crash_point)
        durable_set = set(durable)
        for i in sorted(durable + unsynced):
            outcome = "kept" if i in durable_set else outcomes.get(i, "lost")
            effect = self.effects[i]
            if outcome == "lost":
                continue
            if effect.kind == "entries":
                _apply_entries(directories, effect)
            else:
                histories.setdefault(effect.inode, []).append((i, outcome))
        dirs, files = [], []
        stack: list[tuple[int, str]] = [(ROOT, "")]
        while stack:
            directory, prefix = stack.pop()
            for name, inode in directories.get(directory, {}).items():
                if self.kinds[inode] == "dir":
                    dirs.append(prefix + name)
                    stack.append((inode, prefix + name + "/"))
                else:
                    files.append((prefix + name, inode, tuple(histories.get(inode, ()))))
        return CrashState(tuple(sorted(dirs)), tuple(sorted(files)))

    def contents(self, inode: int, history: History) -> bytes:
        """A file's bytes in a crash state: its bytes before the log, then its data effects in `history`."""
        key = (inode, history)
        if key not in self._contents:
            initial = self.initial.get(inode, b"")
            assert isinstance(initial, bytes)
            data = bytearray(initial)
            for i, outcome in history:
                _apply_data(data, self.effects[i].action, outcome)
            if len(self._contents) >= 32:  # a few recent files (a shard can be megabytes): states come in runs
                self._contents.pop(next(iter(self._contents)))
            self._contents[key] = bytes(data)
        return self._contents[key]

    def tree(self, state: CrashState) -> Tree:
        tree: Tree = dict.fromkeys(state.dirs)
        for path, inode, history in state.files:
            tree[path] = self.contents(inode, history)
        return tree

    def state(self, crash_point: int, outcomes: Mapping[int, str]) -> Tree:
        return self.tree(self.crash_state(crash_point, outcomes))

    def marks_before(self, crash_point: int) -> tuple[str, ...]:
        """What the recorded process announced (oplog.mark) before the crash point."""
        return tuple(op.path for op in self.ops[:crash_point] if op.kind == "mark")

    def final(self) -> Tree:
        """The tree after every op, all kept: what the directory held when the process exited."""
        return _visible(self.volatile, self.kinds)


def _entries(inodes: Inodes, directory: int) -> dict[str, int]:
    entries = inodes[directory]
    assert isinstance(entries, dict), f"inode {directory} is not a directory"
    return entries


def _copy(inodes: Inodes) -> Inodes:
    return {i: dict(v) if isinstance(v, dict) else v for i, v in inodes.items()}


def _apply(inodes: Inodes, kinds: Mapping[int, str], effect: Effect) -> None:
    """Applies one effect, kept, to the volatile tree (where every directory it names exists)."""
    if effect.kind == "entries":
        for directory, name, inode in effect.entries:
            entries = _entries(inodes, directory)
            if inode is None:
                del entries[name]
            else:
                entries[name] = inode
                inodes.setdefault(inode, {} if kinds[inode] == "dir" else b"")
        return
    contents = inodes.get(effect.inode, b"")
    assert isinstance(contents, bytes)
    data = bytearray(contents)
    _apply_data(data, effect.action, "kept")
    inodes[effect.inode] = bytes(data)


def _apply_entries(directories: dict[int, dict[str, int]], effect: Effect) -> None:
    """Sets (or removes) the names of one entries effect. A directory whose mkdir was lost comes into being
    empty when an effect names something in it: it is unreachable unless a kept effect names it too."""
    for directory, name, inode in effect.entries:
        entries = directories.setdefault(directory, {})
        if inode is None:
            entries.pop(name, None)
        else:
            entries[name] = inode


def _apply_data(data: bytearray, action: tuple[object, ...], outcome: str) -> None:
    """Applies one data action to a file's bytes as `outcome` ("kept", "zeros" or "torn at N")."""
    match action:
        case ("write", int(offset), bytes(written)):
            if outcome == "zeros":
                written = bytes(len(written))
            elif outcome.startswith(TORN):
                written = written[:int(outcome[len(TORN):])]
            if len(data) < offset:
                data.extend(bytes(offset - len(data)))
            data[offset:offset + len(written)] = written
        case ("size", int(size)):
            del data[size:]
            data.extend(bytes(size - len(data)))
        case ("grow", int(size)):
            data.extend(bytes(max(0, size - len(data))))
        case _:
            raise AssertionError(f"unknown data action {action[0]}")


def _visible(inodes: Inodes, kinds: Mapping[int, str]) -> Tree:
    tree: Tree = {}
    stack: list[tuple[int, str]] = [(ROOT, "")]
    while stack:
        directory, prefix = stack.pop()
        for name, inode in _entries(inodes, directory).items():
            if kinds[inode] == "dir":
                tree[prefix + name] = None
                stack.append((inode, prefix + name + "/"))
            else:
                contents = inodes[inode]
                assert isinstance(contents, bytes)
                tree[prefix + name] = contents
    return tree


# ---- which crash states to try ----------------------------------------------------------------------------


def combinations(replay: Replay, unsynced: list[int]) -> int:
    """How many crash states the model allows at a crash point with these effects not durable."""
    return math.prod(len(replay.effects[i].outcomes()) for i in unsynced)


def every_state(replay: Replay, unsynced: list[int]) -> Iterator[tuple[str, dict[int, str]]]:
    """Every crash state the model allows: each effect that is not durable in each of its outcomes, on its own."""
    total = combinations(replay, unsynced)
    for n, chosen in enumerate(itertools.product(*(replay.effects[i].outcomes() for i in unsynced))):
        yield f"combination {n + 1} of {total}", dict(zip(unsynced, chosen, strict=True))


def bounded_states(replay: Replay, unsynced: list[int], *, wide: bool, rng: random.Random
                   ) -> Iterator[tuple[str, dict[int, str]]]:
    """A bounded choice of crash states, for crash points with too many to try (ALICE's heuristics).

    Always: nothing persisted; everything persisted (what a killed process leaves); each op alone persisted,
    and each op alone lost, in each of its outcomes (a write also as zeros and torn). Wide: also every pair
    persisted alone and lost alone, and 256 random states (each op's outcome drawn at random)."""
    yield "nothing that was not durable persisted", {}
    everything = {i: "kept" for i in unsynced}
    yield "everything persisted", everything
    for i in unsynced:
        for outcome in replay.effects[i].outcomes():
            if outcome != "lost":
                yield f"only #{i} persisted ({outcome})", {i: outcome}
            if outcome != "kept":
                yield f"everything persisted but #{i} ({outcome})", {**everything, i: outcome}
    if not wide:
        return
    for i, j in itertools.combinations(unsynced, 2):
        yield f"only #{i} and #{j} persisted", {i: "kept", j: "kept"}
        yield f"everything persisted but #{i} and #{j}", {**everything, i: "lost", j: "lost"}
    for n in range(256):
        yield f"random state {n + 1}", {i: rng.choice(replay.effects[i].outcomes()) for i in unsynced}


# ---- the sweep --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Finding:
    """A crash state the check refused."""

    crash_point: int
    variant: str
    outcomes: dict[int, str]
    unsynced: list[int]
    problem: str
    state: CrashState


@dataclasses.dataclass
class SweepResult:
    replay: Replay
    crash_points: int = 0
    exhaustive_points: int = 0  # crash points where every state the model allows was checked
    states: int = 0
    distinct: int = 0
    findings: list[Finding] = dataclasses.field(default_factory=list)

    def describe(self, finding: Finding) -> str:
        effects = self.replay.effects
        point = finding.crash_point
        last = f"op {point - 1}: {self.replay.labels[point - 1]}" if point else "before the first op"
        lines = [f"crash after {last} (ops 0..{point - 1} done, op {point} and later never ran)",
                 f"  state: {finding.variant}"]
        for i in finding.unsynced:
            outcome = finding.outcomes.get(i, "lost")
            lines.append(f"    {'persisted' if outcome == 'kept' else outcome:>9}  #{i} op {effects[i].op.index}: "
                         f"{effects[i].label}")
        lines.append(f"  restore found: {finding.problem}")
        lines.append("  the state's tree:\n" + describe_tree(self.replay.tree(finding.state)))
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"{self.states} crash states ({self.distinct} distinct) at {self.crash_points} crash points "
                f"({self.exhaustive_points} of them exhaustively)")

    def message(self, limit: int = 3) -> str:
        head = f"{len(self.findings)} of {self.summary()} break the guarantee; the first {limit} problems:"
        shown: dict[tuple[int, str], Finding] = {}
        for finding in self.findings:  # different crash points or problems first, then the rest in order
            shown.setdefault((finding.crash_point, finding.problem), finding)
        firsts = list(shown.values()) + [f for f in self.findings if f not in shown.values()]
        return "\n\n".join([head] + [self.describe(f) for f in firsts[:limit]])


Check = Callable[[pathlib.Path, tuple[str, ...]], "str | None"]


def sweep(replay: Replay, check: Check, workdir: pathlib.Path, *, exhaustive_up_to: int = 4096,
          wide: bool = False, seed: int = 0) -> SweepResult:
    """Runs `check` on the crash states of every crash point: all of them where the model allows at most
    `exhaustive_up_to`, else bounded_states(). `check` gets a directory holding the state (its own copy: it
    may change it) and the marks logged before the crash point, and returns None, or what is wrong. Each
    distinct (tree, marks) is checked once."""
    result = SweepResult(replay)
    verdicts: dict[tuple[CrashState, tuple[str, ...]], str | None] = {}
    rng = random.Random(seed)
    seen_splits: set[tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]] = set()
    for point in range(len(replay.ops) + 1):
        durable, unsynced = replay.split(point)
        marks = replay.marks_before(point)
        split = (tuple(durable), tuple(unsynced), marks)
        if split in seen_splits:
            continue  # the op before this point changed nothing the model tracks: same states as the last point
        seen_splits.add(split)
        result.crash_points += 1
        if combinations(replay, unsynced) <= exhaustive_up_to:
            result.exhaustive_points += 1
            states = every_state(replay, unsynced)
        else:
            states = bounded_states(replay, unsynced, wide=wide, rng=rng)
        for variant, outcomes in states:
            state = replay.crash_state(point, outcomes)
            result.states += 1
            key = (state, marks)
            if key not in verdicts:
                state_dir = workdir / f"state-{len(verdicts)}"
                write_tree(replay.tree(state), state_dir)
                try:
                    verdicts[key] = check(state_dir, marks)
                finally:
                    shutil.rmtree(state_dir, ignore_errors=True)
            problem = verdicts[key]
            if problem is not None:
                result.findings.append(Finding(point, variant, outcomes, unsynced, problem, state))
    result.distinct = len(verdicts)
    return result
