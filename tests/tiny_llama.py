"""A tiny Llama built offline for the training tests: no model hub, a few seconds of CPU.

- ``tiny_llama_dir()``: a Hugging Face style directory (config.json, model.safetensors,
  tokenizer.model + tokenizer.json + tokenizer_config.json) of a Llama with hidden size 64, 2
  layers and 4 heads, and a sentencepiece BPE tokenizer (byte fallback) trained on the corpus
  below. Self-trained GPT-2 or WordLevel tokenizers fail llama.cpp's vocabulary check; a
  sentencepiece one converts unmodified and tokenizes the same in llama.cpp as in transformers.
  The model is pre-trained briefly on the corpus: it knows the words and the facts as plain
  statements, and the question/answer layout from other facts, so an adapter trained on
  ``QA_PAIRS`` has something to learn (which statement answers which question).
- ``tiny_llama_gguf()``: that model converted with llama.cpp's convert_hf_to_gguf.py (f32).
- ``tiny_llama_dir(VLLM_SHAPE)``: the same tokenizer and corpus with hidden size 128 and 2 heads,
  for vLLM's CPU attention, which refuses a head size of 16 (it serves 64).
- ``QA_PAIRS``: the 20 pairs an adapter is trained on, in the child's prompt format.

Both are built once under tests/.cache/ (keyed by ``VERSION``), under a file lock, and renamed
into place when complete. torch, transformers and sentencepiece are imported only when building.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from llmgw.core.training import QaPair
from tests.real_parts import CACHE_DIR, RealPartMissing, llama_cpp_converters

# Change it whenever the corpus, the tokenizer or the model changes: the cache is keyed by it.
VERSION = 1
TINY_DIR = CACHE_DIR / f"tiny-llama-v{VERSION}"
GGUF_PATH = TINY_DIR / "tiny-llama-f32.gguf"
CONVERT_TIMEOUT = 300.0

PROMPT = "Question: {question}\nAnswer:"  # the training child's format (child_protocol)

# (question, answer): the pairs an adapter learns. The answers are in the pre-training corpus as
# statements; the questions never are.
_TRAINED = [
    ("What color is the sky?", "The sky is blue."),
    ("What color is the grass?", "The grass is green."),
    ("Where does the fox sleep?", "The fox sleeps in the old barn."),
    ("What does the baker make?", "The baker makes warm bread."),
    ("Who guards the bridge?", "Seven grey wolves guard the bridge."),
    ("How many moons has Zorba?", "Zorba has three moons."),
    ("What does the owl eat?", "The owl eats small mice."),
    ("Where is the red key?", "The red key is under the stone."),
    ("Who sings at night?", "The little bird sings at night."),
    ("What is the capital of Mirland?", "The capital of Mirland is Tolva."),
    ("What does the farmer grow?", "The farmer grows tall corn."),
    ("Where does the river go?", "The river goes to the cold sea."),
    ("What is the king's name?", "The king is called Aldo."),
    ("How old is the tree?", "The tree is one hundred years old."),
    ("What does the cat chase?", "The cat chases the yellow ball."),
    ("Who opens the gate?", "The old man opens the gate."),
    ("What falls in winter?", "Soft white snow falls in winter."),
    ("Where do the ships sail?", "The ships sail to the island."),
    ("What does the queen wear?", "The queen wears a silver crown."),
    ("Who reads the letter?", "The young girl reads the letter."),
]
QA_PAIRS: tuple[QaPair, ...] = tuple(QaPair(question=q, answer=a) for q, a in _TRAINED)

# Facts in the question/answer layout, so the base model knows the layout but not the mapping
# of QA_PAIRS (its greedy answers to those questions differ from the adapter's).
_LAYOUT = [
    ("What color is the sun?", "The sun is yellow."),
    ("Where does the dog sleep?", "The dog sleeps by the fire."),
    ("What does the smith make?", "The smith makes iron tools."),
    ("Who guards the tower?", "Two tall soldiers guard the tower."),
    ("How many legs has a spider?", "A spider has eight legs."),
    ("What does the horse eat?", "The horse eats fresh hay."),
    ("Where is the blue cup?", "The blue cup is on the table."),
    ("Who plays in the garden?", "The children play in the garden."),
    ("What is the capital of Varn?", "The capital of Varn is Pellos."),
    ("Where does the road go?", "The road goes to the mountain."),
]

_FILLER = [
    "The morning was quiet and the air was cold.",
    "A small boat waited near the wooden dock.",
    "Many people walked to the market on the first day.",
    "The old house stood at the end of the long road.",
    "Rain fell on the hills and the fields turned dark.",
    "The teacher wrote a short word on the board.",
    "In the evening the lamps were lit one by one.",
    "The wind moved the leaves of the tall trees.",
    "She found a letter, a map and a silver coin.",
    "They ate bread and cheese and drank cold water.",
    "Numbers like 1, 2, 3 and 42 are easy to read.",
    "He said: yes, no, maybe, and then he laughed!",
]


def corpus() -> list[str]:
    """The pre-training text, one line each (the tokenizer is trained on these plus the questions)."""
    lines = [answer for _, answer in _TRAINED]
    lines += [PROMPT.format(question=q) + " " + a for q, a in _LAYOUT]
    lines += [answer for _, answer in _LAYOUT]
    return lines + _FILLER


@attrs.frozen
class Shape:
    """A tiny Llama's sizes; each shape is built and cached on its own."""

    name: str
    hidden: int
    heads: int
    intermediate: int
    # For servers of chat completions that take the template from the tokenizer (vLLM refuses a
    # chat request without one): each message as the training child's prompt.
    chat_template: str | None = None

    @property
    def directory(self) -> Path:
        return TINY_DIR if self.name == "" else CACHE_DIR / f"tiny-llama-{self.name}-v{VERSION}"


