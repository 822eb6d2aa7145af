"""tests/_preloaded.py, the suite's fork server: a run's environment, the refusal of what was
read while importing, and `torchrun`'s workers (their environment, a gloo group, a failed rank
stopping the others)."""

import json
import os
import time

import pytest

from tests._preloaded import IMPORT_TIME, Preloaded

SCRIPT = '''
import json, os, sys, time
def cli(argv):
    if argv[0] == "env":
        print(json.dumps(dict(os.environ)))
        return 0
    if argv[0] == "exit":
        rank = int(os.environ.get("RANK", "0"))
        if rank == int(argv[1]):
            return int(argv[2])
        time.sleep(600)  # a rank that would wait for the failed one
    if argv[0] == "gloo":
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item()}")
        dist.destroy_process_group()
        return 0
    return 5
'''


@pytest.fixture
def server(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    with Preloaded(script, env) as s:
        yield s, env


def test_a_run_has_the_environment_it_is_given(server, tmp_path):
    s, env = server
    log = tmp_path / "default.log"
    assert s.start(["env"], out=log).wait(timeout=60) == 0
    assert json.loads(log.read_text()) == env  # the server's
    mine = dict(env, HF_ZOFFLOAD_TRACEBACK="1", OMP_NUM_THREADS="2")
    del mine["PATH"]
    log = tmp_path / "given.log"
    assert s.start(["env"], out=log, env=mine).wait(timeout=60) == 0
    assert json.loads(log.read_text()) == mine  # exactly: added, changed and dropped


@pytest.mark.parametrize("change", ["HF_HOME", "PYTHONPATH", "drop OMP_NUM_THREADS"])
def test_what_was_read_while_importing_cannot_change(server, tmp_path, change):
    s, env = server
    if change.startswith("drop"):
        mine, name = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}, "OMP_NUM_THREADS"
    else:
        mine, name = dict(env, **{change: str(tmp_path / "other")}), change
    assert name in IMPORT_TIME or name == "OMP_NUM_THREADS"
    with pytest.raises(ValueError, match=f"a forked run cannot change {name}: read while "
                                         f"the server imported"):
        s.start(["env"], out=tmp_path / "never.log", env=mine)
    assert not (tmp_path / "never.log").exists()


def test_torchrun_workers_have_torchruns_environment(server, tmp_path):
    s, env = server
    rc, text = s.torchrun(3, ["env"], out_dir=tmp_path, env=dict(env))
    assert rc == 0
    ranks = [json.loads(line) for line in text.splitlines()]
    assert [r["RANK"] for r in ranks] == [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "2"]
    for r in ranks:
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_RANK"]) == ("3", "3", "0")
        assert r["MASTER_ADDR"] == "127.0.0.1" and r["MASTER_PORT"] == ranks[0]["MASTER_PORT"]
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 hosts the store
        assert r["OMP_NUM_THREADS"] == "1" and r["HF_HOME"] == env["HF_HOME"]


def test_torchrun_workers_form_a_gloo_group(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    with Preloaded(script, env, "import torch.distributed") as s:
        rc, text = s.torchrun(2, ["gloo"], out_dir=tmp_path, timeout=120)
    assert rc == 0, text
    assert text.splitlines() == ["rank 0 of 2: 3.0", "rank 1 of 2: 3.0"]


def test_a_failed_worker_stops_the_others(server, tmp_path):
    s, _ = server
    began = time.monotonic()
    rc, _ = s.torchrun(3, ["exit", "1", "3"], out_dir=tmp_path, timeout=120)
    assert rc == 3 and time.monotonic() - began < 60  # not the others' 600 s
