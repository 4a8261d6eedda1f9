"""A stand-in for llmgw/agent/train_child.py: the same stdout protocol, no torch.

Standard library only (it runs as the unprivileged engine user under /usr/bin/python3). Its
behaviour comes from <base_dir>/knobs.json, since the base directory is the one thing of a job
the test chooses freely:

    {"fail_at": 3,             # at step 3: an "error" event and exit 1
     "crash_at": 3,            # at step 3: exit 3 without a word
     "hold_at": 2,             # before step 2: wait until <base_dir>/release exists
     "ignore_sigterm": true,
     "fork_helper": true,      # a grandchild in the same process group that sleeps
     "sizes": {"adapter_model.safetensors": 1300000}}

Every step is announced; the output files hold bytes derived from the seed.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def emit(**event):
    print(json.dumps(event), flush=True)


def main():
    config = json.loads(Path(sys.argv[1]).read_text())
    base = Path(config["base_dir"])
    knobs = json.loads((base / "knobs.json").read_text()) if (base / "knobs.json").exists() else {}
    params = config["params"]
    pairs = Path(config["pairs_path"]).read_text().splitlines()
    print(f"fake child: uid {os.getuid()} cwd {os.getcwd()} pairs {len(pairs)}", file=sys.stderr, flush=True)
    print(f"fake child: env {sorted(os.environ)}", file=sys.stderr, flush=True)
    if knobs.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if knobs.get("fork_helper") and os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    steps = params["steps"] or max(1, -(-len(pairs) // params["batch_size"]) * params["epochs"])
    emit(event="start", total_steps=steps, device=config["device"], examples=len(pairs))
    for step in range(1, steps + 1):
        if step == knobs.get("hold_at"):
            print(f"fake child: holding before step {step}", file=sys.stderr, flush=True)
            while not (base / "release").exists():
                time.sleep(0.01)
        if step == knobs.get("fail_at"):
            print(
                "Traceback (most recent call last):\nRuntimeError: fake failure", file=sys.stderr, flush=True
            )
            emit(event="error", message=f"fake failure at step {step}")
            sys.exit(1)
        if step == knobs.get("crash_at"):
            sys.exit(3)
        emit(event="step", step=step, total_steps=steps, loss=round(2.0 / step, 4), peak_mib=100 + step)
    out = Path(config["output_dir"])
    sizes = {"adapter_model.safetensors": 1300000, "adapter_config.json": 300, **knobs.get("sizes", {})}
    for name, size in sizes.items():
        pattern = bytes((params["seed"] + i) % 251 for i in range(251))
        data = (pattern * (size // 251 + 1))[:size]
        (out / name).write_bytes(data)
    emit(event="done", peak_mib=100 + steps, files=sorted(sizes))


if __name__ == "__main__":
    main()
