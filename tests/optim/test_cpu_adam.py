"""CPUAdam as a drop-in for torch.optim.AdamW / torch.optim.Adam.

Tolerance on parameters: atol = 2e-6 * lr_max * steps, rtol = 1e-6 * steps, derived in
tests/ops/test_adam_kernels.py (only the denominator sqrt(v) / sqrt(bc2) + eps is computed
differently, by <= 3.5 ulp; everything else is the same fp32 op sequence).  Moments get 1e-5
relative.  Only fp32 grads here: torch refuses a .grad of another dtype than the parameter
(16-bit grads are covered on the kernel).
"""

import copy
import io
import types

import pytest
import torch

from hf_zoffload.ops.adam_kernels import adam_update, adam_update_reference
from hf_zoffload.optim.cpu_adam import CPUAdam, _check_grad, _check_param, _check_state, _fast_ok

SHAPES = [(1,), (7,), (22,), (4097,), (7, 3), (3, 5, 2)]


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _set_grads(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 10 ** torch.empty(p.shape).uniform_(
            -3, 1, generator=gen)


def _groups(params, **extra):
    return [
        {"params": params[:3], **extra},
        {"params": params[3:], "lr": 5e-3, "weight_decay": 0.1, "betas": (0.8, 0.99),
         "eps": 1e-6},
    ]


def _close(a, b, *, lr_max, steps):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), atol=2e-6 * lr_max * steps,
                                   rtol=1e-6 * steps)


def _train(opt, params, steps, start=1, sched=None):
    for s in range(start, start + steps):
        _set_grads(params, s)
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("adamw_mode, torch_cls", [(True, torch.optim.AdamW),
                                                   (False, torch.optim.Adam)])
def test_100_steps_with_scheduler_and_groups_match_torch(adamw_mode, torch_cls):
    ours, theirs = _params(), _params()
    a = CPUAdam(_groups(ours), lr=1e-3, weight_decay=0.01, adamw_mode=adamw_mode)
    b = torch_cls(_groups(theirs), lr=1e-3, weight_decay=0.01)
    lam = lambda s: 1.0 + (s % 5) - 0.5 * (s % 3)  # noqa: E731 - jumps both ways every step
    sa = torch.optim.lr_scheduler.LambdaLR(a, lam)
    sb = torch.optim.lr_scheduler.LambdaLR(b, lam)
    for s in range(1, 101):
        _set_grads(ours, s)
        _set_grads(theirs, s)
        a.step(), b.step(), sa.step(), sb.step()
    assert a.param_groups[1]["lr"] == b.param_groups[1]["lr"] != 5e-3
    _close(ours, theirs, lr_max=5e-3 * 5, steps=100)
    for p, q in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq"):
            # differences enter only through Adam's L2 term and b1, b2 < 1 damp them
            want = b.state[q][key]
            torch.testing.assert_close(a.state[p][key], want, atol=1e-5 * want.abs().max().item(),
                                       rtol=1e-5)
        assert a.state[p]["step"].dtype == torch.float32 and a.state[p]["step"].item() == 100


def test_bias_correction_off_matches_reference():
    ours = _params()
    ref = [p.detach().clone() for p in ours]
    moments = [(torch.zeros(p.numel()), torch.zeros(p.numel())) for p in ours]
    opt = CPUAdam(ours, lr=2e-3, weight_decay=0.05, bias_correction=False)
    for s in range(1, 21):
        _set_grads(ours, s)
        opt.step()
        for p, r, (m, v) in zip(ours, ref, moments):
            adam_update_reference(r.view(-1), p.grad.view(-1), m, v, step=s, lr=2e-3,
                                  beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                                  bias_correction=False)
    _close(ours, ref, lr_max=2e-3, steps=20)


def test_none_grads_are_skipped():
    params = _params()
    opt = CPUAdam(params)
    _set_grads(params, 1)
    params[2].grad = None
    before = params[2].detach().clone()
    opt.step()
    assert torch.equal(params[2], before) and params[2] not in opt.state
    assert len(opt.state) == len(params) - 1


def test_closure_and_version_counter():
    params = _params()
    opt = CPUAdam(params)
    _set_grads(params, 1)
    v0 = params[0]._version
    assert opt.step(lambda: torch.tensor(3.0)).item() == 3.0
    assert params[0]._version > v0  # autograd learns the kernel wrote the parameter


def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_save_load_continues_exactly():
    ref, resumed = _params(), _params()
    opt = CPUAdam(_groups(ref), lr=1e-3)
    _train(opt, ref, 10)
    saved = _roundtrip(opt.state_dict())
    _train(opt, ref, 10, start=11)
    first = CPUAdam(_groups(resumed), lr=1e-3)
    _train(first, resumed, 10)
    snapshot = [p.detach().clone() for p in resumed]
    fresh = CPUAdam(_groups(resumed), lr=1e-3)
    fresh.load_state_dict(saved)
    for p, s in zip(resumed, snapshot):
        p.data.copy_(s)
    _train(fresh, resumed, 10, start=11)
    for p, q in zip(ref, resumed):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("adamw_mode, torch_cls", [(True, torch.optim.AdamW),
                                                   (False, torch.optim.Adam)])