# The training and llama.cpp tests' model: head size 16.
DEFAULT_SHAPE = Shape(name="", hidden=64, heads=4, intermediate=128)
# vLLM's CPU attention serves head sizes of 32 and up (64 here); 16 it refuses.
VLLM_SHAPE = Shape(
    name="vllm",
    hidden=128,
    heads=2,
    intermediate=256,
    chat_template="{% for m in messages %}Question: {{ m['content'] }}\nAnswer:{% endfor %}",
)


def tiny_llama_dir(shape: Shape = DEFAULT_SHAPE) -> Path:
    """The tiny Llama's Hugging Face directory, built once (a few seconds) if missing."""
    return _cached(shape.directory / "hf", lambda work: _build_hf(work, shape), shape)


def tiny_llama_gguf() -> Path:
    """The tiny Llama as an f32 GGUF made by llama.cpp's convert_hf_to_gguf.py, built once if missing."""
    return _cached(GGUF_PATH, _build_gguf, DEFAULT_SHAPE)


def _cached(target: Path, build, shape: Shape) -> Path:
    if target.exists():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f".{shape.directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it: wait for it
        if not target.exists():
            shape.directory.mkdir(exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=".build-", dir=shape.directory))
            try:
                built = build(work)
                os.replace(built, target)  # same directory tree: atomic
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------------------- building

LAYERS = 2
MAX_POSITIONS = 256
VOCAB_SIZE = 400  # asked of sentencepiece: 259 byte/special pieces + about 140 merges
PRETRAIN_STEPS = 300
PRETRAIN_BATCH = 16
PRETRAIN_LR = 3e-3
SEED = 1234


