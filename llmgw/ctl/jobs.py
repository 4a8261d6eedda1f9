"""``llmgw ctl train``, ``jobs``, ``job show|cancel`` and ``adapters [download]``: LoRA training
jobs on the nodes, and the adapters they made."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from urllib.parse import quote

from llmgw.core.reassembly import FILE_NAME
from llmgw.core.training import ADAPTER_NAME, PairsError, TrainParams, parse_pairs
from llmgw.ctl import render
from llmgw.ctl.client import AdminClient, CtlError
from llmgw.ctl.subcommand import (
    EXIT_ERROR,
    EXIT_USAGE,
    ClientFactory,
    add,
    add_json_flag,
    detail,
    listing,
    read_text,
)

TRAIN_DESCRIPTION = """\
Trains a LoRA adapter for a catalog model on one node, from question/answer
pairs, and keeps it on the server (converted to GGUF too when the model is
served by llama.cpp).

The pairs file is JSONL: one {"question": "...", "answer": "..."} per line. It is
checked here first; bad lines are reported with their numbers (exit 2) and
nothing is sent. The weights (--base-dir) are a Hugging Face style directory ON
THE NODE: config.json, tokenizer files, *.safetensors.

The job waits until the node's agent is connected and nothing else trains there.
ctl prints the job id, then follows the job with a progress bar (steps, loss,
peak memory, ETA) until it ends: exit 0 only when it Succeeded. Ctrl-C stops
following, not the job (`llmgw ctl job cancel ID` does that).
"""

TRAIN_EPILOG = """\
examples:
  llmgw ctl train --model smollm2 --node cpu-1 --base-dir /models/smollm2-hf \\
      --data pairs.jsonl --name faq-v1 --steps 50
  llmgw ctl train ... --detach && llmgw ctl jobs
