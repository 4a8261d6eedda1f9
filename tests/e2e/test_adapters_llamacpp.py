"""An adapter served by name, end to end with the real parts: `llmgw ctl train` makes a LoRA
adapter of the tiny Llama (tests/tiny_llama.py) on the CPU, a llama.cpp profile lists it, and one
llama-server replica (started by the real agent with --lora ... --lora-init-without-apply) serves
the base model and the adapter. Through the official openai SDK and the real gateway:

- GET /v1/models lists the adapter beside its base, with ``parent``;
- a completion naming the adapter gives peft's greedy tokens (torch, the adapter applied), and one
  naming the base gives the base model's (the adapter disabled) — on the same replica, so the
  gateway's per-request ``lora`` list is what selects;
- a key limited to the adapter may not use the base; usage carries the adapter's name.

Greedy decoding is compared only as far as it is decided (torch's top two logits apart by more
than NEAR_TIE), as in tests/agent/test_lora_gguf.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.procs import Server, kill_recorded_shards, start_agent, wait_until, write_yaml
from tests.real_parts import (
    require_converters,
    require_llama_server,
    require_training_stack,
)
from tests.tiny_llama import PROMPT, QA_PAIRS, tiny_llama_dir, tiny_llama_gguf

pytestmark = pytest.mark.slow

MODEL = "tiny"
ADAPTER = "tiny-qa"
NODE = "cpu-1"
N_PREDICT = 12
NEAR_TIE = 1e-3  # logits closer than this: float rounding decides, not the model
JOB_DEADLINE = 600.0  # a whole training job, about 15 s when idle
READY_DEADLINE = 180.0
REQUEST_TIMEOUT = 120.0
# Prompts compared: enough to see the adapter change most answers, few enough for 2 cores.
PROMPTS = 8


@pytest.fixture(scope="module")
def parts():
    require_training_stack()
    return require_llama_server(), require_converters(), tiny_llama_dir(), tiny_llama_gguf()


def profile(**fields: object) -> dict:
    return {
        "model": MODEL,
        "engine": "llamacpp",
        "gpu_class": None,
        "memory_mib": 256,
        "cpu_cores": 1,
        "ctx_size": 512,
        "parallel": 1,  # one slot: each prompt evaluated alone, as torch does
        **fields,
    }


def ctl_ok(server: Server, *args: str, timeout: float = 120.0) -> str:
    result = server.ctl(*args, timeout=timeout)
    assert result.returncode == 0, f"ctl {' '.join(args)}: {result.stderr}{result.stdout}"
    return result.stdout


def peft_greedy(base_dir: Path, adapter_dir: Path, prompts: list[str]):
    """(token ids of each prompt, peft's greedy (tokens, margins) with the adapter, without it)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    peft_model = PeftModel.from_pretrained(model, adapter_dir).eval()

    def greedy(ids: list[int]) -> tuple[list[int], list[float]]:
        with torch.no_grad():
            result = peft_model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                do_sample=False,
                max_new_tokens=N_PREDICT,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = result.sequences[0, len(ids) :].tolist()
        margins = []
        for logits in result.logits[: len(tokens)]:
            top = torch.topk(logits[0].float(), 2).values
            margins.append(float(top[0] - top[1]))
        return tokens, margins

    ids = [tokenizer(p).input_ids for p in prompts]
    with_adapter = [greedy(i) for i in ids]
    with peft_model.disable_adapter():
        without = [greedy(i) for i in ids]
    return tokenizer, ids, with_adapter, without


def decided(margins: list[float]) -> int:
    return next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))


