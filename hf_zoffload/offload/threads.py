"""The host's threads and cores: how many threads the engine's host work runs on, and which
cores each process on a node gets.

`cpu_threads` is the CPU-Adam's thread count; the engine's other host passes run inside
`host_threads`, which sets torch's count for the calling thread while the engine works and
puts it back after. `bind_local_rank` gives each local rank of a node its own whole physical
cores, once, before the host state is allocated, and leaves a mask narrowed already as it is.
Why (launchers' ``OMP_NUM_THREADS=1``, ranks sharing cores) and the measurements: see
docs/design.md, "Host memory".
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

_SYS_CPU = "/sys/devices/system/cpu"
_CGROUP_CPUS = ("/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
                "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")  # cgroup v1


def affinity() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def local_ranks(environ) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun and accelerate launch set them; (0, 1)
    when unset or not numbers."""
    try:
        world = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
        rank = int(environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0, 1
    return (rank, world) if 0 <= rank < world else (0, 1)


def cpu_threads(explicit: int = 0, *, environ=None, bound: bool = False,
                log: bool = False) -> int:
    """The engine's host thread count: ``explicit`` when > 0, else the cores this process
    may run on (its affinity mask), divided by the processes on this node
    (``LOCAL_WORLD_SIZE``) unless ``bound`` (`bind_local_rank` gave it its share already),
    at least 1. Not ``torch.get_num_threads()``: launchers export OMP_NUM_THREADS=1."""
    environ = os.environ if environ is None else environ
    n = explicit or max(1, len(affinity()) // (1 if bound else local_ranks(environ)[1]))
    if log:
        # A warning only where more cores could be free: not for cpu_threads=1 asked, nor for
        # a rank's fair share (2 ranks on 2 cores: 1 each, and each warned).
        narrowed = n == 1 and not explicit and \
            (os.cpu_count() or 1) // local_ranks(environ)[1] > 1
        (logger.warning if narrowed else logger.info)(
            "ZeRO-Offload: the host work runs on %d thread(s)%s", n, "" if not narrowed else
            " (one core: set cpu_threads / HF_ZOFFLOAD_CPU_THREADS if more are free)")
    return n


@contextlib.contextmanager
def host_threads(n: int):
    """torch's intra-op thread count is ``n`` on this thread inside, as it was after."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (the kernel's list format) as a set of CPU numbers."""
    out: set[int] = set()
    for part in filter(None, text.replace("\n", ",").split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores(cpus: set[int], read=_read) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together, from sysfs
    ``thread_siblings_list``; each CPU alone where that cannot be read), groups ordered by
    their lowest CPU: neighbours are usually on one socket."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(cpus):
        text = read(f"{_SYS_CPU}/cpu{cpu}/topology/thread_siblings_list")
        siblings = parse_cpu_list(text) & cpus if text else {cpu}
        groups.setdefault(tuple(sorted(siblings or {cpu})), []).append(cpu)
    return sorted(groups.values())


def rank_cores(cores: list[list[int]], rank: int, world: int) -> set[int]:
    """Local rank ``rank``'s share of the physical ``cores`` among ``world`` ranks: a
    contiguous run of whole cores, the first ``len(cores) % world`` ranks one core more.
    Empty when there are fewer cores than ranks."""
    if len(cores) < world:
        return set()
    per, extra = divmod(len(cores), world)
    start = rank * per + min(rank, extra)
    return {cpu for core in cores[start:start + per + (rank < extra)] for cpu in core}


def _allowed(read=_read) -> set[int] | None:
    """Every CPU this process could be given: its cgroup's cpuset, else the online CPUs."""
    for path in (*_CGROUP_CPUS, f"{_SYS_CPU}/online"):
        text = read(path)
        if text:
            return parse_cpu_list(text)
    return None


_bound: set[int] | None = None  # what bind_local_rank set for this process


def bind_local_rank(environ=None, *, read=_read, setaffinity=None) -> set[int] | None:
    """With several processes on this node (LOCAL_WORLD_SIZE > 1), restrict this one to its
    local rank's share of whole physical cores; returns the CPUs it is bound to (also when
    an earlier engine of this process bound them), or None where nothing was bound: one
    process, a mask narrowed before by someone else (the user, a launcher), fewer cores
    than ranks, or no affinity call on this platform."""
    global _bound
    environ = os.environ if environ is None else environ
    rank, world = local_ranks(environ)
    setaffinity = setaffinity or getattr(os, "sched_setaffinity", None)
    if world == 1 or setaffinity is None:
        return None
    mine = affinity()
    if _bound is not None and mine == _bound:
        return set(_bound)
    allowed = _allowed(read)
    if allowed is not None and not allowed <= mine:
        return None  # narrowed already: a choice made before the engine stands
    cpus = rank_cores(physical_cores(mine, read), rank, world)
    if not cpus:
        logger.warning("ZeRO-Offload: %d local ranks share %d CPUs: cores are not bound",
                       world, len(mine))
        return None
    setaffinity(0, cpus)
    _bound = set(cpus)
    logger.info("ZeRO-Offload: local rank %d of %d bound to CPUs %s (of %d)", rank, world,
                _cpu_list(cpus), len(mine))
    return cpus


def _cpu_list(cpus: set[int]) -> str:
    """The kernel's list format, for the log."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