"""

# How often a followed job is looked at: the agent reports progress a few times a second.
FOLLOW_INTERVAL = 0.5
ENDED = ("Succeeded", "Failed", "Cancelled")


def add_parsers(commands, client: ClientFactory) -> None:
    defaults = TrainParams()
    train = add(commands, "train", "train a LoRA adapter on a node and follow it", _train, client)
    train.description = TRAIN_DESCRIPTION
    train.epilog = TRAIN_EPILOG
    train.add_argument("--model", required=True, metavar="MODEL", help="the catalog model it is for")
    train.add_argument("--node", required=True, metavar="NODE", help="the node that trains it")
    train.add_argument(
        "--base-dir",
        required=True,
        metavar="DIR",
        help="the model's safetensors directory on the node (absolute)",
    )
    train.add_argument(
        "--data", required=True, type=Path, metavar="FILE", help="question/answer pairs, JSONL"
    )
    train.add_argument(
        "--name", required=True, metavar="ADAPTER", help="the adapter's name (a-z, 0-9, . _ -)"
    )
    train.add_argument(
        "--need-mib",
        type=int,
        default=0,
        metavar="N",
        help="MiB of one GPU the training needs; 0 trains on the CPU (default 0)",
    )
    train.add_argument("--rank", type=int, metavar="N", help=f"LoRA rank (default {defaults.rank})")
    train.add_argument("--alpha", type=int, metavar="N", help=f"LoRA alpha (default {defaults.alpha})")
    train.add_argument(
        "--target-modules",
        metavar="A,B",
        help=f"modules to adapt, comma-separated (default {','.join(defaults.target_modules)})",
    )
    train.add_argument("--steps", type=int, metavar="N", help="optimizer steps; overrides --epochs")
    train.add_argument(
        "--epochs",
        type=int,
        metavar="N",
        help=f"passes over the pairs when --steps is 0 (default {defaults.epochs})",
    )
    train.add_argument(
        "--lr", type=float, metavar="X", help=f"learning rate (default {defaults.learning_rate:g})"
    )
    train.add_argument(
        "--batch-size", type=int, metavar="N", help=f"pairs per step (default {defaults.batch_size})"
    )
    train.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help=f"tokens per pair, longer are cut (default {defaults.max_seq_len})",
    )
    train.add_argument("--seed", type=int, metavar="N", help=f"random seed (default {defaults.seed})")
    gguf = train.add_mutually_exclusive_group()
    gguf.add_argument(
        "--gguf",
        dest="gguf",
        action="store_true",
        default=None,
        help="also convert to GGUF (default: when a llama.cpp profile serves the model)",
    )
    gguf.add_argument("--no-gguf", dest="gguf", action="store_false", help="do not convert to GGUF")
    train.add_argument("--detach", action="store_true", help="print the job id and return without following")
    add_json_flag(train)

    jobs = add(commands, "jobs", "list the training jobs: state, steps, loss, why", _jobs, client)
    add_json_flag(jobs)
    job = commands.add_parser(
        "job", help="one training job: show, cancel", description="Commands about a single training job."
    )
    job_commands = job.add_subparsers(dest="job_command", metavar="COMMAND", required=True)
    show = add(
        job_commands,
        "show",
        "a job's progress, wall time per phase (queue, train, convert, upload) and log tail",
        _job_show,
        client,
    )
    show.add_argument("id", metavar="ID", help="the job's id, as `llmgw ctl jobs` lists it")
    add_json_flag(show)
    cancel = add(
        job_commands, "cancel", "cancel a job: its child on the node is stopped", _job_cancel, client
    )
    cancel.add_argument("id", metavar="ID", help="the job's id, as `llmgw ctl jobs` lists it")
    add_json_flag(cancel)

    adapters = add(commands, "adapters", "list the adapters the server keeps; download", _adapters, client)
    add_json_flag(adapters)
    adapter_commands = adapters.add_subparsers(dest="adapters_command", metavar="COMMAND")
    download = add(
        adapter_commands,
        "download",
        "download an adapter's files into a directory, checking each file's sha256",
        _adapters_download,
        client,
    )
    download.add_argument("name", metavar="NAME", help="the adapter's name, as `llmgw ctl adapters` lists it")
    download.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="DIR",
        help="where to write them (made 0700 if new)",
    )
    add_json_flag(download)


def _train(args: argparse.Namespace, client: ClientFactory) -> int:
    pairs = _read_pairs(args.data)
    if pairs is None:
        return EXIT_USAGE
    if not ADAPTER_NAME.fullmatch(args.name):
        raise CtlError(
            f"--name: {args.name!r} must be 1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
        )
    params = {
        "rank": args.rank,
        "alpha": args.alpha,
        "target_modules": None if args.target_modules is None else args.target_modules.split(","),
        "steps": args.steps,
        "epochs": args.epochs,
        "learning_rate": args.lr,
        "batch_size": args.batch_size,
        "max_seq_len": args.max_seq_len,
        "seed": args.seed,
    }
    body = {
        "model": args.model,
        "node": args.node,
        "adapter": args.name,
        "base_dir": args.base_dir,
        "need_mib": args.need_mib,
        "params": {key: value for key, value in params.items() if value is not None},
        "gguf": args.gguf,
        "pairs": pairs,
    }
    admin = client(args)
    job = admin.post("/admin/v1/jobs", body)
    if args.json and args.detach:
        render.print_json(job)
        return 0
    if not args.json:
        print(
            f"job {job['id']}: {job['state']} (adapter {job['adapter']} for {job['model']} on node {job['node']})"
        )
    if args.detach:
        return 0
    try:
        job = _follow(admin, job, quiet=args.json)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on (`llmgw ctl job show {job['id']}`)", file=sys.stderr)
        return 130
    if args.json:
        render.print_json(job)
    else:
        _print_outcome(job)
    return 0 if job["state"] == "Succeeded" else EXIT_ERROR


def _read_pairs(path: Path) -> str | None:
    """The pairs file's text, once every line parses; None after printing each bad line."""
    text = read_text(path)
    try:
        parse_pairs(text)
    except PairsError as e:
        for problem in e.problems:
            print(f"error: {path}: {problem}", file=sys.stderr)
        print(f"error: {path}: nothing was sent; fix the lines above", file=sys.stderr)
        return None
    return text


