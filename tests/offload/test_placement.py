"""What changes under the engine's feet: params moved, recast or reloaded after it was built;
the CPU-Adam's thread count under launchers; the delayed update's CUDA device; blocking
events. The CUDA-only halves carry the `gpu` marker (scripts/gpu_check.sh)."""

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload import delayed as delayed_mod
from hf_zoffload.offload import threads as threads_mod
from hf_zoffload.offload.threads import cpu_threads
from tests._tiny import batches, tiny_gpt2

LR = 1e-3


def _batch(i):
    return batches(i + 1)[i]  # the i-th of the seeded draws, as batches(n)[i] for any n > i


# make_engine's and train's defaults here (tests/_fixtures.py; train's loss: the LM's own)
ENGINE_DEFAULTS = dict(lr=LR, weight_decay=0.0, compute_dtype="bf16")
TRAIN_DEFAULTS = dict(batch=_batch)


# ----------------------------------------------------------- moved or recast afterwards
def test_recast_params_raise_at_the_first_hook(make_engine, train):
    model = tiny_gpt2()
    opt = make_engine(model)
    train(model, opt, 1)
    model.half()  # after the optimizer: the kernel would write bf16 bits into fp16 storage
    ids = batches(1)[0]
    with pytest.raises(RuntimeError, match="build the optimizer after moving the model"):
        model(input_ids=ids, labels=ids).loss.backward()


def test_moved_params_raise_at_step_before_any_change(make_engine, train):
    model = tiny_gpt2()
    opt = make_engine(model)
    train(model, opt, 1)
    masters = [b.state.master.clone() for b in opt.buckets]
    for p in model.parameters():  # the same Parameter on another device, as model.cuda()
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to("meta")))  # leaves it
    with pytest.raises(RuntimeError, match=r"now torch.bfloat16 on meta.*built for "
                                           r"torch.bfloat16 params on cpu"):
        opt.step()
    assert all(torch.equal(a, b.state.master) for a, b in zip(masters, opt.buckets))


# ------------------------------------------------------------ weights loaded afterwards
@pytest.mark.parametrize("delayed", [False, True])
def test_weights_loaded_after_the_engine_become_the_masters(delayed, train):
    """lr = 0 and no decay: a step changes no master, so after loading W and stepping the
    params must be W; stale masters would bring the old weights back."""
    model = tiny_gpt2()
    opt = ZeroOffloadOptimizer(model.parameters(), lr=0.0, weight_decay=0.0,
                               plugin=ZeroOffloadPlugin(compute_dtype="bf16",
                                                        delayed_update=delayed,
                                                        delayed_update_warmup_steps=0))
    train(model, opt, 2)
    other = tiny_gpt2(seed=5).to(torch.bfloat16).state_dict()
    if delayed:  # the pending update would overwrite them: refused with what to do
        model.load_state_dict(other)
        with pytest.raises(RuntimeError, match=r"Call optimizer.flush\(\) before loading"):
            train(model, opt, 1, start=2)
        opt.zero_grad()
        opt.flush()
    model.load_state_dict(other)
    train(model, opt, 2, start=3)
    opt.flush()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), other[name]), name
        assert torch.equal(opt.host_views(p)["master"], other[name].float().reshape(-1)), name


def test_loaded_weights_keep_training_from_there(make_engine, train):
    model = tiny_gpt2()
    opt = make_engine(model)
    train(model, opt, 2)
    old = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    loaded = tiny_gpt2(seed=5).to(torch.bfloat16).state_dict()
    model.load_state_dict(loaded)
    train(model, opt, 1, start=2)
    for n, p in model.named_parameters():  # one lr-sized step from W, far from the old weights
        if p.ndim < 2:  # biases and norms start equal in both models
            continue
        near, far = (p.detach().float() - loaded[n].float()).norm(), \
            (p.detach().float() - old[n]).norm()
        assert near < 0.1 * far, n


