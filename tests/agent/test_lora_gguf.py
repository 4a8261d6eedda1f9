"""The proof that a trained adapter is served: train (the child), convert (llama.cpp's own
convert_lora_to_gguf.py, via lora_convert, always with --base), serve (the real llama-server with
``--lora``), and compare greedy tokens:

- with the adapter, llama-server's tokens equal peft's own greedy output in torch;
- without it, llama-server's tokens equal the base model's in torch, and differ from the adapter's.

All on the tiny Llama (tests/tiny_llama.py), whose sentencepiece tokenizer llama.cpp reads
unmodified: the prompts tokenize to the same ids on both sides (checked through /tokenize).

Greedy decoding is only defined where the best token wins by a margin: where torch's top two
logits are within NEAR_TIE, float rounding may pick either, so the comparison stops there. The
settings in tiny_llama.TRAIN_PARAMS leave no such position today (the smallest margin is ~0.05).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.lora_convert import convert_argv, converter_env, find_converter
from llmgw.core.training import GGUF_FILE
from tests.real_parts import require_converters, require_llama_server, require_training_stack
from tests.tiny_llama import (
    PROMPT,
    QA_PAIRS,
    child_env,
    tiny_llama_dir,
    tiny_llama_gguf,
    write_job,
)

# Module level: without torch and peft there is nothing here to run.
require_training_stack()

pytestmark = pytest.mark.slow

N_PREDICT = 12
NEAR_TIE = 1e-3  # logits closer than this: float rounding decides, not the model
TRAIN_DEADLINE = 300.0
CONVERT_DEADLINE = 300.0
HEALTH_DEADLINE = 120.0
REQUEST_TIMEOUT = 60.0
STOP_DEADLINE = 15.0


def test_llama_server_applies_the_trained_adapter(tmp_path: Path) -> None:
    llama_server = require_llama_server()
    converters = require_converters()
    timings: dict[str, float] = {}

    started = time.monotonic()
    base_dir = tiny_llama_dir()
    base_gguf = tiny_llama_gguf()
    timings["base (cached after the first run)"] = time.monotonic() - started

    # Train, as the agent runs the child.
    started = time.monotonic()
    job = tmp_path / "job"
    done = subprocess.run(
        write_job(job, base_dir),
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=TRAIN_DEADLINE,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    timings["train"] = time.monotonic() - started
    out = job / "out"

    # Convert, as the agent does: lora_convert's argv and environment, in the job directory.
    started = time.monotonic()
    script = find_converter(str(converters / "convert_lora_to_gguf.py"))
    assert script is not None
    adapter_gguf = out / GGUF_FILE
    done = subprocess.run(
        convert_argv(sys.executable, script, out, base_dir, adapter_gguf),
        capture_output=True,
        text=True,
        cwd=job,
        env=converter_env(script, child_env()),
        timeout=CONVERT_DEADLINE,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"convert_lora_to_gguf.py exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert adapter_gguf.read_bytes()[:4] == b"GGUF"
    timings["convert"] = time.monotonic() - started

    # Greedy tokens in torch: the base, and the base with peft's adapter.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    peft_model = PeftModel.from_pretrained(model, out).eval()
    prompts = [PROMPT.format(question=pair.question) for pair in QA_PAIRS]
    prompt_ids = [tokenizer(prompt).input_ids for prompt in prompts]
    with_adapter = [greedy(peft_model, ids, torch) for ids in prompt_ids]
    with peft_model.disable_adapter():
        without = [greedy(peft_model, ids, torch) for ids in prompt_ids]

    # The same in llama-server, with and without --lora.
    with LlamaServer(llama_server, base_gguf, tmp_path / "base.log", []) as server:
        assert [server.tokenize(p) for p in prompts] == prompt_ids, "llama.cpp tokenizes differently"
        served_base = [server.complete(p) for p in prompts]
    with LlamaServer(llama_server, base_gguf, tmp_path / "lora.log", ["--lora", str(adapter_gguf)]) as server:
        served_lora = [server.complete(p) for p in prompts]

    decided = 0
    for i, prompt in enumerate(prompts):
        for name, served, torch_out in (
            ("base", served_base, without),
            ("adapter", served_lora, with_adapter),
        ):
            tokens, margins = torch_out[i]
            k = decided_prefix(margins)
            assert served[i][:k] == tokens[:k], (
                f"{name}, prompt {prompt!r}: llama-server {served[i]} "
                f"({tokenizer.decode(served[i])!r}) != torch {tokens} ({tokenizer.decode(tokens)!r})"
            )
            decided += k == len(tokens)
    differ = sum(a != b for a, b in zip(served_lora, served_base, strict=True))
    # The adapter's answer, as far as N_PREDICT tokens go, is the trained one.
    answered = sum(
        bool(text) and pair.answer.startswith(text)
        for pair, text in (
            (pair, tokenizer.decode(tokens, skip_special_tokens=True).strip())
            for tokens, pair in zip(served_lora, QA_PAIRS, strict=True)
        )
    )
    print(
        f"\n{', '.join(f'{k} {v:.1f}s' for k, v in timings.items())}; "
        f"{decided}/{2 * len(prompts)} greedy runs equal in full; adapter differs from base on "
        f"{differ}/{len(prompts)} prompts; trained answers {answered}/{len(prompts)}; "
        f"smallest margin {min(min(m) for _, m in with_adapter + without):.3f}"
    )
    example = 0
    print(
        f"{prompts[example]!r}: base {tokenizer.decode(served_base[example])!r}, "
        f"adapter {tokenizer.decode(served_lora[example])!r}"
    )
    # Nearly every run is compared in full, so the equality above is no accident of near ties...
    assert decided >= 0.9 * 2 * len(prompts)
    # ...and the adapter really changes what the model says.
    assert differ >= len(prompts) // 2, (served_base, served_lora)
    assert answered >= len(prompts) // 4


def greedy(model, prompt_ids: list[int], torch) -> tuple[list[int], list[float]]:
    """peft's own greedy generation: the new tokens (with the EOS that ends them, as llama-server
    returns it) and, per token, the margin by which it won."""
    with torch.no_grad():
        result = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            attention_mask=torch.ones((1, len(prompt_ids)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=N_PREDICT,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = result.sequences[0, len(prompt_ids) :].tolist()
    margins = []
    for logits in result.logits[: len(tokens)]:
        top = torch.topk(logits[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def decided_prefix(margins: list[float]) -> int:
    """How many leading tokens greedy decoding decides without a near tie."""
    for i, margin in enumerate(margins):
        if margin < NEAR_TIE:
            return i
    return len(margins)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on 127.0.0.1 in its own process group, ready once /health answers 200."""

    def __init__(self, binary: Path, model: Path, log: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.log = log
        self.argv = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-ngl",
            "0",
            "--ctx-size",
            "256",
            "--parallel",
            "1",
            "--threads",
            "1",
            *extra,
        ]

    def __enter__(self) -> LlamaServer:
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + HEALTH_DEADLINE
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    pytest.fail(f"llama-server exited {self.popen.returncode}:\n{self.log_tail()}")
                try:
                    if self.request("GET", "/health")[0] == 200:
                        return self
                except OSError:
                    pass
                time.sleep(0.05)
            pytest.fail(f"llama-server /health not 200 after {HEALTH_DEADLINE}s:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        pgid = self.popen.pid  # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, STOP_DEADLINE), (signal.SIGKILL, STOP_DEADLINE)):
            if self.popen.poll() is not None:
                break
            try:
                os.killpg(pgid, sig)
                self.popen.wait(timeout=wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            response = conn.getresponse()
            data = response.read()
            return response.status, json.loads(data) if data else {}
        finally:
            conn.close()

    def tokenize(self, text: str) -> list[int]:
        status, answer = self.request("POST", "/tokenize", {"content": text, "add_special": True})
        assert status == 200, answer
        return answer["tokens"]

    def complete(self, prompt: str) -> list[int]:
        status, answer = self.request(
            "POST",
            "/completion",
            {
                "prompt": prompt,
                "n_predict": N_PREDICT,
                "temperature": 0,
                "return_tokens": True,
                "cache_prompt": False,  # every prompt evaluated the same way, from scratch
            },
        )
        assert status == 200, answer
        return answer["tokens"]