def test_state_dict_moves_both_ways_with_torch(adamw_mode, torch_cls):
    kw = dict(lr=2e-3, weight_decay=0.02)
    # CPUAdam -> torch, continued on both sides
    ours, theirs = _params(), _params()
    a = CPUAdam(ours, adamw_mode=adamw_mode, **kw)
    _train(a, ours, 5)
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            q.copy_(p)
    b = torch_cls(theirs, **kw)
    b.load_state_dict(_roundtrip(a.state_dict()))
    assert b.param_groups[0]["decoupled_weight_decay"] is adamw_mode
    _train(a, ours, 5, start=6)
    _train(b, theirs, 5, start=6)
    _close(ours, theirs, lr_max=2e-3, steps=5)
    # torch -> CPUAdam constructed in the *other* mode: the checkpoint's mode wins
    c = CPUAdam(copy.deepcopy(ours), adamw_mode=not adamw_mode, **kw)
    c.load_state_dict(_roundtrip(b.state_dict()))
    assert c.param_groups[0]["decoupled_weight_decay"] is adamw_mode
    with torch.no_grad():
        for p, q in zip(c.param_groups[0]["params"], theirs):
            p.copy_(q)
    _train(b, theirs, 5, start=11)
    _train(c, c.param_groups[0]["params"], 5, start=11)
    _close(c.param_groups[0]["params"], theirs, lr_max=2e-3, steps=5)
    st = c.state[c.param_groups[0]["params"][0]]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["step"].item() == 15


def test_named_params_and_adamw_mode_group_key():
    model = torch.nn.Linear(3, 2)
    opt = CPUAdam(list(model.named_parameters()))
    extra = [("extra", torch.nn.Parameter(torch.zeros(4)))]
    opt.add_param_group({"params": extra, "adamw_mode": False})
    assert opt.param_groups[1]["decoupled_weight_decay"] is False
    with pytest.raises(TypeError, match="parameter 'bias' must be float32"):
        bad = torch.nn.Linear(3, 2).double()
        CPUAdam(list(bad.named_parameters())[1:])


def _bad_param_cases():
    yield "device", lambda: [torch.zeros(3, device="meta", requires_grad=True)], ValueError
    yield "float64", lambda: [torch.zeros(3, dtype=torch.float64, requires_grad=True)], TypeError
    yield "contiguous", lambda: [torch.zeros(4, 3).t().requires_grad_()], ValueError


@pytest.mark.parametrize("text, make, exc", list(_bad_param_cases()))
def test_bad_params_rejected_at_construction(text, make, exc):
    with pytest.raises(exc, match=f"parameter 1 of param group 0.*{text}|{text}.*parameter 1"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2)), *make()])


