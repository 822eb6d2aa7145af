"""The engine's places in autograd and in the model: its grad hooks, the end of a
backward, and the waits for new params before a module's forward.

Grad hooks reach the engine through a weak reference. The params hold their hooks in C++,
where Python's cycle collector cannot see a param -> hook -> engine -> param cycle, so a bound
method there kept every engine (device params, pinned pool, threads) alive for good; a
finalizer removes the hooks when the engine goes.

The end of a backward: a grad hook inside reentrant activation checkpointing runs in a nested
backward (one per checkpointed block, started by the block's autograd Function). A callback
queued there fires at the end of that block, and partial buckets would be flushed once per
block (a second landing: the fp32 accumulation path, and with N ranks a reduce-scatter of
every bucket per block). So the callback is queued only where no Function's backward is
running; else a post hook on that Function's node (it runs in the enclosing backward, once
the node is done) tries again from there (docs/design.md, "What changes under the engine").
"""

from __future__ import annotations

import sys
import weakref

from torch.autograd import Variable
from torch.autograd.function import BackwardCFunction

_APPLY = BackwardCFunction.apply.__code__


def register_grad_hooks(owner, method: str, params) -> list:
    """``getattr(owner, method)(param)`` after each param's gradient is accumulated, for as
    long as ``owner`` lives."""
    ref = weakref.ref(owner)

    def hook(p):
        alive = ref()
        if alive is not None:
            getattr(alive, method)(p)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    weakref.finalize(owner, _remove, handles)
    return handles


def register_module_waits(owner, method: str, model, params) -> list:
    """``getattr(owner, method)(module)`` before the forward and the ``state_dict`` of
    each module of ``model`` that holds one of ``params`` directly, for as long as
    ``owner`` lives; ``getattr(owner, method)(None)`` after ``model``'s own forward."""
    ref = weakref.ref(owner)
    mine = {id(p) for p in params}

    def call(module):
        alive = ref()
        if alive is not None:
            getattr(alive, method)(module)

    handles = []
    for m in model.modules():
        if any(id(p) in mine for p in m.parameters(recurse=False)):
            handles.append(m.register_forward_pre_hook(lambda mod, args: call(mod)))
            handles.append(m.register_state_dict_pre_hook(lambda mod, *a: call(mod)))
    handles.append(model.register_forward_hook(lambda mod, args, out: call(None)))
    weakref.finalize(owner, _remove, handles)
    return handles


class ModuleWaits:
    """Params that are uploaded: before each module's forward (and ``state_dict``) the
    device waits for the buckets of that module's own params, not for every upload, so the
    first layers compute while the last ones still upload (docs/design.md, "Bucket order").
    After the model's forward (``module`` None) it waits for every upload still pending."""

    def __init__(self, copier):
        self.copier = copier
        self.follow([])

    def follow(self, buckets) -> None:
        """The buckets after a (re-)layout."""
        self._bucket_of = {s.param: b.layout.index for b in buckets for s in b.layout.slots}
        self._keys: dict = {}  # module -> the buckets of its params, found on first use

    def before(self, module) -> None:
        if module is None:
            self.copier.finish_uploads()
            return
        keys = self._keys.get(module)
        if keys is None:
            keys = self._keys[module] = sorted({self._bucket_of[p] for p in
                                                module.parameters(recurse=False)
                                                if p in self._bucket_of})
        self.copier.wait_ready(keys)


def _remove(handles) -> None:
    for h in handles:
        h.remove()


def enclosing_backward_node():
    """The autograd Function node whose backward is running on this thread's stack (the
    innermost), or None. Inside it, a backward runs nested in the enclosing one: this is
    how reentrant activation checkpointing (``use_reentrant=True``) computes each block's
    gradients. Read from the Python frames: ``BackwardCFunction.apply`` is the Python entry
    of every Function's backward, with the node as ``self``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY:
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def queue_at_backward_end(callback) -> None:
    """Run ``callback`` once, when the outermost backward running now ends."""
    node = enclosing_backward_node()
    if node is None:
        Variable._execution_engine.queue_callback(callback)
    else:
        node.register_hook(lambda *_grads: queue_at_backward_end(callback))
