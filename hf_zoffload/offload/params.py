"""The params as the model has them: what may have changed under the engine between steps.

`check_unmoved` refuses params moved or recast after the engine was built (``model.cuda()``,
``model.half()``, the Trainer with ``place_model_on_device=False``), before any work.
`ParamWatch` sees weights put into the params from outside since the engine last wrote them
(by version counter or storage), which then become those params' master weights, so the next
upload does not bring the stale masters back. The rules, and what is not seen: see
docs/design.md, "What changes under the engine".
"""

from __future__ import annotations

import torch

from .state import Bucket


def _slots(buckets: list[Bucket]):
    return (s for b in buckets for s in b.layout.slots)


def check_unmoved(buckets: list[Bucket], device: torch.device, dtype: torch.dtype) -> None:
    for s in _slots(buckets):
        p = s.param
        if p.device != device or p.dtype != dtype:
            raise RuntimeError(
                f"param {s.index} is now {p.dtype} on {p.device}, but the ZeRO-Offload "
                f"optimizer was built for {dtype} params on {device}: build the optimizer "
                "after moving the model to its device (and let the optimizer cast it to the "
                "compute dtype)")


class ParamWatch:
    """Each param's version counter and storage as the engine last left them."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self.note_written()

    def note_written(self) -> None:
        """After the engine wrote the params (uploads, a loaded checkpoint)."""
        self._seen = {s.index: self._mark(s) for s in _slots(self.buckets)}

    @staticmethod
    def _mark(s):  # the local tensor: a DTensor wrapper has no storage of its own
        t = s.local()
        return t._version, t.data_ptr()

    def edited(self) -> set[int]:
        return {s.index for s in _slots(self.buckets) if self._mark(s) != self._seen[s.index]}

    def adopt_edits(self, *, update_in_flight: bool) -> None:
        """Edited params' values become their masters."""
        edited = self.edited()
        if not edited:
            return
        if update_in_flight:
            raise RuntimeError(
                f"{len(edited)} param(s) were changed from outside while a delayed update was "
                "in flight; it would overwrite them. Call optimizer.flush() before loading "
                "weights into the model")
        for b in self.buckets:
            for s in b.layout.slots:
                if s.index in edited:
                    own, mine = b.layout.owned(s)
                    new = s.flat()[mine]
                    b.state.master[own].copy_(new)
        self.note_written()