# ----------------------------------------------------------------------- thread count
def test_thread_count_follows_affinity_and_local_world(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what accelerate launch exports
    assert cpu_threads(0, environ={}) == 16
    assert cpu_threads(0, environ={"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}) == 4
    assert cpu_threads(0, environ={"LOCAL_WORLD_SIZE": "32"}) == 1
    assert cpu_threads(3, environ={"LOCAL_WORLD_SIZE": "4"}) == 3  # explicit wins


def test_bound_ranks_keep_their_own_cores_undivided(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert cpu_threads(0, environ={"LOCAL_WORLD_SIZE": "4"}, bound=True) == 4
    assert cpu_threads(0, environ={"LOCAL_WORLD_SIZE": "4"}) == 1


def _topology(siblings: dict[int, str], cgroup: str | None = None):
    """A sysfs reader: each CPU's thread_siblings_list, the cgroup's cpuset."""
    def read(path):
        if path.endswith("thread_siblings_list"):  # .../cpu/cpu<N>/topology/...
            return siblings.get(int(path.split("/")[-3][len("cpu"):]))
        if "cgroup" in path:
            return cgroup
        return None
    return read


# 4 physical cores with 2 hyperthreads each, Linux numbering: CPU n and n + 4 are siblings
HT = {c: f"{c % 4},{c % 4 + 4}" for c in range(8)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_local_ranks_get_disjoint_whole_cores(monkeypatch, world):
    monkeypatch.setattr(threads_mod, "_bound", None)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    got = []
    for rank in range(world):
        set_to = []
        cpus = threads_mod.bind_local_rank(
            {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)},
            read=_topology(HT, cgroup="0-7"), setaffinity=lambda pid, c, out=set_to: out.append(c))
        monkeypatch.setattr(threads_mod, "_bound", None)  # each rank is its own process
        assert set_to == [cpus]
        got.append(cpus)
    assert set().union(*got) == set(range(8))  # every core used
    for i, a in enumerate(got):
        for b in got[i + 1:]:
            assert not a & b  # disjoint
        assert all((c + 4) % 8 in a for c in a)  # a core's hyperthreads stay together
    assert sorted(len(a) for a in got) == {2: [4, 4], 3: [2, 2, 4], 4: [2, 2, 2, 2]}[world]


def test_binding_leaves_a_narrowed_mask_and_one_process_alone(monkeypatch):
    monkeypatch.setattr(threads_mod, "_bound", None)
    calls = []
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2, 3})  # numactl / taskset did
    assert threads_mod.bind_local_rank(env, read=_topology(HT, cgroup="0-7"),
                                       setaffinity=lambda *a: calls.append(a)) is None
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert threads_mod.bind_local_rank({}, read=_topology(HT, cgroup="0-7"),
                                       setaffinity=lambda *a: calls.append(a)) is None
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert threads_mod.bind_local_rank(env, read=_topology({0: "0"}, cgroup="0"),
                                       setaffinity=lambda *a: calls.append(a)) is None
    assert calls == []  # fewer cores than ranks: nothing bound either
    assert threads_mod.parse_cpu_list("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding two ranks needs two CPUs and sched_setaffinity (Linux)")
def test_two_local_ranks_bind_disjoint_cores_in_real_processes():
    """Two processes as torchrun starts them (LOCAL_RANK, LOCAL_WORLD_SIZE=2), each building
    an engine: each ends on its own cores, and its host threads are its cores."""
    code = ("import os, torch\n"
            "from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin\n"
            "p = torch.nn.Parameter(torch.randn(64))\n"
            "opt = ZeroOffloadOptimizer([p], plugin=ZeroOffloadPlugin(compute_dtype='fp32'))\n"
            "print(sorted(os.sched_getaffinity(0)), opt.cpu_threads, sorted(opt.bound_cpus))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                                   "OMP_NUM_THREADS": "1"}) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    masks = [eval(line.split("]")[0] + "]") for line in outs]
    assert masks[0] and masks[1] and not set(masks[0]) & set(masks[1]), outs
    for line, mask in zip(outs, masks):
        assert line.strip() == f"{mask} {len(mask)} {mask}", line


def test_host_work_runs_on_cpu_threads_under_omp_one(monkeypatch, make_engine):
    """torch's pool at one thread (what OMP_NUM_THREADS=1 gives): the fold of an
    accumulated micro-step, the step's host passes and the re-layout run on the engine's
    cpu_threads; the caller's count is back to one after each."""
    from hf_zoffload.offload import copier as copier_mod
    from hf_zoffload.offload import engine as engine_mod
    from hf_zoffload.offload.schedules import base as schedule_mod

    seen = {"fold": [], "run": [], "relayout": []}
    real_after = copier_mod.HostCopier.after_landed
    monkeypatch.setattr(copier_mod.HostCopier, "after_landed", lambda self, key, fn: real_after(
        self, key, lambda: (seen["fold"].append(torch.get_num_threads()), fn())))
    real_run = schedule_mod.run
    monkeypatch.setattr(schedule_mod, "run", lambda *a, **k: (
        seen["run"].append(torch.get_num_threads()), real_run(*a, **k))[1])
    real_relayout = engine_mod.relayout
    monkeypatch.setattr(engine_mod, "relayout", lambda *a, **k: (
        seen["relayout"].append(torch.get_num_threads()), real_relayout(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_gpt2()
        opt = make_engine(model, cpu_threads=3, bucket_size_mb=0.01)
        for _ in range(2):
            ids = batches(1)[0]
            for _micro in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                assert torch.get_num_threads() == 1
            opt.step()
            opt.zero_grad()
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen["fold"] and seen["run"] and seen["relayout"], seen
    assert all(n == 3 for ns in seen.values() for n in ns), seen


def test_host_work_thread_runs_on_its_threads(monkeypatch):
    """CudaCopier's host-work thread, without a GPU: its jobs see the engine's count."""
    from hf_zoffload.offload import copier

    monkeypatch.setattr(copier.torch.cuda, "set_device", lambda d: None)
    work = copier._HostWork(torch.device("cuda", 0), threads=3)
    seen = []
    work.submit(0, None, lambda: seen.append(torch.get_num_threads()))
    work.wait(0)
    assert seen == [3]


def test_engine_exposes_and_logs_its_threads(monkeypatch, caplog, make_engine):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    torch.set_num_threads(torch.get_num_threads())
    with caplog.at_level(logging.INFO, logger="hf_zoffload.offload.engine"):
        opt = make_engine(tiny_gpt2())
    assert opt.cpu_threads == 1
    assert any(r.levelno == logging.WARNING and "1 thread" in r.getMessage()
               for r in caplog.records)
    assert make_engine(tiny_gpt2(), cpu_threads=2).cpu_threads == 2


# ------------------------------------------------------------ the delayed update's device
def test_delayed_thread_sets_the_params_cuda_device(monkeypatch):
    """No GPU here: torch.cuda.set_device is replaced by a recorder. The thread must call it
    with the params' device before anything else, and never for CPU params."""
    calls = []
    monkeypatch.setattr(delayed_mod.torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, d)))
    d = delayed_mod.DelayedUpdate()
    seen = []
    d.start(lambda: seen.append(len(calls)), device=torch.device("cuda", 3))
    d.wait()
    assert calls == [("zoffload-cpu-adam", torch.device("cuda", 3))] and seen == [1]
    d.start(lambda: None, device=torch.device("cpu"))
    d.wait()
    assert len(calls) == 1


def test_delayed_thread_error_is_raised_on_the_caller():
    d = delayed_mod.DelayedUpdate()
    d.start(lambda: 1 / 0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="delayed CPU-Adam update failed") as info:
        d.wait()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert not d.running


def test_every_cuda_event_is_made_blocking(monkeypatch):
    """No GPU here: every event of the package comes from ``copier._event`` (the source
    says so), and that asks torch for a blocking one, timed or not."""
    import ast
    import pathlib

    import hf_zoffload
    from hf_zoffload.offload import copier

    makers = []
    for path in pathlib.Path(hf_zoffload.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                            "cuda.Event"):
                        makers.append((path.name, fn.name))
    assert makers == [("copier.py", "_event")]
    made = []
    monkeypatch.setattr(copier.torch.cuda, "Event", lambda **kw: made.append(kw))
    copier._event()
    copier._event(timing=True)
    assert made == [{"enable_timing": False, "blocking": True},
                    {"enable_timing": True, "blocking": True}]


@pytest.mark.gpu
def test_cuda_host_waits_use_blocking_events(monkeypatch, make_engine):
    made = []
    real = torch.cuda.Event

    def recording(*args, **kwargs):
        made.append(kwargs.get("blocking", False))
        return real(*args, **kwargs)

    model = tiny_gpt2().cuda()
    opt = make_engine(model)
    monkeypatch.setattr(torch.cuda, "Event", recording)
    ids = batches(1)[0].cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert made and all(made)


@pytest.mark.gpu
def test_cuda_copy_times_come_from_events_a_step_later(make_engine):
    model = tiny_gpt2().cuda()
    opt = make_engine(model)
    ids = batches(1)[0].cuda()
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    torch.cuda.synchronize()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # reads the copies of the step before, all finished by now
    assert opt.timings["d2h_copy"] > 0 and opt.timings["h2d_copy"] > 0
    assert opt.timings["upload_host"] >= 0 and opt.timings["grad_wait"] >= 0


def test_cpu_timings_are_named_for_what_they_measure(make_engine, train):
    model = tiny_gpt2()
    opt = make_engine(model)
    train(model, opt, 2)
    assert set(opt.timings) == {"fwd_bwd", "grad_wait", "cpu_adam", "upload_host"}
    assert opt.timings["cpu_adam"] > 0


def test_host_work_runs_off_the_caller_and_is_waited_per_key(monkeypatch):
    """CudaCopier's host-work thread (the fold of a micro-step's grads after they land),
    without a GPU: set_device is recorded, events are None (already landed)."""
    import time

    from hf_zoffload.offload import copier

    devices = []
    monkeypatch.setattr(copier.torch.cuda, "set_device", devices.append)
    work = copier._HostWork(torch.device("cuda", 1))
    done, caller = [], threading.current_thread()

    def slow():
        time.sleep(0.2)
        done.append(threading.current_thread() is not caller)

    t0 = time.perf_counter()
    work.submit(7, None, slow)
    assert time.perf_counter() - t0 < 0.1 and not done  # the caller did not wait
    work.wait(8)  # another key: nothing to wait for
    assert not done
    work.wait(7)
    assert done == [True] and devices == [torch.device("cuda", 1)]
    work.submit(7, None, lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="host work after a device-to-host copy failed"):
        work.wait(7)


def test_a_dropped_engine_is_freed_and_unhooks_its_params(make_engine, train):
    """The params hold their grad hooks in C++, out of sight of the cycle collector: the
    hooks reach the engine through a weak reference, so dropping it frees it (device
    params' host state, pinned pool, threads) and leaves plain torch behaviour."""
    import gc
    import weakref

    model = tiny_gpt2()
    opt = make_engine(model)
    train(model, opt, 1)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # no hook took them
