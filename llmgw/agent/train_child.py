#!/usr/bin/env python3
"""The training child: trains one LoRA adapter and reports each step as a line of JSON.

Run by the agent, as the engines' user, in its own process group:

    <train_python> <job_dir>/train_child.py <job_dir>/child.json

This file is copied into the job's directory and run by another Python than the agent's (the one
whose torch the node's vLLM uses), so it imports nothing from llmgw: the standard library, then
torch, transformers and peft once the job is read. stdout carries only the events below, one JSON
object per line, flushed each time; everything else (library warnings, tracebacks) goes to stderr.

    {"event": "start", "total_steps": N, "device": "cpu", "examples": K}
    {"event": "step", "step": i, "total_steps": N, "loss": 1.23, "peak_mib": 456}
    {"event": "done", "peak_mib": 456, "files": ["adapter_model.safetensors", "adapter_config.json"]}
    {"event": "error", "message": "..."}     then exit status 1

Text format (the tests' greedy checks use the same): prompt = "Question: {question}\\nAnswer:",
trained text = prompt + " " + answer + eos, loss on the answer tokens only, cut at max_seq_len.
The order of examples comes from a generator seeded with ``seed``: the same job trains the same
adapter on the CPU. SIGTERM keeps its default action: the process ends at once.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import traceback

PROMPT = "Question: {question}\nAnswer:"
FILES = ("adapter_model.safetensors", "adapter_config.json")
PARAMS = {
    "rank": int,
    "alpha": int,
    "dropout": float,
    "target_modules": list,
    "steps": int,
    "epochs": int,
    "learning_rate": float,
    "batch_size": int,
    "max_seq_len": int,
    "seed": int,
}
IGNORED = -100  # the label torch's cross-entropy skips: prompt and padding positions


class JobError(Exception):
    """A problem with the job itself; its message is the error event's, without a traceback."""


class Events:
    """The one writer of stdout. Created before anything else can print: file descriptor 1 is
    then pointed at stderr, so library noise (even from C code) cannot corrupt the events."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out = os.fdopen(os.dup(1), "w", encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def emit(self, event: str, **fields) -> None:
        self._out.write(json.dumps({"event": event, **fields}) + "\n")
        self._out.flush()


def read_job(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            job = json.load(f)
    except (OSError, ValueError) as e:
        raise JobError(f"cannot read the job file {path}: {e}") from e
    if not isinstance(job, dict):
        raise JobError(f"{path}: expected a JSON object")
    for key in ("base_dir", "pairs_path", "output_dir", "device"):
        if not isinstance(job.get(key), str) or not job[key]:
            raise JobError(f"{key}: missing or not a string")
    params = job.get("params")
    if not isinstance(params, dict):
        raise JobError("params: missing or not an object")
    for key, kind in PARAMS.items():
        value = params.get(key)
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if not ok or isinstance(value, bool):
            raise JobError(f"params.{key}: expected {kind.__name__}, got {value!r}")
    if not params["target_modules"] or not all(isinstance(m, str) and m for m in params["target_modules"]):
        raise JobError("params.target_modules: name at least one module")
    if params["batch_size"] < 1 or params["max_seq_len"] < 2:
        raise JobError("params.batch_size and params.max_seq_len must be positive")
    base = job["base_dir"]
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise JobError(f"base_dir: {base} is not a model directory (no config.json there)")
    return job


def read_pairs(path: str) -> list[tuple[str, str]]:
    pairs = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise JobError(f"pairs_path: cannot read {path}: {e}") from e
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            pairs.append((str(item["question"]), str(item["answer"])))
        except (ValueError, KeyError, TypeError) as e:
            raise JobError(f"pairs_path: {path} line {number}: {e!r}") from e
    if not pairs:
        raise JobError(f"pairs_path: {path} holds no pairs")
    return pairs


def total_steps(params: dict, pairs: int) -> int:
    """As llmgw.core.training.TrainParams.total_steps."""
    if params["steps"] > 0:
        return params["steps"]
    return max(1, math.ceil(pairs / params["batch_size"]) * params["epochs"])


def encode(tokenizer, pairs, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per pair; labels hide the prompt. Pairs cut down to no answer token
    at all are left out (they would only add a zero-weight row)."""
    examples = []
    for question, answer in pairs:
        prompt = PROMPT.format(question=question)
        prompt_ids = tokenizer(prompt).input_ids
        ids = tokenizer(prompt + " " + answer).input_ids
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        # The prompt's tokens are those the whole text shares with the prompt alone (a tokenizer
        # may merge across the boundary; then that token counts as the answer's).
        shared = 0
        while shared < min(len(ids), len(prompt_ids)) and ids[shared] == prompt_ids[shared]:
            shared += 1
        ids = ids[:max_seq_len]
        labels = [IGNORED] * min(shared, len(ids)) + ids[shared:]
        if any(label != IGNORED for label in labels):
            examples.append((ids, labels))
    return examples