def test_an_adapter_is_served_by_name_beside_its_base_through_the_openai_sdk(tmp_path, parts):
    import openai

    llama_server, converters, base_dir, base_gguf = parts
    server = Server(tmp_path, heartbeat_interval=0.5)
    catalog = {
        "models": {MODEL: {"path": str(base_gguf), "format": "gguf"}},
        # A llama.cpp profile serves the model, so the job converts its adapter to GGUF.
        "profiles": {"tiny-train": profile(min_replicas=0, max_replicas=1)},
    }
    write_yaml(server.config, {**yaml.safe_load(server.config.read_text()), **catalog})
    engines = {
        "llama_server": str(llama_server),
        "run_as": None,  # the test venv's Python lives under /root (see test_train_processes)
        "train_python": sys.executable,
        "lora_converter": str(converters / "convert_lora_to_gguf.py"),
        "stop_grace": "5s",
        "stop_shards_on_exit": True,
    }
    agent = None
    try:
        server.start()
        agent = start_agent(tmp_path, server, NODE, engines=engines)
        wait_until(lambda: server.nodes().get(NODE, {}).get("connected"), "the agent", proc=agent)

        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text(
            "".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n" for p in QA_PAIRS)
        )
        ctl_ok(
            server, "train", "--model", MODEL, "--node", NODE, "--base-dir", str(base_dir),
            "--data", str(pairs), "--name", ADAPTER, "--steps", "30", "--lr", "0.003",
            timeout=JOB_DEADLINE,
        )  # fmt: skip
        adapter_dir = tmp_path / "adapter"
        ctl_ok(server, "adapters", "download", ADAPTER, "-o", str(adapter_dir))

        # Serve it: one replica, the base and the adapter together.
        served = write_yaml(
            tmp_path / "catalog.yaml",
            {"profiles": {"tiny-lora": profile(adapters=[{"name": ADAPTER, "source": ADAPTER}])}},
        )
        ctl_ok(server, "apply", "-f", str(served))
        ctl_ok(server, "tenant", "create", "lora")
        both = json.loads(
            ctl_ok(
                server, "keys", "create", "--tenant", "lora", "--model", MODEL, "--model", ADAPTER, "--json"
            )
        )["secret"]
        adapter_only = json.loads(
            ctl_ok(server, "keys", "create", "--tenant", "lora", "--model", ADAPTER, "--json")
        )["secret"]

        def ready() -> bool:
            replicas = server.admin("GET", "/admin/v1/replicas")["replicas"]
            return any(r["profile"] == "tiny-lora" and r["state"] == "Ready" for r in replicas)

        wait_until(ready, "the tiny-lora replica to be Ready", deadline=READY_DEADLINE, proc=agent)

        base_url = f"http://{server.endpoints['gateway']}/v1"
        client = openai.OpenAI(api_key=both, base_url=base_url, timeout=REQUEST_TIMEOUT, max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {MODEL, ADAPTER}
        assert (listed[ADAPTER].model_extra or {}).get("parent") == MODEL
        assert "parent" not in (listed[MODEL].model_extra or {})

        prompts = [PROMPT.format(question=pair.question) for pair in QA_PAIRS[:PROMPTS]]
        tokenizer, ids, with_adapter, without = peft_greedy(base_dir, adapter_dir, prompts)

        def complete(model: str, prompt: str) -> str:
            answer = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=N_PREDICT,
                temperature=0,
                extra_body={"cache_prompt": False},  # every prompt from scratch, as in torch
            )
            return answer.choices[0].text

        compared = differ = 0
        started = time.monotonic()
        for i, prompt in enumerate(prompts):
            texts = {}
            for model, (tokens, margins) in ((ADAPTER, with_adapter[i]), (MODEL, without[i])):
                text = texts[model] = complete(model, prompt)
                k = decided(margins)
                # Decoded with the prompt, so that both sides place the first token's space alike.
                expected = tokenizer.decode(ids[i] + tokens[:k], skip_special_tokens=True)
                got = tokenizer.decode(ids[i], skip_special_tokens=True) + text
                assert got.startswith(expected), f"{model}, {prompt!r}: served {text!r}, peft {expected!r}"
                compared += k == len(tokens)
            differ += texts[ADAPTER] != texts[MODEL]
        wall = time.monotonic() - started
        print(
            f"\n{2 * len(prompts)} completions through the gateway in {wall:.1f} s; "
            f"{compared}/{2 * len(prompts)} compared in full; the adapter's answer differs from "
            f"the base's on {differ}/{len(prompts)} prompts"
        )
        assert compared >= 0.8 * 2 * len(prompts)  # the equality is no accident of near ties
        assert differ >= len(prompts) // 2  # ... and the adapter really is selected per request

        # A key limited to the adapter may not use the base model.
        limited = openai.OpenAI(
            api_key=adapter_only, base_url=base_url, timeout=REQUEST_TIMEOUT, max_retries=0
        )
        assert [m.id for m in limited.models.list().data] == [ADAPTER]
        with pytest.raises(openai.PermissionDeniedError):
            limited.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1)

        # Usage names the adapter (its base in the model column).
        def by_adapter() -> dict | None:
            rows = server.admin("GET", "/admin/v1/usage?by=model,adapter")["usage"]
            found = {(r["model"], r["adapter"]): r["requests"] for r in rows}
            return found if found.get((MODEL, ADAPTER), 0) >= len(prompts) else None

        usage = wait_until(by_adapter, "usage records of the adapter's requests")
        assert usage[(MODEL, ADAPTER)] == len(prompts) and usage[(MODEL, "")] == len(prompts)
    finally:
        try:
            if agent is not None:
                agent.stop()
        finally:
            try:
                if server.proc is not None:
                    server.proc.stop()
            finally:
                kill_recorded_shards(tmp_path / f"agent-{NODE}")
