"""The parallel mode, decided in one place (hf_zoffload/offload/modes/resolve.py): each layout
a caller can build gets its mode and the exchange and span that mode holds; in one process,
over one-rank gloo groups (the multi-rank runs are test_partition.py, test_tensor_parallel.py
and test_fsdp2.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from hf_zoffload.config import ZeroOffloadPlugin
from hf_zoffload.offload.engine import ZeroOffloadOptimizer
from hf_zoffload.offload.modes.exchange import LocalExchange, OneRank
from hf_zoffload.offload.modes.fsdp2_offload import Fsdp2Exchange
from hf_zoffload.offload.modes.mesh import MeshSpan
from hf_zoffload.offload.modes.partitioned import GroupSpan, PartitionedExchange
from hf_zoffload.offload.modes.resolve import Kind
from tests.offload import _dp_worker as dpw
from tests.offload import _fsdp2_worker as fw
from tests.offload import _tp_worker as tw


def _engine(params, **kw):
    return ZeroOffloadOptimizer(params, plugin=ZeroOffloadPlugin(bucket_size_mb=0.004), **kw)


def _plain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def test_one_process():
    opt = _engine(_plain().parameters())
    assert opt.mode.kind is Kind.ONE_PROCESS and opt.mode.name == "one process"
    assert type(opt.exchange) is LocalExchange and type(opt.exchange.span) is OneRank
    assert not opt.exchange.spans_ranks and opt.exchange.world == 1


def test_a_world_of_one_rank_is_one_process_and_a_group_given_is_data_parallel():
    with dpw.one_rank():
        assert _engine(_plain().parameters()).mode.kind is Kind.ONE_PROCESS
        opt = _engine(_plain().parameters(), process_group=dist.group.WORLD)
        assert opt.mode.kind is Kind.DATA_PARALLEL and opt.mode.data_group is dist.group.WORLD
        assert type(opt.exchange) is PartitionedExchange
        assert type(opt.exchange.span) is GroupSpan and opt.exchange.spans_ranks


def test_dtensor_params_are_tensor_parallel_over_their_mesh():
    with dpw.one_rank():
        model = tw.Model()
        mesh = init_device_mesh("cpu", (1,))
        parallelize_module(model, mesh, tw.PLAN)
        opt = _engine(tw.decay_groups(model))
        m = opt.mode
        assert (m.kind, m.tp, m.data_group, m.mesh) == (Kind.TENSOR_PARALLEL, 1, None, mesh)
        assert type(opt.exchange) is LocalExchange and type(opt.exchange.span) is MeshSpan
        # with a data-parallel group given, the shards' state is partitioned over it
        model = tw.Model()
        parallelize_module(model, mesh, tw.PLAN)
        opt = _engine(tw.decay_groups(model), process_group=dist.group.WORLD)
        assert opt.mode.name == "tensor parallel x data parallel"
        assert type(opt.exchange) is PartitionedExchange and type(opt.exchange.span) is MeshSpan


def test_fully_shard_modules_are_fsdp2_and_win_over_a_group():
    with dpw.one_rank():
        model = fw.shard(fw.Net(), 1)
        opt = _engine(model.parameters(), model=model)
        assert opt.mode.kind is Kind.FSDP2 and len(opt.mode.fsdp_params) == len(opt.param_steps)
        assert type(opt.exchange) is Fsdp2Exchange and type(opt.exchange.span) is MeshSpan
        assert opt.exchange.params_on_host and opt.exchange.spans_ranks
        model = fw.shard(fw.Net(), 1)
        with pytest.raises(ValueError, match="process_group= was given"):
            _engine(model.parameters(), model=model, process_group=dist.group.WORLD)


def test_a_bad_layout_is_refused_before_anything_changes():
    """The refusal is resolve's: no param is cast, no host state made."""
    with dpw.one_rank():
        model = fw.shard(fw.Net(), 1, offload=False)
        before = [p.to_local().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="without CPU offload"):
            _engine(model.parameters(), model=model)
        assert all(p.to_local().dtype == torch.float32 and torch.equal(p.to_local(), b)
                   for p, b in zip(model.parameters(), before))