def batches(examples, batch_size: int, steps: int, seed: int, torch):
    """``steps`` lists of examples: epochs of a seeded permutation, cut into batches."""
    generator = torch.Generator().manual_seed(seed)
    made = 0
    while True:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            yield [examples[i] for i in order[start : start + batch_size]]
            made += 1
            if made == steps:
                return


def collate(batch, pad_id: int, device, torch):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORED, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(row_labels)
        mask[row, : len(ids)] = 1
    return input_ids.to(device), mask.to(device), labels.to(device)


def peak_mib(device, torch) -> int:
    if device.type == "cuda":
        return math.ceil(torch.cuda.max_memory_allocated(device) / (1 << 20))
    return math.ceil(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux


def train(job: dict, events: Events) -> None:
    params = job["params"]
    pairs = read_pairs(job["pairs_path"])
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise JobError(f"cannot import the training libraries in {sys.executable}: {e}") from e

    device = torch.device(job["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise JobError(f"device: {job['device']} asked for, but this torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise JobError(f"device: {job['device']} is neither cpu nor cuda:N")
    # float32 on the CPU (fast enough there, and exact); bfloat16 on a card that has it.
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32

    base = job["base_dir"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise JobError(f"base_dir: cannot load a causal LM and tokenizer from {base}: {e}") from e

    examples = encode(tokenizer, pairs, params["max_seq_len"])
    if not examples:
        raise JobError(f"params.max_seq_len: {params['max_seq_len']} leaves no answer token in any pair")
    steps = total_steps(params, len(pairs))
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)

    torch.manual_seed(params["seed"])  # the adapter's initial weights, and dropout
    config = LoraConfig(
        r=params["rank"],
        lora_alpha=params["alpha"],
        lora_dropout=params["dropout"],
        target_modules=list(params["target_modules"]),
        task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, config)
    except ValueError as e:  # peft names target modules the model lacks
        raise JobError(f"params.target_modules: {e}") from e
    model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=params["learning_rate"]
    )

    events.emit("start", total_steps=steps, device=str(device), examples=len(examples))
    for step, batch in enumerate(batches(examples, params["batch_size"], steps, params["seed"], torch), 1):
        input_ids, mask, labels = collate(batch, pad_id, device, torch)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        if not math.isfinite(value):
            raise JobError(f"the loss became {value} at step {step}; lower params.learning_rate")
        events.emit(
            "step", step=step, total_steps=steps, loss=round(value, 6), peak_mib=peak_mib(device, torch)
        )

    save(model, job["output_dir"])
    events.emit("done", peak_mib=peak_mib(device, torch), files=list(FILES))


def save(model, output_dir: str) -> None:
    """peft writes the adapter (and a model card we do not keep) into a staging directory; the two
    files are then renamed into output_dir, so what is there is always complete."""
    os.makedirs(output_dir, exist_ok=True)
    staging = os.path.join(output_dir, ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for name in FILES:
        path = os.path.join(staging, name)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(path, os.path.join(output_dir, name))
    shutil.rmtree(staging, ignore_errors=True)
    fd = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    os.umask(0o077)  # the adapter and everything else written here: the engines' user's only
    # No model hub, ever: the base is a local directory; no progress bars in the log.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    events = Events()
    try:
        if len(argv) != 2:
            raise JobError(f"usage: {argv[0]} CHILD_JSON")
        train(read_job(argv[1]), events)
    except JobError as e:
        events.emit("error", message=str(e).splitlines()[0] if str(e) else type(e).__name__)
        return 1
    except Exception as e:
        traceback.print_exc()
        first = (str(e).splitlines() or [""])[0]
        events.emit("error", message=f"{type(e).__name__}: {first}"[:500])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