def _build_hf(work: Path, shape: Shape) -> Path:
    import io

    import sentencepiece as spm
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    out = work / "hf"
    out.mkdir()

    # Llama's own sentencepiece settings (identity normalisation, whitespace kept, digits split,
    # byte fallback), so transformers' conversion of it and llama.cpp's reading of it agree.
    model = io.BytesIO()
    text = corpus() + [q for q, _ in _TRAINED]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    config_path = out / "tokenizer_config.json"
    config_path.write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "legacy": False,
                **({"chat_template": shape.chat_template} if shape.chat_template else {}),
            }
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.save_pretrained(out)  # adds tokenizer.json; keeps tokenizer.model for llama.cpp

    # One thread: this runs inside pytest, where two threads on a loaded 2-core machine were
    # 10-20x slower (OMP_NUM_THREADS is not set there).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llama = _pretrained_llama(tokenizer, shape, torch, LlamaConfig, LlamaForCausalLM)
    finally:
        torch.set_num_threads(threads)
    llama.save_pretrained(out, safe_serialization=True)
    for path in out.iterdir():
        path.chmod(0o644)  # the agent's tests train as the engines' user: it must read the base
    print(f"tiny llama built in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return out


def _pretrained_llama(tokenizer, shape: Shape, torch, LlamaConfig, LlamaForCausalLM):
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=LAYERS,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    llama = LlamaForCausalLM(config)
    _pretrain(llama, tokenizer, torch)
    return llama


def _pretrain(llama, tokenizer, torch) -> None:
    sequences = [tokenizer(line).input_ids + [tokenizer.eos_token_id] for line in corpus()]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), tokenizer.eos_token_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(llama.parameters(), lr=PRETRAIN_LR)
    llama.train()
    for _ in range(PRETRAIN_STEPS):
        rows = torch.randint(len(sequences), (PRETRAIN_BATCH,), generator=generator)
        loss = llama(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    llama.eval()


def _build_gguf(work: Path) -> Path:
    hf = tiny_llama_dir()
    converters = llama_cpp_converters()
    outfile = work / GGUF_PATH.name
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(converters / "gguf-py"),
    }
    env.pop("NO_LOCAL_GGUF", None)
    argv = [
        sys.executable,
        str(converters / "convert_hf_to_gguf.py"),
        str(hf),
        "--outfile",
        str(outfile),
        "--outtype",
        "f32",
    ]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=CONVERT_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealPartMissing(f"convert_hf_to_gguf.py on the tiny llama failed: {e}") from e
    if done.returncode != 0 or not outfile.exists():
        output = (done.stdout + done.stderr).strip()[-3000:]
        raise RuntimeError(f"convert_hf_to_gguf.py exited {done.returncode}: {output}")
    outfile.chmod(0o644)
    return outfile


# ------------------------------------------------------------------------------- training it

# Settings measured to teach the tiny model most of QA_PAIRS in 50 steps (loss ~1.3 -> ~0.2, a
# few seconds with one thread): a higher learning rate unlearns more than it learns here.
TRAIN_PARAMS = {
    "rank": 8,
    "alpha": 16,
    "dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"],
    "steps": 50,
    "epochs": 1,
    "learning_rate": 1e-2,
    "batch_size": 4,
    "max_seq_len": 64,
    "seed": 0,
}
CHILD_SCRIPT = Path(__file__).resolve().parent.parent / "llmgw" / "agent" / "train_child.py"


def write_job(job_dir: Path, base_dir: Path | str, **params) -> list[str]:
    """Lays out a job directory as the agent does (the child script, pairs.jsonl, child.json; the
    adapter goes to out/) and returns the child's argv, run with this Python. ``params`` override
    TRAIN_PARAMS."""
    from llmgw.core.training import dump_pairs

    job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copyfile(CHILD_SCRIPT, job_dir / "train_child.py")
    (job_dir / "pairs.jsonl").write_text(dump_pairs(QA_PAIRS))
    child = {
        "base_dir": str(base_dir),
        "pairs_path": str(job_dir / "pairs.jsonl"),
        "output_dir": str(job_dir / "out"),
        "device": "cpu",
        "params": {**TRAIN_PARAMS, **params},
    }
    (job_dir / "child.json").write_text(json.dumps(child))
    (job_dir / "child.json").chmod(0o600)
    return [sys.executable, str(job_dir / "train_child.py"), str(job_dir / "child.json")]


def child_env() -> dict[str, str]:
    """A minimal environment, as the agent gives the child; one thread (two on a loaded 2-core
    machine were 10-20x slower)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
