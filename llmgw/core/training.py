"""LoRA training jobs: what an operator asks for, and what travels to the node that trains.

A job trains one adapter for one catalog model, on one node, from question/answer pairs. The
pairs are checked here, line by line, before anything is sent: a bad line is refused with its
number, so the operator fixes the file instead of reading a child's traceback.

Everything here is frozen attrs over plain values, so cattrs carries it on the link and into the
store without hooks. No torch: the child that trains is the only importer of it.
"""

from __future__ import annotations

import enum
import json
import re

import attrs

from llmgw.core.states import Lifecycle

frozen = attrs.frozen(kw_only=True)


class JobState(enum.StrEnum):
    """A job's life. Terminal states never change again (the strings are what travels and is stored)."""

    PENDING = "Pending"  # in the store, waiting for its node (connected, nothing else training)
    SENT = "Sent"  # StartJob sent, the agent has not reported yet
    TRAINING = "Training"  # the child runs
    CONVERTING = "Converting"  # the adapter is being converted to GGUF
    UPLOADING = "Uploading"  # the files travel back to the server in pieces
    SUCCEEDED = "Succeeded"  # files verified and kept; the adapter is registered
    FAILED = "Failed"  # see reason
    CANCELLED = "Cancelled"  # by the operator


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = frozenset({JobState.SENT, JobState.TRAINING, JobState.CONVERTING, JobState.UPLOADING})

_JOB_ENDS = (JobState.FAILED, JobState.CANCELLED)
# Both sides move a job only through this table: the server its record (core.jobs), the agent
# what it reports (agent.trainer), whose moves are a part of these. Forward only, skipping a state
# as a report may (a Register lists the state the job has reached; conversion happens only for
# llama.cpp), Failed or Cancelled from any state before the end; Succeeded only from Uploading,
# once the server verified the files. Sent → Pending: StartJob never left.
JOB_LIFECYCLE = Lifecycle.of(
    "job",
    JobState,
    {
        JobState.PENDING: {JobState.SENT, JobState.CANCELLED},
        JobState.SENT: {
            JobState.PENDING,
            JobState.TRAINING,
            JobState.CONVERTING,
            JobState.UPLOADING,
            *_JOB_ENDS,
        },
        JobState.TRAINING: {JobState.CONVERTING, JobState.UPLOADING, *_JOB_ENDS},
        JobState.CONVERTING: {JobState.UPLOADING, *_JOB_ENDS},
        JobState.UPLOADING: {JobState.SUCCEEDED, *_JOB_ENDS},
        JobState.SUCCEEDED: (),
        JobState.FAILED: (),
        JobState.CANCELLED: (),
    },
)

# Modules a Llama-style model names its attention projections; peft matches these by suffix.
DEFAULT_TARGET_MODULES = ("q_proj", "v_proj")
# An adapter name becomes a file name on nodes and in the store, and a model name clients ask for.
ADAPTER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# What a job makes: peft's two files, and the GGUF conversion when the model is served by llama.cpp.
# (train_child.py, which imports nothing of llmgw, names the first two itself.)
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
GGUF_FILE = "adapter.gguf"
# Pairs travel inside one link message (bounded at 8 MiB); a training file larger than this
# belongs on the node's disk, not in a message.
MAX_PAIRS_BYTES = 4 * 1024 * 1024


