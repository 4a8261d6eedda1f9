"""One training job's run on its node, as decisions; the agent's trainer is the shell around them.

What is decided here: where each file of a job lives, what the child is started with (argv,
environment, child.json), how its stdout events fold into progress and how often that progress
goes to the server, what its end means (finished, or failed and why), whether an adopted job can
go on, and how long an upload may take. Paths are only joined here, never opened.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from llmgw.core.exits import describe_exit
from llmgw.core.training import FileDigest, TrainSpec

# The child as the agent ships it, and as each job's run/ holds a copy of it.
CHILD_SCRIPT = "train_child.py"
# Progress inside Training goes to the server at most this often: a tiny model makes many steps
# a second, and the operator's progress bar needs no more.
PROGRESS_INTERVAL = 0.25
# An upload waits this long for the link to be up before the job fails.
UPLOAD_WAIT = 300.0
# A slow link still moves a megabyte a second; beyond that, the link is the problem.
UPLOAD_BYTES_PER_SECOND = 2**20


# --- the job's directory -----------------------------------------------------------------------


@attrs.frozen
class JobLayout:
    """Where a job's files are, under its directory ``<work_dir>/jobs/<job_id>``.

    The directory itself and the files root acts on (the state file, the child's and the
    converter's output) are root's; ``run/`` is the engines' user's, the child's own.
    """

    directory: Path

    @property
    def events(self) -> Path:
        """The child's stdout: its events, one JSON object a line."""
        return self.directory / "child.out"

    @property
    def log(self) -> Path:
        """The child's stderr."""
        return self.directory / "child.err"

    @property
    def convert_log(self) -> Path:
        return self.directory / "convert.out"

    @property
    def run_dir(self) -> Path:
        return self.directory / "run"

    @property
    def out_dir(self) -> Path:
        """What the child makes: the adapter's files, and its GGUF conversion."""
        return self.run_dir / "out"

    @property
    def child_script(self) -> Path:
        return self.run_dir / CHILD_SCRIPT

    @property
    def child_config(self) -> Path:
        return self.run_dir / "child.json"

    @property
    def pairs(self) -> Path:
        return self.run_dir / "pairs.jsonl"

    def child_inputs(self) -> tuple[Path, ...]:
        """The files the agent writes into ``run/`` for the child (handed to the engines' user)."""
        return (self.child_script, self.pairs, self.child_config)


# --- the child's inputs ------------------------------------------------------------------------


def child_argv(python: str, layout: JobLayout) -> list[str]:
    return [python, str(layout.child_script), str(layout.child_config)]


def child_environment(
    base: Mapping[str, str], *, threads: int, gpu_index: int | None, pythonpath: str
) -> dict[str, str]:
    """The child's environment: ``base`` (the engines' user's), then what training needs."""
    return {
        **base,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        # The chosen card only, counted as NVML counts them (as for engines).
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "" if gpu_index is None else str(gpu_index),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Weights come from base_dir; a node that reaches the hub must not fetch anything.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **({"PYTHONPATH": pythonpath} if pythonpath else {}),
    }


def child_config(spec: TrainSpec, layout: JobLayout, device: str) -> str:
    """child.json: what train_child.py reads (it imports nothing of llmgw, so plain JSON)."""
    params = attrs.asdict(spec.params)
    config = {
        "base_dir": spec.base_dir,
        "pairs_path": str(layout.pairs),
        "output_dir": str(layout.out_dir),
        "device": device,
        "params": {**params, "target_modules": list(spec.params.target_modules)},
    }
    return json.dumps(config, indent=1)


# --- the child's events ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Progress:
    """What the child has said so far (its stdout protocol, folded)."""

    total_steps: int = 0
    step: int = 0
    loss: float | None = None
    peak_mib: int = 0
    done: bool = False
    files: tuple[str, ...] = ()
    error: str = ""


def apply_event(progress: Progress, line: str) -> Progress:
    """The progress after one stdout line. A line that is not an event (stray library output)
    changes nothing: the protocol says stdout holds only events, but a library may disagree."""
    try:
        event = json.loads(line)
    except ValueError:
        return progress
    if not isinstance(event, dict):
        return progress
    match event.get("event"):
        case "start":
            return attrs.evolve(progress, total_steps=_int(event.get("total_steps"), progress.total_steps))
        case "step":
            loss = event.get("loss")
            return attrs.evolve(
                progress,
                step=_int(event.get("step"), progress.step),
                total_steps=_int(event.get("total_steps"), progress.total_steps),
                loss=float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) else None,
                peak_mib=max(progress.peak_mib, _int(event.get("peak_mib"), 0)),
            )
        case "done":
            files = event.get("files")
            names = tuple(f for f in files if isinstance(f, str)) if isinstance(files, list) else ()
            return attrs.evolve(
                progress,
                done=True,
                files=names,
                peak_mib=max(progress.peak_mib, _int(event.get("peak_mib"), 0)),
            )
        case "error":
            message = str(event.get("message") or "the child reported an error")
            return attrs.evolve(progress, error=" ".join(message.split())[:500])
    return progress


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def progress_due(last_sent: float | None, now: float, interval: float = PROGRESS_INTERVAL) -> bool:
    """Whether a progress status may go now (state changes always go)."""
    return last_sent is None or now - last_sent >= interval


# --- the child's end ---------------------------------------------------------------------------


def training_failure(progress: Progress, exit_status: int | None) -> str:
    """Why the job fails now that its child has ended; "" when it finished.

    ``exit_status`` is None for an adopted child, whose status only its parent (gone) could read.
    What the child said beats how it exited: its error names the cause, a signal only the end.
    """
    if progress.error:
        return f"training failed: {progress.error}"
    if exit_status not in (0, None):
        return f"the training child {describe_exit(exit_status)}"
    if not progress.done:
        how = "exited" if exit_status is None else describe_exit(exit_status)
        return f"the training child {how} without reporting done"
    return ""


def adoption_problem(progress: Progress, *, child_alive: bool) -> str:
    """Whether a job an earlier agent left can go on: "" when it can, else why not.

    A child still running is followed again; one that finished while no agent ran goes on to
    conversion and upload; anything else is lost.
    """
    if child_alive or (progress.done and not progress.error):
        return ""
    return "the training child exited while the agent was down, without reporting done"


def upload_time_limit(files: Sequence[FileDigest]) -> float:
    """How long sending ``files`` may take, waiting for the link included."""
    return UPLOAD_WAIT + sum(f.size for f in files) / UPLOAD_BYTES_PER_SECOND
