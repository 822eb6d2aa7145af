"""The engine with compact moments (``state_dtype`` bf16 / int8 / int4): the same update as the
kernel applied param by param, portable checkpoints with exact resume, and the host bytes."""

import copy

import pytest
import torch

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.ops import adam_kernels as ca
from hf_zoffload.ops import moments as mo

LR, WD = 1e-2, 0.05


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(37, 29)  # odd sizes: no param fills whole blocks
        self.b = torch.nn.Linear(29, 300)
        self.c = torch.nn.Linear(300, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).square().mean()


def _data(i):
    return torch.randn(8, 37, generator=torch.Generator().manual_seed(i))


def _loss(model, x, step):
    return model(x.to(next(model.parameters()).dtype))


# make_engine's and train's defaults here (tests/_fixtures.py)
ENGINE_DEFAULTS = dict(lr=LR, weight_decay=WD, compute_dtype="fp32", bucket_size_mb=0.02)
TRAIN_DEFAULTS = dict(batch=_data, loss=_loss)


@pytest.mark.parametrize("state", ["bf16", "int8", "int4"])
def test_engine_is_the_kernel_applied_param_by_param(state, make_engine):
    """Buckets, shard offsets and block scales are plumbing: the engine's result must be
    bitwise the kernel's on each param on its own (with int8 / int4, every param starts a
    block)."""
    model, ref = _Net(), _Net()
    opt = make_engine(model, state_dtype=state)
    assert len(opt.buckets) > 1
    fmt = mo.FORMATS[state]
    st = {}
    for n, p in ref.named_parameters():
        k = p.numel()
        st[n] = [p.detach().clone().reshape(-1), torch.zeros(fmt.storage(k), dtype=fmt.dtype),
                 torch.zeros(fmt.storage(k), dtype=fmt.dtype)]
        if fmt.scaled:
            st[n].append((torch.zeros(fmt.n_scales(k)), torch.zeros(fmt.n_scales(k))))
    for step in range(1, 6):
        model(_data(step)).backward()
        opt.step()
        opt.zero_grad()
        ref(_data(step)).backward()
        for n, p in ref.named_parameters():
            master, m, v, *scales = st[n]
            ca.adam_update(master, p.grad.reshape(-1), m, v, step=step, lr=LR, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=WD,
                           scales=scales[0] if scales else None, state_dtype=state)
            p.data.copy_(master.view_as(p))
            p.grad = None
        for (n, p), q in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(p, q), (step, n)
            assert torch.equal(opt.host_views(q)["exp_avg"], st[n][1]), (step, n)
            assert torch.equal(opt.host_views(q)["exp_avg_sq"], st[n][2]), (step, n)


@pytest.mark.parametrize("state", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("delayed", [False, True])
def test_checkpoint_holds_fp32_moments_and_resumes_exactly(state, delayed, tmp_path, make_engine,
                                                           train):
    plugin = dict(delayed_update=delayed, delayed_update_warmup_steps=1)
    model = _Net()
    opt = make_engine(model, state_dtype=state, **plugin)
    train(model, opt, 3)
    sd = opt.state_dict()
    torch.save({"model": model.state_dict(), "opt": sd}, tmp_path / "ck.pt")
    for s in sd["state"].values():
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32
        assert (s["exp_avg_sq"] >= 0).all() and s["exp_avg"].abs().sum() > 0
    train(model, opt, 4, start=3)
    opt.flush()
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    again = _Net()
    again.load_state_dict(ck["model"])
    opt2 = make_engine(again, state_dtype=state, **plugin)
    opt2.load_state_dict(ck["opt"])
    assert opt2.state_dict()["state"].keys() == ck["opt"]["state"].keys()
    for a, b in zip(opt2.state_dict()["state"].values(), ck["opt"]["state"].values()):
        for key in ("exp_avg", "exp_avg_sq", "master"):  # encode(decode) gives the same
            assert torch.equal(a[key], b[key])
    train(again, opt2, 4, start=3)
    opt2.flush()
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("coded", ["int8", "int4"])
def test_checkpoints_move_between_modes_and_torch_adamw(coded, make_engine, train):
    model = _Net()
    opt = make_engine(model, state_dtype=coded)
    train(model, opt, 3)
    sd = opt.state_dict()
    adamw = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=LR, weight_decay=WD)
    adamw.load_state_dict(sd)  # torch takes it: per-param fp32 moments, its keys
    for mode in ("fp32", "bf16"):
        other = _Net()
        other.load_state_dict(model.state_dict())
        o = make_engine(other, state_dtype=mode)
        o.load_state_dict(sd)
        for p, q in zip(model.parameters(), other.parameters()):
            got, want = o.host_views(q), opt.host_views(p)
            m, v = (t.float() for t in (got["exp_avg"], got["exp_avg_sq"]))
            m8, v8 = mo.FORMATS[coded].decode(want["exp_avg"], want["exp_avg_sq"],
                                              _block_scales(opt, p), 0, p.numel())
            tol = 0 if mode == "fp32" else 2.0**-8  # bf16: one rounding of the decoded value
            assert ((m - m8).abs() <= tol * m8.abs()).all()
            assert ((v - v8).abs() <= tol * v8.abs()).all()
    # and back: an fp32 checkpoint into int8 / int4 encodes it, to the same codes (the
    # fp32 moments there are the decoded codes)
    back = _Net()
    back.load_state_dict(model.state_dict())
    b8 = make_engine(back, state_dtype=coded)
    b8.load_state_dict(o.state_dict())
    for p, q in zip(model.parameters(), back.parameters()):
        assert torch.equal(b8.host_views(q)["exp_avg"], opt.host_views(p)["exp_avg"])
        assert torch.equal(b8.host_views(q)["exp_avg_sq"], opt.host_views(p)["exp_avg_sq"])
    train(back, b8, 1, start=3)


