"""LocalTensor's own errors in a simulated session (``fuzz --simulate``): set aside, unshrunk.

A simulated case (kernel/simulated.py: every rank of a case in one process, under LocalTensorMode) may end
in an error LocalTensor itself raises where a real rank could not (``LOCAL_TENSOR_ERRORS``). The session's
book (``SimulatedBook``) neither confirms nor shrinks such a case; it keeps the smallest, and real
processes judge it at the session's end (life.confirm_on_real, real.confirm_set_aside)."""
from __future__ import annotations

from .life import FindingBook, smaller_case


# Errors LocalTensor itself raises where a real rank could not: a simulated
# case that ends in one is no finding of the kind a real run gives, so the
# session neither confirms it in fresh simulated workers nor shrinks it (a
# minute or more of simulated cases, for a file the real check then sets
# apart): its smallest case goes straight to the real-process check at the
# session's end (life.confirm_on_real(set_aside=...)), which stays the judge; one of more
# ranks than run for real here is first tried on 1-D worlds of at most
# REAL_MAX ranks, simulated, and checked at the largest that fails the same.
# Each: what the message holds, what the traceback holds, why (docs/simulate.md):
LOCAL_TENSOR_ERRORS = (  # (the message holds, the traceback holds or "", why)
    # _local_tensor's _combine_any_rank_results: an op's result other than a tensor or an int differs between
    # the simulated ranks. Seen: Adafactor's p.norm(2).item() where the norm is Partial (a float per rank), and
    # torch.chunk of a LocalTensor whose ranks hold shards of different lengths (lists of different lengths)
    ("Non Tensor or int rank results must be equal for all ranks", "",
     "an op's non-tensor, non-int results differ between the simulated ranks (a float from .item(), a list of "
     "another length per rank): LocalTensor carries per-rank tensors and ints only"),
    # the same lists of different lengths where rank 0's is the longer: the shorter ranks' missing entries are
    # None, and LocalTensor({rank: tensor or None}) asks None for requires_grad
    ("'NoneType' object has no attribute 'requires_grad'", "_combine_any_rank_results",
     "an op returned lists of different lengths on the simulated ranks (torch.chunk of shards of different "
     "lengths): LocalTensor pads the shorter with None and cannot make a LocalTensor of them"),
    # a per-rank size (LocalIntNode, a SymInt's node) asked what only a symbolic shape answers: indexing with a
    # boolean mask whose length differs between the ranks (MaskPartial's buffer over uneven shards)
    ("'torch._C._SymNode' object has no attribute", "",
     "a per-rank size (LocalIntNode) lacks a SymNode method torch asks of it (statically_known_true, ...)"),
)


def local_tensor_error(verdict) -> str | None:
    """Why a simulated verdict ended in one of LocalTensor's own errors (LOCAL_TENSOR_ERRORS), or None."""
    if not verdict.is_finding or verdict.error is None:
        return None
    e = verdict.error_record
    message, where = e.message or "", e.traceback or ""
    return next((why for text, frame, why in LOCAL_TENSOR_ERRORS if text in message and frame in where), None)



class SimulatedBook(FindingBook):
    """fuzz --simulate's book (session/simulate.py's SimulatedSession keeps it): LocalTensor's own errors
    (``LOCAL_TENSOR_ERRORS``) set aside, unshrunk, for the real-process check at the session's end
    (``life.confirm_on_real(set_aside=book.set_aside)``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_aside: dict = {}  # signature -> (its smallest case, verdict, why, hits)

    def accept(self, sig: str, case, verdict) -> bool:
        why = local_tensor_error(verdict)
        held = self.set_aside.get(sig)
        if why is None or sig in self.tracks:
            return super().accept(sig, case, verdict)
        if held is None:
            self._say(f"{sig}: LocalTensor's own error ({why}): not shrunk, set aside for the real-process "
                      f"check at the session's end")
        hits = held[3] + 1 if held else 1
        best = (case, verdict) if held is None or smaller_case(case, held[0]) else held[:2]
        self.set_aside[sig] = (*best, why, hits)
        return False