def _follow(client: AdminClient, job: dict, *, quiet: bool) -> dict:
    """Polls the job until it ends; shows a progress bar unless ``quiet``."""
    path = f"/admin/v1/jobs/{quote(job['id'], safe='')}"
    if quiet:
        while job["state"] not in ENDED:
            time.sleep(FOLLOW_INTERVAL)
            job = client.get(path)
        return job
    with render.job_progress() as progress:
        task = progress.add_task("", total=None, **render.progress_fields(job))
        while True:
            progress.update(
                task,
                total=job["total_steps"] or None,
                completed=job["step"],
                **render.progress_fields(job),
            )
            if job["state"] in ENDED:
                return job
            time.sleep(FOLLOW_INTERVAL)
            job = client.get(path)


def _print_outcome(job: dict) -> None:
    timings = job["timings"]
    split = "  ".join(f"{phase} {render.seconds_text(timings.get(phase))}" for phase in render.JOB_PHASES)
    if job["state"] == "Succeeded":
        print(
            f"job {job['id']}: Succeeded; adapter {job['adapter']} kept (peak {job['peak_mib']:,} MiB; {split})"
        )
        return
    print(f"job {job['id']}: {job['state']}: {job['reason']}", file=sys.stderr)
    for line in job.get("log_tail") or []:
        print(f"  {line}", file=sys.stderr)


def _jobs(args: argparse.Namespace, client: ClientFactory) -> int:
    empty = "no training jobs: start one with `llmgw ctl train`"
    return listing(client(args), args, "/admin/v1/jobs", "jobs", empty, render.jobs_table)


def _job_show(args: argparse.Namespace, client: ClientFactory) -> int:
    return detail(client(args), args, f"/admin/v1/jobs/{quote(args.id, safe='')}", render.render_job)


def _job_cancel(args: argparse.Namespace, client: ClientFactory) -> int:
    job = client(args).post(f"/admin/v1/jobs/{quote(args.id, safe='')}/cancel")
    if args.json:
        render.print_json(job)
    elif job["state"] == "Cancelled":
        print(f"job {job['id']}: Cancelled ({job['reason']})")
    else:
        print(f"job {job['id']}: cancelling; its node stops the child (`llmgw ctl job show {job['id']}`)")
    return 0


def _adapters(args: argparse.Namespace, client: ClientFactory) -> int:
    empty = "no adapters yet: train one with `llmgw ctl train`"
    return listing(client(args), args, "/admin/v1/adapters", "adapters", empty, render.adapters_table)


def _bare_name(name: object) -> bool:
    return isinstance(name, str) and FILE_NAME.fullmatch(name) is not None and name not in (".", "..")


def _adapters_download(args: argparse.Namespace, client: ClientFactory) -> int:
    admin = client(args)
    adapters = admin.get("/admin/v1/adapters")["adapters"]
    adapter = next((a for a in adapters if a["name"] == args.name), None)
    if adapter is None:
        raise CtlError(f'no adapter "{args.name}" (see `llmgw ctl adapters`)')
    out: Path = args.output
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise CtlError(f"cannot make {out}: {e.strerror}") from None
    # Each name becomes a path under the directory: a bare file name, as the server accepts from
    # agents (core.reassembly), or nothing is written — a listing naming "../x" is not followed.
    bad = [f.get("name") for f in adapter["files"] if not _bare_name(f.get("name"))]
    if bad:
        raise CtlError(f'adapter "{args.name}": the server lists files that are not bare file names: {bad!r}')
    written = []
    for f in adapter["files"]:
        dest = out / f["name"]
        path = f"/admin/v1/adapters/{quote(args.name, safe='')}/files/{quote(f['name'], safe='')}"
        size, sha256 = admin.download(path, dest)
        if (size, sha256) != (f["size"], f["sha256"]):
            os.unlink(dest)
            raise CtlError(
                f"{f['name']}: got {size} bytes with sha256 {sha256}, the server lists {f['size']} bytes "
                f"with {f['sha256']}; the file was removed"
            )
        written.append({**f, "path": str(dest)})
        if not args.json:
            print(f"{dest}: {render.size_text(size)}, sha256 ok")
    if args.json:
        render.print_json({"adapter": args.name, "files": written})
    return 0
