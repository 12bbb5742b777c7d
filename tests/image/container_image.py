"""The project's image, built from the Dockerfile by build_image.sh and run the way a pod runs it.

There is no Docker or registry where the tests run, so the image is built with buildah on a stand-in for
python:3.11-slim-bookworm (see build_image.sh) into a throwaway storage, and its commands run with
`buildah run` (chroot isolation: the image's own files, environment and working directory, and the host's
network, so the test kube-apiserver on 127.0.0.1 is reachable).

buildah run has no read-only root option, so `Image.run_args` makes the view a pod with
readOnlyRootFilesystem gets: it starts as root only to remount the container's `/` read-only in its
private mount namespace, then becomes the user (the image's USER unless told otherwise) for good, with no
capabilities and no_new_privs. `/tmp` and `/workspace` are fresh tmpfs mounts, as emptyDir volumes are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD_SCRIPT = HERE / "build_image.sh"
SKIP_STATUS = 77  # build_image.sh: buildah/debootstrap can't be had here; the reason is on stderr
WRITABLE = ("/tmp", "/workspace")

# Runs in the container as root: make `/` read-only, then become UID:GID for good and exec the command.
# The mounts under / (tmpfs volumes, /proc, /dev, bind mounts) keep their own flags, as in a pod.
_READ_ONLY_ROOT = (
    'uid=$1 gid=$2; shift 2; mount -o remount,bind,ro / && exec setpriv --reuid="$uid" --regid="$gid" '
    '--groups="$gid" --inh-caps=-all --bounding-set=-all --no-new-privs env "$@"'
)


class Unavailable(Exception):
    """buildah or debootstrap can't be had here (not root, or no apt-get); the message says which."""


class BuildFailed(Exception):
    """build_image.sh failed; the message ends with its log."""


@dataclasses.dataclass(frozen=True)
class Image:
    name: str
    buildah_env: Mapping[str, str]  # the storage and the isolation buildah uses
    container: str = ""  # a working container of the image; no run writes to its root
    user: str = ""  # the image's USER, "UID:GID"
    layer_bytes: tuple[int, ...] = ()  # uncompressed, the base's first

    def buildah(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["buildah", *args],
            env={**os.environ, **self.buildah_env},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"buildah {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}"
            )
        return result

    def run_args(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        writable: Sequence[str] = WRITABLE,
        read_only: Mapping[str, pathlib.Path] | None = None,
    ) -> list[str]:
        """buildah's arguments to run argv on a read-only root: as `user` ("UID:GID", else the image's USER),
        with `env` added, a fresh tmpfs at each `writable` path and `read_only` bind mounts {inside: host}."""
        uid, _, gid = (user or self.user).partition(":")
        mounts = [f"type=tmpfs,destination={path}" for path in writable]
        mounts += [
            f"type=bind,source={host},destination={path},ro=true" for path, host in (read_only or {}).items()
        ]
        return [
            "run",
            "--user=0:0",
            "--cap-add=CAP_SYS_ADMIN",  # for the remount; setpriv drops every capability before argv runs
            *(f"--mount={mount}" for mount in mounts),
            self.container,
            "--",
            *("sh", "-c", _READ_ONLY_ROOT, "sh", uid, gid or uid),
            *(f"{key}={value}" for key, value in (env or {}).items()),
            *argv,
        ]

    def run(
        self, argv: Sequence[str], *, timeout: float = 600, **options
    ) -> subprocess.CompletedProcess[str]:
        """Run argv to its end as run_args says; its exit status is the result's, never raised."""
        return self.buildah(*self.run_args(argv, **options), timeout=timeout, check=False)

    def start(self, argv: Sequence[str], log: pathlib.Path, **options) -> subprocess.Popen[bytes]:
        """Start argv as run_args says, output to `log`; command_pid() finds the process to signal."""
        with log.open("wb") as out:
            return subprocess.Popen(
                ["buildah", *self.run_args(argv, **options)],
                env={**os.environ, **self.buildah_env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )


def command_pid(launcher: subprocess.Popen[bytes]) -> int:
    """The host PID of the command a `buildah run` started, to signal it as the kubelet signals a container
    (buildah itself doesn't pass SIGTERM on): its innermost descendant, since the chain is buildah run ->
    chroot runtime -> chroot exec -> sh, which execs setpriv, env and then the command in place."""
    pid = launcher.pid
    while children := [
        int(child)
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]:
        pid = children[-1]
    return pid


@contextlib.contextmanager
def built_image(state: pathlib.Path, tag: str) -> Iterator[Image]:
    """Build the image from ./Dockerfile into a new storage under `state` and give a working container of
    it; the storage is deleted afterwards. Raises Unavailable where the tools can't be had."""
    (state / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{state / "root"}"\nrunroot = "{state / "run"}"\n'
    )
    storage = {"CONTAINERS_STORAGE_CONF": str(state / "storage.conf"), "BUILDAH_ISOLATION": "chroot"}
    builder = Image(tag, storage)
    log = state / "build.log"
    with log.open("w") as progress:
        build = subprocess.Popen(
            ["bash", str(BUILD_SCRIPT), tag],
            env={**os.environ, **builder.buildah_env},
            stdout=subprocess.DEVNULL,
            stderr=progress,
            start_new_session=True,
        )
        try:
            returncode = build.wait()
        except BaseException:  # pytest-timeout's, an interrupt: killing bash alone left buildah building on
            os.killpg(build.pid, signal.SIGKILL)
            build.wait()
            raise
    if returncode == SKIP_STATUS:
        raise Unavailable(log.read_text().strip().splitlines()[-1])
    try:
        if returncode != 0:
            raise BuildFailed(
                f"build_image.sh exited {returncode}; the end of {log}:\n{log.read_text()[-6000:]}"
            )
        config = json.loads(builder.buildah("inspect", "--type", "image", tag).stdout)
        yield dataclasses.replace(
            builder,
            container=builder.buildah("from", "--pull=never", tag).stdout.strip(),
            user=config["OCIv1"]["config"]["User"],
            layer_bytes=tuple(layer["size"] for layer in json.loads(config["Manifest"])["layers"]),
        )
    finally:
        builder.buildah("rm", "--all", check=False)
        builder.buildah("rmi", "--all", "--force", check=False)
        shutil.rmtree(state / "root", ignore_errors=True)
