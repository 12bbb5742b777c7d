"""`sneppx ls | gc`: look after a checkpoint root (a local directory or `s3://bucket/prefix`).

`ls` lists every step-like thing under the root (committed steps, steps a restore abandoned, saves in flight or
left by a crash, steps set aside) and says which step `latest()` picks and why: committed steps are checked
newest first, every byte, until one validates, exactly as `latest()` checks them; older ones get the quick
check (manifest, marker and shard sizes, no shard read) unless `--full`; `--quick` reads no shard at all. A
step a trainer restored and has not saved after (the root's ROLLBACK record) is named (`rollback` in --json).
`gc` asks the coordinator's own retention rule what it would delete (never the newest valid step, never the chain
of a step a trainer restored and has not saved after: the root's ROLLBACK record) and deletes it only with
`--apply`.

Exit codes: ls 0 when every committed step checked is valid, 1 when one is not; gc 0 when the plan was made
(and applied, with --apply); both 2 when the root can't be read or a key is bad.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from SneppX_ALG import errors, storage
from SneppX_ALG.checkpoint import signing, validate
from SneppX_ALG.cli import output
from SneppX_ALG.coordinator import CheckpointCoordinator, timeline

_NOTES = {"uncommitted": "no commit point: a save in flight, or left by a crash (a writer's cleanup removes it "
                         "once its writer is gone)",
          "set-aside": "moved out of the steps (kept for inspection; retention removes the oldest)",
          "deleting": "being deleted"}


def add_cli_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("ls", help="the steps of a checkpoint root: valid?, size, age, signer, and which "
                                         "one latest() picks")
    p.add_argument("root", metavar="ROOT", help="a local directory or s3://bucket/prefix")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--full", action="store_true", help="read every byte of every committed step")
    depth.add_argument("--quick", action="store_true", help="read no shard (latest() is then a guess)")
    p.add_argument("--trusted-key", action="append", metavar="PEM",
                   help="check signatures against this public key, as CheckpointCoordinator(trusted_keys=) does")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = subparsers.add_parser("gc", help="what retention would delete from a root (a dry run unless --apply)")
    p.add_argument("root", metavar="ROOT", help="a local directory or s3://bucket/prefix")
    p.add_argument("--keep", type=int, required=True, metavar="N", help="newest committed steps to keep")
    p.add_argument("--keep-every", type=int, metavar="M", help="also keep every step divisible by M")
    p.add_argument("--trusted-key", action="append", metavar="PEM",
                   help="a step is valid only when signed by one of these keys")
    p.add_argument("--apply", action="store_true", help="delete (without it, nothing is changed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_gc)


def _open(command: str, args: argparse.Namespace, *, read_only: bool = True) -> CheckpointCoordinator | None:
    try:
        keys = signing.trusted_key_set(args.trusted_key) if args.trusted_key else None
        return CheckpointCoordinator(args.root, read_only=read_only, cleanup_on_start=False if not read_only
                                     else None, trusted_keys=keys, device="cpu")
    except (errors.SneppXError, OSError, ValueError) as e:
        output.fail(command, e)
        return None


# ---- ls -------------------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    coord = _open("ls", args)
    if coord is None:
        return output.TROUBLE
    try:
        with coord:
            listing = list_root(coord, full=args.full, quick=args.quick, trusted=bool(args.trusted_key),
                                show_progress=not args.json)
    except (errors.SneppXError, OSError) as e:
        output.fail("ls", e)
        return output.TROUBLE
    if args.json:
        print(json.dumps(listing, indent=2))
    else:
        _print_ls(listing)
    bad = [r for r in listing["steps"] if r["state"] == "committed" and r["valid"] is False]
    return output.INVALID if bad else output.OK


def list_root(coord: CheckpointCoordinator, *, full: bool = False, quick: bool = False, trusted: bool = False,
              show_progress: bool = False) -> dict[str, Any]:
    """What `sneppx ls` shows, as data: {"root", "latest", "why", "steps": [one row per entry, newest first]}."""
    store = coord.storage
    entries = store.inventory()
    visible = set(coord.committed_steps())
    fence = _stored_fence(store, timeline.FENCE_RECORD)
    rollback, rollback_problem = None, None
    try:
        rollback = _stored_fence(store, timeline.ROLLBACK_RECORD)
    except errors.FenceRecordError as e:  # readers ignore the record, so the steps are listed; gc refuses on it
        rollback_problem = str(e)
    present = {e.step for e in entries if e.state == "committed"}
    rows = {e.name: _row(store, e, visible, fence, present) for e in entries}
    for row in rows.values():
        if rollback is not None and row["state"] == "committed" and row["step"] == rollback.restored:
            row["note"] = ("a trainer restored it and has not saved since (ROLLBACK): gc keeps it and the steps "
                           "it uses")
    committed = sorted((r for r in rows.values() if r["state"] == "committed"), key=lambda r: -r["step"])
    to_read = [] if quick else committed if full else None
    total = sum(r["bytes"] for r in (to_read if to_read is not None else committed[:1]))
    picked: int | None = None
    with output.progress_bar("checking steps", total, show_progress) as progress:
        done = 0
        for row in committed:
            if quick or (picked is not None and not full):
                break
            try:
                problems = coord.validate(row["step"])  # latest()'s check: every byte, and trusted keys' signatures
            except errors.CheckpointNotFoundError:
                row.update(state="deleting", note="deleted while it was listed")
                continue
            row.update(check="full", valid=not problems, problems=problems)
            if not problems and picked is None:
                picked = row["step"]
            done += row["bytes"]
            if progress is not None:
                progress(done, max(total, done))
    for row in committed:
        if row["check"] is None:
            row.update(check="quick", valid=not row["quick_problems"], problems=row["quick_problems"])
    if quick:
        picked = next((r["step"] for r in committed if r["valid"]), None)
    for row in rows.values():
        row.pop("quick_problems", None)
        row["latest"] = row["state"] == "committed" and row["step"] == picked
        if row["valid"] is not None and row["check"] == "full" and row["signed"]:
            row["signer_trusted"] = bool(row["valid"]) if trusted else None
    return {"root": coord.checkpoint_root, "latest": picked, "why": _why(picked, committed, quick),
            "rollback": rollback.restored if rollback is not None else None, "rollback_problem": rollback_problem,
            "steps": sorted(rows.values(), key=lambda r: (-r["step"], r["name"]))}


def _stored_fence(store: storage.Storage, record: str) -> timeline.Fence | None:
    """The FENCE or ROLLBACK record at the root (coordinator/timeline.py), or None."""
    raw = store.read_root_file(record)
    return timeline.decode_fence(raw, where=f"{store.uri}/{record}") if raw is not None else None


def _row(store: storage.Storage, entry: storage.Entry, visible: set[int], fence: timeline.Fence | None,
         present: set[int]) -> dict[str, Any]:
    """One entry, from its listing and small files (manifest, signature, marker): nothing else is read. An
    incremental step whose referenced steps are not all `present` (committed) is already known to be invalid."""
    state, note = entry.state, _NOTES.get(entry.state, "")
    manifest_raw = signature = marker = None
    unreadable: list[str] = []

    def small(leaf: str) -> bytes | None:
        try:
            return store.read_entry_file(entry.name, leaf)
        except errors.CheckpointFormatError as e:  # a FIFO, a link, a directory where the file should be
            unreadable.append(f"{leaf}: {e}")
            return None

    if state in ("committed", "set-aside"):
        manifest_raw, signature = small(storage.MANIFEST), small(storage.SIGNATURE)
    if state == "committed":
        marker = small(storage.COMMITTED)
        if entry.step not in visible:
            state = "abandoned"
            restored = f" to step {fence.restored}" if fence is not None else ""
            note = f"fenced off by a restore{restored}: latest() never returns it; set aside before the next save"
    manifest, quick_problems = validate.quick_check_step(entry.step, manifest_raw, entry.files, marker) \
        if manifest_raw is not None or state == "committed" else (None, [])
    quick_problems = [*unreadable, *quick_problems]
    gone = [used for used in (manifest or {}).get("uses") or [] if used not in present]
    if gone and state == "committed":
        quick_problems = [*quick_problems, f"step {entry.step} references step(s) {gone}, which are not committed"]
    signers = _signers(signature)
    # An incremental step's files hold only what changed: `bytes` is what it stores, `logical_bytes` its tensors',
    # and `uses` the earlier steps holding the rest (kept while it is).
    logical = sum(t.get("nbytes", 0) for t in (manifest or {}).get("tensors", [])) if manifest else None
    return {"name": entry.name, "step": entry.step, "state": state, "bytes": sum(entry.files.values()),
            "logical_bytes": logical, "uses": list((manifest or {}).get("uses") or []),
            "created": (manifest or {}).get("created"), "age": output.age((manifest or {}).get("created")),
            "signed": bool(signers), "signers": signers, "signer_trusted": None, "check": None, "valid": None,
            "problems": [], "quick_problems": quick_problems, "latest": False, "note": note}


def _signers(signature: bytes | None) -> list[str]:
    """Key ids (hex) a manifest.sig names, unverified; ["unreadable"] for a block that doesn't decode."""
    if not signature:
        return []
    try:
        return [entry.key_id.hex() for entry in signing.decode_block(signature)]
    except errors.SignatureError:
        return ["unreadable"]