@frozen
class TrainParams:
    """Hyper-parameters, with the defaults a first adapter should use."""

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    # Exactly one of the two decides the length: steps when > 0, else epochs over the pairs.
    steps: int = 0
    epochs: int = 3
    learning_rate: float = 2e-4
    batch_size: int = 4
    max_seq_len: int = 512
    seed: int = 0

    def problems(self) -> list[str]:
        """Each bad value, named: empty when the parameters can be used."""
        out = []
        if not 1 <= self.rank <= 1024:
            out.append(f"rank: must be 1..1024, got {self.rank}")
        if self.alpha < 1:
            out.append(f"alpha: must be at least 1, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules or any(not m.strip() for m in self.target_modules):
            out.append("target_modules: name at least one module, none empty")
        if self.steps < 0:
            out.append(f"steps: must be 0 (use epochs) or more, got {self.steps}")
        if self.steps == 0 and self.epochs < 1:
            out.append(f"epochs: must be at least 1 when steps is 0, got {self.epochs}")
        if not 0.0 < self.learning_rate <= 1.0:
            out.append(f"learning_rate: must be in (0, 1], got {self.learning_rate}")
        if self.batch_size < 1:
            out.append(f"batch_size: must be at least 1, got {self.batch_size}")
        if not 16 <= self.max_seq_len <= 1 << 17:
            out.append(f"max_seq_len: must be 16..131072, got {self.max_seq_len}")
        return out

    def total_steps(self, pairs: int) -> int:
        if self.steps > 0:
            return self.steps
        per_epoch = -(-pairs // self.batch_size)
        return max(1, per_epoch * self.epochs)


@frozen
class QaPair:
    question: str
    answer: str


class PairsError(ValueError):
    """The pairs file has bad lines; ``problems`` names each one by its line number."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        super().__init__(shown + more)


def lora_rank(config: object) -> int | None:
    """The highest rank in a peft ``adapter_config.json`` (decoded): its ``r``, or a larger one
    its ``rank_pattern`` gives some modules; None when it says none."""
    if not isinstance(config, dict):
        return None
    ranks = [config.get("r")]
    pattern = config.get("rank_pattern")
    if isinstance(pattern, dict):
        ranks += list(pattern.values())
    found = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r > 0]
    return max(found) if found else None


def parse_pairs(text: str) -> tuple[QaPair, ...]:
    """One JSON object per line: {"question": "...", "answer": "..."}. Blank lines are skipped.

    Raises PairsError naming every bad line (1-based), so one pass shows all that needs fixing.
    """
    if len(text.encode()) > MAX_PAIRS_BYTES:
        raise PairsError([f"the file is larger than {MAX_PAIRS_BYTES // (1024 * 1024)} MiB"])
    pairs: list[QaPair] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg})")
            continue
        if not isinstance(item, dict):
            problems.append(f"line {number}: expected an object with question and answer")
            continue
        bad = [
            key
            for key in ("question", "answer")
            if not isinstance(item.get(key), str) or not item[key].strip()
        ]
        if bad:
            problems.append(f"line {number}: {' and '.join(bad)} must be a non-empty string")
            continue
        extra = sorted(set(item) - {"question", "answer"})
        if extra:
            problems.append(f"line {number}: unknown field {', '.join(extra)}")
            continue
        pairs.append(QaPair(question=item["question"], answer=item["answer"]))
    if not problems and not pairs:
        problems.append("the file holds no pairs")
    if problems:
        raise PairsError(problems)
    return tuple(pairs)


def dump_pairs(pairs: tuple[QaPair, ...]) -> str:
    """The JSONL form parse_pairs reads (what the agent writes for the child)."""
    return "".join(
        json.dumps({"question": p.question, "answer": p.answer}, ensure_ascii=False) + "\n" for p in pairs
    )


@frozen
class TrainSpec:
    """What the node needs to run a job. Holds no secret; the agent keeps it on disk."""

    job_id: str
    model: str  # the catalog model the adapter is for
    adapter: str  # the adapter's name (ADAPTER_NAME)
    base_dir: str  # Hugging Face style weights directory on the node
    need_mib: int = 0  # memory of one card the job needs; 0 = train on the CPU
    params: TrainParams = attrs.field(factory=TrainParams)
    # Convert the adapter to GGUF (the model is served by llama.cpp).
    gguf: bool = False
    pairs: tuple[QaPair, ...] = ()


@frozen
class FileDigest:
    """One output file of a job, as the agent announces it before sending its pieces."""

    name: str  # a bare file name: adapter_model.safetensors, adapter_config.json, adapter.gguf
    size: int
    sha256: str  # hex
