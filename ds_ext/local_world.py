"""A gloo world of local processes, started once and reused by many tasks (tests, benchmarks).

``World(n)`` starts ``n`` worker processes that join one gloo process group
(file-store rendezvous, ``OMP_NUM_THREADS=1``, the DeepSpeed launcher's variables with
``DS_ACCELERATOR=cpu``) and then serve tasks: ``world.run(fn, *args)`` calls the
module-level function ``fn`` on every rank and returns the per-rank results in rank
order. A rank that raises, or whose process exits without answering (polled every
``POLL_S``, start-up included), makes ``run`` raise :class:`RankError` with that rank's
traceback or exit code; a rank that does not answer in time makes it raise ``TimeoutError``. In
both cases unanswered ranks are killed and the next ``run`` starts a fresh world, so a
failing test never hangs the suite.

``backend`` / ``accelerator`` give the ranks another process-group backend and DeepSpeed
accelerator (``"nccl"`` / ``"cuda"`` on a GPU machine: rank r on device r mod the device count).

Start-up: the workers are forked from a ``multiprocessing`` forkserver that has imported
torch and ds_ext's DeepSpeed-free modules once (:mod:`ds_ext._world_preload`; more with
:func:`preload`), so a rank starts in a fraction of a second instead of importing them itself
(about 3 s of CPU each, most of a world's start on a small machine); what it inherits is
``gc.freeze()``-d. Each worker then takes the parent's environment as it is at ``World`` start
(as a spawned process would inherit it), plus the variables above.

Process groups: a rank that has created more than ``MAX_GROUPS`` process groups is replaced, with
the whole world, before the next ``run`` (a fresh world starts in well under a second from the
forkserver). Each gloo group owns a TCP device whose event loop wakes every 10 ms, and the groups
of a finished DeepSpeed engine stay alive (its autograd hooks keep it referenced through C++,
out of the garbage collector's reach): measured on 8 ranks of 2 cores, 43 such groups cost each
idle rank 7 % of a core and made TED's 100 training steps 2.2x slower. A task must therefore not
rely on state an earlier ``run`` left in the ranks, other than as a cache it can rebuild.
``max_groups`` sets the limit (None: never replaced, for ranks whose imports are not preloaded and
cost more than the groups do). Nor does a task see ``torch.nn.functional.linear`` as an earlier
one left it: DeepSpeed ZeRO-3 installs its memory-efficient linear for the rest of the process
("This will persist unless manually reset"), which changes bf16 results in the last bits; each
task ends with the original restored.

A rank whose owner (the process that started the World) is gone, killed before it could close
the World, exits within ``OWNER_POLL_S``: nothing is left polling its gloo groups.

``rank_env`` (one dict per rank, applied last) and ``rank_setup`` (one picklable callable or None
per rank, run before anything else: entering the rank's network namespace) place the ranks on an
emulated cluster (:func:`ds_ext.cluster.world.cluster_world`).
"""

from __future__ import annotations

import contextlib
import gc
import glob
import multiprocessing as mp
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from ds_ext.errors import DsExtError

