"""Which context-parallel strategy to use: a cost model, machine descriptions and the choice.

For a problem (shapes, dtype, mask, documents, training / forward / decode) and a machine (ranks,
links, kernel throughput, memory), `predict` gives every candidate's time per call, bytes sent
per rank and peak memory per rank, and `plan` ranks them and explains the first in one line.

    model       Machine, Link, Problem, Candidate, Prediction; PRESETS and machine()
    work        each rank's tokens and heads, the kernel work per ring step (from the schedule)
    memory      the bytes a call allocates per rank (memory())
    predict     the time model: candidates, predict, rank, explain, plan, table
    documents   packed documents' shardings (cpattn.shard_documents): predict_documents,
                plan_documents
    calibrate   calibrate(group): this group measured, cached to a file
    choose      strategy="auto": set_machine, machine_for, choose
    plot        plots of the model (needs matplotlib; not imported here)

Machines: `calibrate(group)` measures this group (seconds, cached to a file, identical on every
rank), `PRESETS` hold published / nominal figures (marked as such in `Machine.source`).
No initialised process group is needed except by `calibrate` and `choose`.

The submodules memory, predict, calibrate and choose are named like the functions they define:
here (cpattn.plan.memory and so on) the names are the functions.
"""

from cpattn.plan.calibrate import calibrate
from cpattn.plan.choose import choose, machine_for, set_machine
from cpattn.plan.documents import plan_documents, predict_documents
from cpattn.plan.memory import memory
from cpattn.plan.model import (
    MODES,
    PRESETS,
    Candidate,
    Link,
    Machine,
    Prediction,
    Problem,
    machine,
)
from cpattn.plan.predict import (
    candidates,
    explain,
    plan,
    predict,
    rank,
    table,
)
from cpattn.plan.work import allgather_chunk

__all__ = [
    "MODES",
    "PRESETS",
    "Candidate",
    "Link",
    "Machine",
    "Prediction",
    "Problem",
    "allgather_chunk",
    "calibrate",
    "candidates",
    "choose",
    "explain",
    "machine",
    "machine_for",
    "memory",
    "plan",
    "plan_documents",
    "predict",
    "predict_documents",
    "rank",
    "set_machine",
    "table",
]