def _why(picked: int | None, committed: list[dict[str, Any]], quick: bool) -> str:
    if not committed:
        return "latest() finds nothing: there is no committed step on the current timeline"
    skipped = [r for r in committed if r["valid"] is False and (picked is None or r["step"] > picked)]
    passed = "; ".join(f"step {r['step']} skipped: {r['problems'][0]}" for r in skipped)
    if picked is None:
        return f"latest() finds nothing: none of the {len(committed)} committed steps validates ({passed})"
    if quick:
        why = f"latest() would pick step {picked} if its bytes check out (--quick read none of them)"
    else:
        why = (f"latest() picks step {picked}: the newest committed step on the current timeline that "
               "validates (every byte read)")
    return f"{why}; {passed}" if passed else why


def _print_ls(listing: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("step", "state", "check", "valid", "size", "logical", "uses", "age", "signer", "note",
                  title=listing["root"], title_justify="left")
    for r in listing["steps"]:
        valid = "-" if r["valid"] is None else "yes" if r["valid"] else "NO"
        signer = ", ".join(s[:16] for s in r["signers"]) or "-"
        if r["signer_trusted"] is not None:
            signer += " (trusted)" if r["signer_trusted"] else " (NOT trusted)"
        note = r["note"] or (r["problems"][0] if r["problems"] else "")
        if r["latest"]:
            note = "<- latest()" + (f"; {note}" if note else "")
        step = str(r["step"]) if r["state"] == "committed" else r["name"]
        logical = output.human(r["logical_bytes"]) if r["logical_bytes"] is not None else "-"
        uses = ", ".join(map(str, r["uses"])) or "-"
        table.add_row(step, r["state"], r["check"] or "-", valid, output.human(r["bytes"]), logical, uses, r["age"],
                      signer, note)
    console = Console(width=max(Console().width, 140))
    console.print(table)
    console.print(listing["why"])
    if listing["rollback_problem"]:
        console.print(f"the ROLLBACK record is damaged (gc refuses until it is removed): {listing['rollback_problem']}")


# ---- gc -------------------------------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace) -> int:
    if args.keep < 1 or (args.keep_every is not None and args.keep_every < 1):
        print("sneppx gc: --keep and --keep-every must be at least 1", file=sys.stderr)
        return output.TROUBLE
    coord = _open("gc", args, read_only=not args.apply)
    if coord is None:
        return output.TROUBLE
    try:
        with coord:
            plan = coord.retention_plan(max_to_keep=args.keep, keep_every_n_steps=args.keep_every)
            if args.apply:
                coord.apply_retention(plan)
    except (errors.SneppXError, OSError) as e:
        output.fail("gc", e)
        return output.TROUBLE
    report = {"root": args.root, "applied": args.apply, "keep": plan.keep, "delete": plan.delete,
              "remove_set_aside": plan.remove_set_aside, "newest_valid": plan.protected, "pinned": plan.pinned,
              "restored": plan.restored, "invalid": {str(step): problems for step, problems in plan.invalid.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return output.OK
    verb = "deleted" if args.apply else "would delete"
    print(f"{args.root}: keeping {len(plan.keep)} step(s) {plan.keep}")
    if plan.protected is not None:
        print(f"  step {plan.protected} is the newest valid step: never deleted")
    elif plan.delete:
        print("  no committed step validates: none is kept as the newest valid one")
    if plan.restored is not None:
        print(f"  step {plan.restored} is kept: a trainer restored it and has not saved since (the root's "
              "ROLLBACK record); its next save continues that step's chain")
    for step in plan.pinned:
        print(f"  step {step} is kept: a kept step references its files (incremental)")
    for step in plan.delete:
        print(f"  {verb} step {step}")
    for name in plan.remove_set_aside:
        print(f"  {verb} set-aside {name}")
    if not plan.delete and not plan.remove_set_aside:
        print("  nothing to delete")
    elif not args.apply:
        print("dry run: nothing was changed (add --apply to delete)")
    return output.OK