@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(lr=-1e-3), ValueError, "lr"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
    (dict(betas=(0.9,)), ValueError, "betas"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(amsgrad=True), ValueError, "amsgrad"),
    (dict(adamw_mode="yes"), TypeError, "decoupled_weight_decay"),
])
def test_bad_hyperparameters_rejected(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        CPUAdam(_params(), **kwargs)


def test_bad_group_rejected_and_not_added():
    opt = CPUAdam(_params())
    with pytest.raises(ValueError, match="lr of param group 1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1.0})
    assert len(opt.param_groups) == 1


def _assert_step_raises_untouched(opt, params, exc, text):
    before = [p.detach().clone() for p in params]
    with pytest.raises(exc, match=text):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert not opt.state  # no state created for anyone, not even the good params


def test_grad_of_another_shape_raises_before_any_state():
    params = _params()
    opt = CPUAdam(params)
    _set_grads(params, 1)
    params[4].data = torch.zeros(3, 7)  # e.g. a resized embedding; the grad is still (7, 3)
    _assert_step_raises_untouched(opt, params, ValueError, "parameter 4 of param group 0")


def test_non_contiguous_grad_raises_before_any_state():
    params = _params()
    opt = CPUAdam(params)
    _set_grads(params, 1)
    params[4].grad = torch.zeros(3, 7).t()
    _assert_step_raises_untouched(opt, params, ValueError, "gradient of parameter 4.*contiguous")


def _case(name):
    """(param, grad, state) for a case of test_fast_check_agrees_with_the_named_checks; every
    case but "good" and "fresh state" breaks one condition.  The grad is not set as p.grad:
    torch refuses one of another dtype or shape there, yet a grad may come so (p.data
    replaced after backward, a grad_dtype of None)."""
    p = torch.zeros(7, 3)
    g = torch.zeros(7, 3, dtype=torch.bfloat16)
    state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(7, 3),
             "exp_avg_sq": torch.zeros(7, 3)}
    if name == "fresh state":
        state = {}
    elif name == "grad of the same numel, another shape":
        g = torch.zeros(3, 7)
    elif name == "grad of another dtype":
        g = torch.zeros(7, 3, dtype=torch.float64)
    elif name == "non-contiguous grad":
        g = torch.zeros(3, 7).t()
    elif name == "sparse grad":
        g = torch.zeros(7, 3).to_sparse()
    elif name == "non-contiguous param":
        p = torch.zeros(3, 7).t()
    elif name == "float64 param":
        p = torch.zeros(7, 3, dtype=torch.float64)
    elif name == "meta param":
        p = torch.zeros(7, 3, device="meta")
    elif name == "exp_avg of the same numel, another shape":
        state["exp_avg"] = torch.zeros(21)
    elif name == "exp_avg_sq of another dtype":
        state["exp_avg_sq"] = torch.zeros(7, 3, dtype=torch.bfloat16)
    elif name == "non-contiguous exp_avg":
        state["exp_avg"] = torch.zeros(3, 7).t()
    elif name == "no step":
        del state["step"]
    elif name == "exp_avg not a tensor":
        state["exp_avg"] = [0.0] * 21
    else:
        assert name == "good"
    return p, g, state


@pytest.mark.parametrize("name", [
    "good", "fresh state", "grad of the same numel, another shape", "grad of another dtype",
    "non-contiguous grad", "sparse grad", "non-contiguous param", "float64 param", "meta param",
    "exp_avg of the same numel, another shape", "exp_avg_sq of another dtype",
    "non-contiguous exp_avg", "no step", "exp_avg not a tensor"])
def test_fast_check_agrees_with_the_named_checks(name):
    """step() trusts _fast_ok and runs the kernel on raw pointers: it must be False whenever
    a named check would raise, and True in the cases they pass (else step pays for them)."""
    p, g, state = _case(name)

    def named():
        _check_param(p, "p")
        _check_grad(types.SimpleNamespace(grad=g, shape=p.shape), "p")  # what it reads of p
        _check_state(state, p, "p")

    if name in ("good", "fresh state"):
        named()
        assert _fast_ok(p, g, state)
    else:
        with pytest.raises((TypeError, ValueError)):
            named()
        assert not _fast_ok(p, g, state)


def test_changed_group_hyperparameter_raises_at_step():
    params = _params()
    opt = CPUAdam(params)
    _set_grads(params, 1)
    opt.param_groups[0]["lr"] = -0.1
    _assert_step_raises_untouched(opt, params, ValueError, "lr of param group 0")
    opt.param_groups[0]["lr"] = 1e-3
    opt.param_groups[0]["amsgrad"] = True
    _assert_step_raises_untouched(opt, params, ValueError, "amsgrad")


def _llama_params(seed=0, layers=3, h=40, inter=108, vocab=301):
    """A Llama's param list in miniature (embed, two norms and seven matrices a layer with
    grouped k, v, final norm, head): odd sizes, many small tensors."""
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (h, h), (h // 4, h), (h // 4, h), (h, h), (h,), (inter, h), (inter, h),
                   (h, inter)]
    shapes += [(h,), (vocab, h)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_llama_shaped_list_bitwise_equal_to_one_kernel_call_per_param(threads):
    """One parallel region over all params gives the bits of one adam_update per param, with
    two groups (AdamW, Adam with L2), params skipped some steps (their step counts fall
    behind) and any thread count."""
    ours, ref = _llama_params(), _llama_params()
    assert sum(p.numel() for p in ours) > 16384 * 3  # every thread count runs in parallel
    groups = [{"params": ours[::2]}, {"params": ours[1::2], "lr": 3e-3, "weight_decay": 0.1,
                                      "betas": (0.8, 0.99), "adamw_mode": False}]
    opt = CPUAdam(groups, lr=1e-3, weight_decay=0.01)
    hyper = [dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  adamw_mode=True),
             dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, adamw_mode=False)]
    state = {}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for s in range(1, 5):
            _set_grads(ours, s)
            _set_grads(ref, s)
            for i in range(s % 3, len(ours), 7):  # skipped this step
                ours[i].grad = ref[i].grad = None
            opt.step()
            for i, p in enumerate(ref):
                if p.grad is None:
                    continue
                st = state.setdefault(i, [0, torch.zeros(p.numel()), torch.zeros(p.numel())])
                st[0] += 1
                adam_update(p.detach().view(-1), p.grad.view(-1), st[1], st[2], step=st[0],
                            num_threads=1, **hyper[i % 2])
    finally:
        torch.set_num_threads(saved)
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))
        assert opt.state[p]["step"].item() == state[i][0]
        assert torch.equal(opt.state[p]["exp_avg"].view(-1), state[i][1])
        assert torch.equal(opt.state[p]["exp_avg_sq"].view(-1), state[i][2])


def test_llama_shaped_list_matches_torch():
    ours, theirs = _llama_params(), _llama_params()
    a = CPUAdam(ours, lr=1e-3, weight_decay=0.01)
    b = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01)
    _train(a, ours, 20)
    _train(b, theirs, 20)
    _close(ours, theirs, lr_max=1e-3, steps=20)


def test_params_sharing_memory_raise_before_any_state():
    flat = torch.zeros(30)
    params = [torch.nn.Parameter(flat[:20]), torch.nn.Parameter(flat[10:])]
    opt = CPUAdam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    _assert_step_raises_untouched(opt, params, ValueError,
                                  "param of parameter 0 of param group 0 and param of "
                                  "parameter 1 of param group 0 overlap")
