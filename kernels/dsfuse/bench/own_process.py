"""Providers that run in a second Python process, inside the same run and the same blocks.

Some controls cannot share a process with the others: FlashQLA's TileLang pins apache-tvm-ffi
below 0.1.13 and the ``cutedsl`` extra wants 0.1.15 or later. A config names them::

    own_process: [flashqla]

and `dsfuse.bench.harness.run_experiment` starts this module as a worker, with the Python path of
the environment variable ``DSFUSE_OWN_PROCESS_PYTHONPATH`` (the parent's path where it is unset;
the ``dsfuse`` package's own folder is added either way). The worker builds the same experiment and
config, and the run's process drives it case by case: the checks before timing (the same seeds,
its own reference), the timing inputs and their reference (after the run's process has made its
own, before either builds a runner: at 131,072 tokens one process's float64 reference does not fit
beside the other's runners and graphs), the runners with their extra peak memory (one call each,
before the capture) and graphs, then, inside each block of the run, the samples of its providers
at their place in the config's order, and the checks after timing. So these providers are timed interleaved with the
others, on the same GPU, in the same paired blocks; the two processes never run at the same time
(each waits for the other's answer). What differs: their inputs are another process's tensors (the
same values), the L2 flush of the evicted regime is the worker's own buffer, and their peak memory
(``memory.csv``) is counted by the worker's allocator. ``env.json`` records the worker's Python path
and package versions under ``own_process``.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import traceback
import types
from multiprocessing.connection import Connection
from pathlib import Path

PATH_VARIABLE = "DSFUSE_OWN_PROCESS_PYTHONPATH"
STOP_TIMEOUT_S = 60


def start(experiment, config: dict, settings, device):
    """An `OwnProcess` for the config's ``own_process`` providers, or None where it names none."""
    names = config.get("own_process") or []
    if not names:
        return None
    listed = config.get("providers") or []
    if not isinstance(names, list) or any(name not in listed for name in names):
        raise ValueError(f"own_process: expected a list of the config's providers {listed}, got {names!r}")
    if not isinstance(experiment, types.ModuleType):
        raise ValueError("own_process: the experiment must be an importable module (the worker imports it by name)")
    return OwnProcess(experiment.__name__, config, names, settings, device)


class OwnProcess:
    """The run's side of the worker: each method asks the worker to do `dsfuse.bench.harness.CaseRun`'s
    step of the same name and returns its answer (a worker's exception is raised here, with its trace)."""

    def __init__(self, module: str, config: dict, names: list[str], settings, device):
        import dsfuse

        self.names = list(names)
        path = os.environ.get(PATH_VARIABLE, os.environ.get("PYTHONPATH", ""))
        package_root = str(Path(dsfuse.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, package_root) if p))
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "dsfuse.bench.own_process", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.env = self._call("init", module, config, self.names, vars(settings), str(device))
        except Exception:
            self.close()  # a worker that could not start is not left waiting
            raise

    def _call(self, method: str, *args):
        try:
            self.conn.send((method, args))
            status, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the own process of {self.names} stopped (exit status {self.proc.wait()}) "
                               f"during {method!r}") from exc
        if status == "error":
            raise RuntimeError(f"the own process of {self.names}, {method!r}:\n{value}")
        return value

    def check_before(self, case_name: str) -> list[dict]:
        return self._call("check_before", case_name)

    def prepare(self) -> None:
        return self._call("prepare")

    def build(self) -> tuple[list[dict], list[str]]:
        return self._call("build")

    def memory(self) -> list[dict]:
        return self._call("memory")

    def samples(self, name: str, clock: str, regime: str, block: int) -> list[dict]:
        return self._call("samples", name, clock, regime, block)

    def check_after(self) -> list[dict]:
        return self._call("check_after")

    def close(self) -> None:
        try:
            self.conn.send(("stop", ()))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class _Worker:
    """The worker's state: the experiment, its providers, the timer and the case being run."""

    def init(self, module: str, config: dict, names: list[str], settings: dict, device: str) -> dict:
        import torch

        from dsfuse.bench import env as env_mod
        from dsfuse.bench import harness

        self.harness = harness
        self.experiment = importlib.import_module(module)
        self.config = config
        self.device = torch.device(device)
        self.settings = harness.RunSettings(**settings)
        self.timer = harness.Timer(self.device, self.settings.flush_bytes)
        self.providers = [p for p in self.experiment.providers(config) if p.name in names]
        self.case = None
        return dict(providers=names, python=sys.executable, pythonpath=os.environ.get("PYTHONPATH", ""),
                    packages=env_mod.package_versions())

    def check_before(self, case_name: str) -> list[dict]:
        cases = {case.name: case for case in self.experiment.cases(self.config)}
        self.case = self.harness.CaseRun(self.experiment, cases[case_name], self.providers, self.settings,
                                         self.timer, self.device)
        rows = self.case.check_before()
        self.harness.release_cached_memory(self.device)  # room for the run's process's next reference
        return rows

    def prepare(self) -> None:
        self.case.prepare()
        self.harness.release_cached_memory(self.device)  # the reference's scratch, back before the run's runners

    def build(self):
        built = self.case.build()
        self.harness.release_cached_memory(self.device)
        return built

    def memory(self) -> list[dict]:
        return self.case.memory()

    def samples(self, name: str, clock: str, regime: str, block: int) -> list[dict]:
        return self.case.samples(name, clock, regime, block)

    def check_after(self) -> list[dict]:
        rows, self.case = self.case.check_after(), None
        self.harness.release_cached_memory(self.device)
        return rows


def main(fd: int) -> int:
    conn, worker = Connection(fd), _Worker()
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the run's process went away
            return 1
        if method == "stop":
            return 0
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception:  # the run's process raises it, with this trace
            conn.send(("error", traceback.format_exc()))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