def _block_scales(opt, p):
    b, i = opt._where[p][:2]
    own, _ = b.layout.owned(b.layout.slots[i])
    return b.state.moment_parts(own.start, own.stop)[2]


@pytest.mark.parametrize("state,moment_bytes", [("fp32", 8), ("bf16", 4), ("int8", 2),
                                                ("int4", 1)])
def test_host_bytes_per_param(state, moment_bytes, train):
    """bf16 compute: master 4 + moments + 16-bit grads 2, and no param staging buffer."""
    model = _Net()
    opt = ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(
        compute_dtype="bf16", state_dtype=state, pin_memory=False))
    train(model, opt, 1)
    rep = opt.memory_report()
    n = rep["n_params"]
    host = rep["host"]
    assert rep["state_dtype"] == state and "param_staging" not in host
    assert host["master"] >= 4 * n
    per_param = (host["exp_avg"] + host["exp_avg_sq"]) / n
    # int8 / int4: each param starts on a 256 / 128-element block (padding) plus a scale per
    # block
    assert moment_bytes <= per_param <= moment_bytes * (1.3 if state.startswith("int") else 1.0)


def test_each_state_dtype_is_one_format_object():
    from hf_zoffload.config import STATE_DTYPES

    assert tuple(mo.FORMATS) == STATE_DTYPES  # the setting's choices are the formats
    fp32, bf16, int8, int4 = (mo.moment_format(n) for n in STATE_DTYPES)
    assert [f.dtype for f in (fp32, bf16, int8, int4)] == [torch.float32, torch.bfloat16,
                                                           torch.uint8, torch.uint8]
    assert [f.bytes_per_element() for f in (fp32, bf16, int8, int4)] == \
        [8.0, 4.0, 2.0 + 8 / 256, 1.0 + 8 / 128]
    assert (fp32.align, int8.align, int8.n_scales(257), bf16.n_scales(257)) == (1, 256, 2, 0)
    assert (int4.align, int4.n_scales(257), int4.storage(257), int8.storage(257)) == \
        (128, 3, 129, 257)
    for f in (fp32, bf16):
        f.check_betas(0.99, 0.9)  # exact Adam needs no bound
    for f in (int8, int4):
        with pytest.raises(ValueError, match=f"'{f.name}' needs beta1\\*\\*2 < beta2"):
            f.check_betas(0.99, 0.9)
    with pytest.raises(ValueError, match="state_dtype must be one of fp32, bf16, int8, int4"):
        mo.moment_format("fp8")
    with pytest.raises(ValueError, match="element 3 does not start a byte"):
        int4.part(torch.zeros(4, dtype=torch.uint8), 3, 5)
    m, v, scales = torch.zeros(300, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8), \
        (torch.zeros(2), torch.zeros(2))
    m32, v32 = torch.linspace(-1, 1, 300), torch.linspace(0, 2, 300)
    int8.encode(m32, v32, m, v, scales, 0)
    assert torch.equal(torch.stack(int8.decode(m, v, scales, 0)),
                       torch.stack(mo.decode_reference(*mo.encode_reference(m32, v32))))


def test_int4_codes_of_an_odd_param_end_leave_the_gap_zero(make_engine, train):
    """4-bit codes of a param with an odd element count share their last byte with the
    alignment gap: the gap's nibble stays 0, and every byte past the params is 0."""
    model = _Net()
    opt = make_engine(model, state_dtype="int4")
    train(model, opt, 2)
    for b in opt.buckets:
        st, used = b.state, torch.zeros(b.layout.shard, dtype=torch.bool)
        for s in b.layout.slots:
            own, _ = b.layout.owned(s)
            used[own] = True
        for codes in (st.exp_avg, st.exp_avg_sq):
            nib = torch.stack([codes & 15, codes >> 4], 1).reshape(-1)[:b.layout.shard]
            assert (nib[~used] == 0).all() and (nib[used] != 0).any()
