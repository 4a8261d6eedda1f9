"""Where a training job runs (card or CPU), its threads, and the pinned overlay's decisions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.train_device import child_threads, choose_device
from llmgw.wire.messages import Gpu


def gpu(index: int, total: int = 24000, used: int = 0, problems: tuple[str, ...] = ()) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name="L4",
        gpu_class="l4-23g",
        memory_total_mib=total,
        memory_used_mib=used,
        compute_capability="8.9",
        problems=problems,
    )


def test_no_gpus_means_the_cpu_whatever_the_need() -> None:
    for need in (0, 5000):
        choice = choose_device([], need)
        assert (choice.ok, choice.device, choice.child_device, choice.label) == (True, "cpu", "cpu", "cpu")


def test_the_card_with_most_free_memory_even_beside_an_engine() -> None:
    choice = choose_device([gpu(0, used=20000), gpu(1, used=8000)], 16000)
    assert (choice.device, choice.gpu_index, choice.child_device) == ("cuda:1", 1, "cuda:0")
    assert choice.label == "cuda:0 (GPU 1)"


def test_refusal_names_each_cards_free_memory() -> None:
    choice = choose_device([gpu(0, used=20000), gpu(1, used=9000, problems=("ecc-uncorrected",))], 16000)
    assert not choice.ok and choice.device == ""
    assert choice.refusal == (
        "no healthy card has 16000 MiB free: GPU 0 4000 MiB free, "
        "GPU 1 15000 MiB free (unhealthy: ecc-uncorrected)"
    )


def test_a_gpu_node_needs_a_memory_figure() -> None:
    choice = choose_device([gpu(0)], 0)
    assert not choice.ok and "need_mib" in choice.refusal and "got 0" in choice.refusal


gpus = st.lists(
    st.builds(
        gpu,
        index=st.integers(0, 7),
        total=st.integers(1000, 80000),
        used=st.integers(0, 80000),
        problems=st.sampled_from([(), ("foreign-memory",)]),
    ),
    max_size=6,
    unique_by=lambda g: g.index,
)


@given(gpus, st.integers(-10, 90000))
def test_choice_is_a_healthy_card_with_enough_and_the_most_free(cards: list[Gpu], need: int) -> None:
    choice = choose_device(cards, need)
    if not cards:
        assert choice.device == "cpu"
        return
    healthy = [c for c in cards if c.healthy]
    fits = need > 0 and any(c.memory_free_mib >= need for c in healthy)
    best_free = max((c.memory_free_mib for c in healthy), default=-1)
    if fits and best_free >= need:
        chosen = next(c for c in cards if c.index == choice.gpu_index)
        assert chosen.healthy and chosen.memory_free_mib == best_free >= need
        assert choice.device == f"cuda:{chosen.index}" and not choice.refusal
    else:
        assert not choice.ok and choice.gpu_index is None
        if need > 0:
            for card in cards:
                assert f"GPU {card.index} {card.memory_free_mib} MiB free" in choice.refusal
    # The same inventory in another order gives the same card.
    assert choose_device(list(reversed(cards)), need) == choice


@given(st.integers(1, 256), st.one_of(st.none(), st.integers(1, 64)), st.booleans())
def test_threads(cpus: int, configured: int | None, on_gpu: bool) -> None:
    threads = child_threads(configured, cpus, on_gpu=on_gpu)
    if configured is not None:
        assert threads == configured
    elif on_gpu:
        assert threads == 1
    else:
        assert threads == max(1, cpus - 1) and threads >= 1