_CTX = mp.get_context("forkserver")
_PRELOAD = ["ds_ext._world_preload"]
_CTX.set_forkserver_preload(list(_PRELOAD))


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` too (after :mod:`ds_ext._world_preload`), so
    that ranks start with them: for modules most ranks of a process's worlds import. Takes
    effect only before the forkserver starts (the first World start of the process); a module
    that fails to import is left to the ranks. Modules that start threads must not be named."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    _CTX.set_forkserver_preload(list(_PRELOAD))


def mp_context():
    """The ``multiprocessing`` context World starts its ranks with: a forkserver that has
    imported torch (processes started by it skip that import)."""
    return _CTX


PG_TIMEOUT_S = 90
GRACE_AFTER_ERROR_S = 10
GRACE_AFTER_DEATH_S = 2  # the others wait for the dead rank: no more answers will come
POLL_S = 0.5  # how often a wait looks for ranks that died without answering
OWNER_POLL_S = 2.0  # how often an idle rank looks whether its owner is still there
MAX_GROUPS = 32  # process groups a rank may have created before the world is replaced


class RankError(DsExtError, RuntimeError):
    """One or more ranks raised; the message holds their tracebacks."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _groups_created() -> int:
    """Process groups this rank has created (torch.distributed's own count, destroyed ones
    included: those a finished engine still references cannot be told apart)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.group_count


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs; one that has exited and waits to be reaped (a zombie: a
    killed owner whose parent reads its output before reaping it) does not."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _worker(
    rank: int,
    world_size: int,
    env: dict[str, str],
    store: str,
    tasks,
    results,
    setup: Callable[[], None] | None = None,
    parent_env: dict[str, str] | None = None,
    backend: str = "gloo",
    owner: int | None = None,
) -> None:
    if setup is not None:
        setup()
    # the objects inherited from the forkserver (modules: half a million objects once DeepSpeed
    # and transformers are in) are alive for good; a full collection need not walk them
    gc.freeze()
    if parent_env is not None:  # the forkserver's environment is the parent's at its own start
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), **env})
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    linear = torch.nn.functional.linear
    try:
        if env.get("DS_ACCELERATOR") == "cuda":  # every rank on one device when there are fewer devices than ranks
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        results.put((rank, "ready", None, 0))
    except BaseException:
        results.put((rank, "error", traceback.format_exc(), 0))
        return
    while True:
        try:
            task = tasks.get(timeout=OWNER_POLL_S)
        except queue.Empty:
            if owner is not None and not _alive(owner):  # module docstring
                os._exit(0)
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            results.put((rank, "ok", value, _groups_created()))
        except BaseException:
            results.put((rank, "error", traceback.format_exc(), 0))
        torch.nn.functional.linear = linear  # module docstring
    # every result was consumed before close() sent None; tearing down the hundreds of gloo
    # groups the tests created costs seconds per rank and the OS reclaims them anyway
    os._exit(0)


class World:
    """Persistent pool of ``world_size`` gloo ranks (see module docstring)."""

    def __init__(
        self,
        world_size: int,
        env: dict[str, str] | None = None,
        timeout: float = 300,
        rank_env: list[dict[str, str]] | None = None,
        rank_setup: list[Callable[[], None] | None] | None = None,
        backend: str = "gloo",
        accelerator: str = "cpu",
        max_groups: int | None = MAX_GROUPS,
    ) -> None:
        self.world_size = world_size
        self.max_groups = max_groups
        self.backend = backend
        self.timeout = timeout
        self.rank_env = rank_env or [{} for _ in range(world_size)]
        self.rank_setup = rank_setup or [None] * world_size
        self.env = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "DS_ACCELERATOR": accelerator,
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        self._procs: list = []

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ds_ext_world_")
        env = {**self.env, "MASTER_PORT": str(_free_port())}
        self._rendezvous = f"_{env['MASTER_ADDR']}_{env['MASTER_PORT']}_"
        self._results = _CTX.Queue()
        self._tasks = [_CTX.Queue() for _ in range(self.world_size)]
        store = os.path.join(self._dir, "store")
        self._procs = [
            _CTX.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    {**env, **self.rank_env[r]},
                    store,
                    self._tasks[r],
                    self._results,
                    self.rank_setup[r],
                    dict(os.environ),
                    self.backend,
                    os.getpid(),
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start", self.timeout, expect="ready")

    def _collect(self, what: str, timeout: float, expect: str = "ok") -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        groups = 0
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size and time.monotonic() < deadline:
            try:
                rank, status, value, created = self._results.get(
                    timeout=max(0.01, min(POLL_S, deadline - time.monotonic()))
                )
            except queue.Empty:
                if self._dead(set(out) | set(errors)):  # reported below, unless its answer still comes
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_DEATH_S)
                continue
            groups = max(groups, created)
            if status == expect:
                out[rank] = value
            else:
                errors[rank] = value
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_ERROR_S)
        errors.update(self._dead(set(out) | set(errors)))
        missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
        if errors or missing:
            for r in missing:  # stuck waiting for the others: nothing to wait for
                self._procs[r].kill()
            self.close()
            if errors:
                detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                raise RankError(
                    f"{what} failed on ranks {sorted(errors)}"
                    f"{f'; ranks {missing} did not answer' if missing else ''}\n{detail}"
                )
            raise TimeoutError(f"{what}: ranks {missing} did not finish within {timeout:.0f} s")
        if self.max_groups is not None and groups > self.max_groups:  # the next run starts a fresh world
            self.close()
        return [out[r] for r in range(self.world_size)]

    def _dead(self, answered: set[int]) -> dict[int, str]:
        """Ranks that have not answered and whose process has exited, with its exit code."""
        return {
            r: f"process exited with code {p.exitcode} without answering (its stderr above)"
            for r, p in enumerate(self._procs)
            if r not in answered and p.exitcode is not None
        }

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; per-rank results in rank order."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "task"), timeout or self.timeout)

    def close(self) -> None:
        if not self._procs:
            return
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        shutil.rmtree(self._dir, ignore_errors=True)
        # shared memory named after this world's rendezvous (DeepSpeed's CPU all-reduce buffers):
        # the ranks end with os._exit, which skips the destructors that would unlink it
        for path in glob.glob(f"/dev/shm/*{self._rendezvous}*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
