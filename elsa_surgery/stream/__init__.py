"""Stream-CQSA on ELSA states: exact attention for sequences that do not fit on the GPU (docs/stream.md).

``elsa_surgery.stream.attention`` splits one attention into tasks (the CQS divide or block tiles, ``divide``),
chooses their size for a memory budget (``planner``), runs them with OOM guardrails and copy/compute overlap
(``executor``), saves resumable checkpoints (``checkpoint``), shards them over ``torch.distributed`` ranks
(``distributed``) and streams the backward task by task (``backward``). Needs torch, numpy and tqdm;
``import elsa_surgery`` does not import it.
"""

from . import divide, faults, planner
from .api import StreamReport, attention, last_report

__all__ = ["attention", "last_report", "StreamReport", "divide", "faults", "planner"]
