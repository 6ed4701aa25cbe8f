"""Where a server's CPU goes under load: py-spy samples, aggregated by function and package.

py-spy samples the server from outside (``--nonblocking``: the target is never paused, so the
profile does not slow what it measures) and runs on the load generator's core. It writes the
format the output path asks for (``.svg`` flame graph, ``.json`` speedscope, else collapsed
stacks); the top-functions table always comes from collapsed stacks (``--format raw``), recorded
by a second sampler when the requested format is another one. Idle samples are left out by
py-spy, so shares are of the time the server was on a CPU.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_FORMATS = {".svg": "flamegraph", ".json": "speedscope"}
_EVENT_LOOP = "event loop C code (uvloop I/O + callbacks, httptools)"
_LOOP_FRAMES = {
    "Runner.run (asyncio/runners.py)",
    "run (asyncio/runners.py)",
    "BaseEventLoop.run_until_complete (asyncio/base_events.py)",
    "BaseEventLoop.run_forever (asyncio/base_events.py)",
}


@dataclass(slots=True)
class Profile:
    """Sample counts from collapsed stacks."""

    num_samples: int = 0
    self_by_function: Counter[str] = field(default_factory=Counter)
    total_by_function: Counter[str] = field(default_factory=Counter)
    """Samples with the function anywhere on the stack (counted once per sample)."""
    self_by_package: Counter[str] = field(default_factory=Counter)
    total_by_package: Counter[str] = field(default_factory=Counter)
    """Samples with the package anywhere on the stack (counted once per sample)."""

    def top(self, counts: Counter[str], n: int) -> list[tuple[str, int, float]]:
        """``(name, samples, share)`` of the ``n`` largest."""
        total = self.num_samples or 1
        return [(name, count, count / total) for name, count in counts.most_common(n)]

    def to_dict(self, n: int = 30) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "self_by_function": self.top(self.self_by_function, n),
            "total_by_function": self.top(self.total_by_function, n),
            "self_by_package": self.top(self.self_by_package, n),
            "total_by_package": self.top(self.total_by_package, n),
        }


def function_of(frame: str, root: str) -> tuple[str, str]:
    """``("func (file)", package)`` of a py-spy frame ``func (/path/file.py:123)``."""
    match = _FRAME.match(frame)
    if match is None:
        return frame, "other"
    path = match["file"]
    return f"{match['func']} ({_short(path, root)})", package_of(path, root)


def _short(path: str, root: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    if root and path.startswith(root):
        return path[len(root) :].lstrip("/")
    marker = re.search(r"/lib/python3\.\d+/", path)
    return path[marker.end() :] if marker else path


def package_of(path: str, root: str) -> str:
    """The top-level package a file belongs to (``stdlib:asyncio`` for the standard library)."""
    if not path.startswith("/"):  # py-spy's short names: relative to their sys.path entry
        return path.split("/", 1)[0].removesuffix(".py")
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if root and path.startswith(root):
        return path[len(root) :].lstrip("/").split("/", 1)[0].removesuffix(".py")
    marker = re.search(r"/lib/python3\.\d+/", path)
    if marker:
        return "stdlib:" + path[marker.end() :].split("/", 1)[0].removesuffix(".py")
    return path or "other"


def parse_collapsed(lines: Sequence[str], root: str) -> Profile:
    """Aggregate py-spy's ``--format raw`` output: ``frame;frame;...;leaf COUNT`` per line."""
    profile = Profile()
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # py-spy roots each stack at a "process PID:..." frame with --subprocesses.
        frames = [
            function_of(frame, root)
            for frame in stack.split(";")
            if frame and not frame.startswith("process ")
        ]
        if not frames:
            continue
        profile.num_samples += count
        leaf, package = frames[-1]
        if leaf in _LOOP_FRAMES:
            # The leaf is the loop itself: the sample was in C code the loop called directly
            # (uvloop's socket I/O and callbacks, httptools' parser), below any Python frame.
            leaf = package = _EVENT_LOOP
        profile.self_by_function[leaf] += count
        profile.self_by_package[package] += count
        # The loop's own frames root every stack: as callers they say nothing.
        callers = [(name, pkg) for name, pkg in frames[:-1] if name not in _LOOP_FRAMES]
        for name in {leaf, *(name for name, _ in callers)}:
            profile.total_by_function[name] += count
        for pkg in {package, *(pkg for _, pkg in callers)}:
            profile.total_by_package[pkg] += count
    return profile


class PySpy:
    """A py-spy sampler attached to ``pid`` until ``stop()``. Use as a context manager."""

    def __init__(
        self, binary: Path, pid: int, out: Path, cores: frozenset[int] | None, rate: int = 200
    ) -> None:
        self._argv_base = [str(binary), "record", "--pid", str(pid), "--rate", str(rate)]
        self._argv_base += ["--nonblocking", "--subprocesses"]
        self.out = out
        self.raw = out if _FORMATS.get(out.suffix) is None else out.with_suffix(".collapsed.txt")
        self._cores = cores
        self._processes: list[subprocess.Popen[bytes]] = []
        self.log = out.with_suffix(".py-spy.log")

    def __enter__(self) -> PySpy:
        # Full file names in the raw stacks: "asyncio/..." alone could be any package's.
        outputs = {self.raw: ["--format", "raw", "--full-filenames"]}
        if self.out != self.raw:
            outputs[self.out] = ["--format", _FORMATS[self.out.suffix]]
        cores = self._cores
        with self.log.open("wb") as log:
            for path, options in outputs.items():
                self._processes.append(
                    subprocess.Popen(
                        [*self._argv_base, *options, "--output", str(path)],
                        stdout=log,
                        stderr=log,
                        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
                    )
                )
        return self

    def __exit__(self, *exc: object) -> None:
        # SIGINT is py-spy's Ctrl-C: it stops sampling and writes its output.
        for process in self._processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
        for process in self._processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def read(self, root: str) -> Profile:
        """The aggregated profile (empty if py-spy wrote nothing; see ``log``)."""
        try:
            lines = self.raw.read_text(errors="replace").splitlines()
        except OSError:
            return Profile()
        return parse_collapsed(lines, root)
