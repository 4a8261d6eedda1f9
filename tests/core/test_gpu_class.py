import pytest

from llmgw.core.gpu_class import gpu_class

MIB = 2**20
GIB = 2**30


@pytest.mark.parametrize(
    ("product_name", "memory_total_bytes", "expected"),
    [
        # Sold as 48GB, reports 44.99 GiB: the driver's number wins.
        ("NVIDIA L40S", 48305799168, "l40s-45g"),
        ("NVIDIA H100 80GB HBM3", 85520809984, "h100-80g"),
        ("NVIDIA A100-SXM4-80GB", 81920 * MIB, "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", 40960 * MIB, "a100-40g"),
        ("NVIDIA A100 80GB PCIe", 81920 * MIB, "a100-80g"),
        ("NVIDIA A100-PCIE-40GB", 40960 * MIB, "a100-40g"),
        ("NVIDIA GeForce RTX 4090", 24564 * MIB, "rtx4090-24g"),
        ("NVIDIA GeForce RTX 3090", 24576 * MIB, "rtx3090-24g"),
        ("Tesla T4", 15 * GIB, "t4-15g"),
        ("Tesla V100-SXM2-16GB", 16384 * MIB, "v100-16g"),
        ("Tesla V100-PCIE-32GB", 32768 * MIB, "v100-32g"),
        ("NVIDIA H200", 143771 * MIB, "h200-140g"),
        ("NVIDIA H100 PCIe", 81559 * MIB, "h100-80g"),
        ("NVIDIA H100 NVL", 95830 * MIB, "h100-94g"),
        ("NVIDIA GH200 480GB", 97871 * MIB, "gh200-96g"),
        ("NVIDIA B200", 183359 * MIB, "b200-179g"),
        ("NVIDIA L4", 23034 * MIB, "l4-22g"),
        ("NVIDIA A10G", 23028 * MIB, "a10g-22g"),
        ("NVIDIA A10", 23028 * MIB, "a10-22g"),
        # "RTX" is a brand; the model number that follows (or the word before it) names the chip.
        ("NVIDIA RTX A6000", 49140 * MIB, "rtxa6000-48g"),
        ("NVIDIA RTX 6000 Ada Generation", 49140 * MIB, "rtx6000-48g"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887 * MIB, "rtxpro6000-96g"),
        ("Quadro RTX 8000", 49152 * MIB, "rtx8000-48g"),
        # Odd inputs still give a usable, stable class.
        ("", 16 * GIB, "gpu-16g"),
        ("NVIDIA", 16 * GIB, "gpu-16g"),
        ("  nvidia   h100  ", 80 * GIB, "h100-80g"),
        ("NVIDIA H100 80GB HBM3", 0, "h100-0g"),
        ("NVIDIA L40S (R)", 48305799168, "l40s-45g"),
        ("rtx", 8 * GIB, "rtx-8g"),
    ],
)
def test_gpu_class(product_name: str, memory_total_bytes: int, expected: str) -> None:
    assert gpu_class(product_name, memory_total_bytes) == expected


def test_memory_rounds_half_up() -> None:
    assert gpu_class("NVIDIA X1", int(15.5 * GIB)) == "x1-16g"
    assert gpu_class("NVIDIA X1", int(16.5 * GIB)) == "x1-17g"
    assert gpu_class("NVIDIA X1", int(16.49 * GIB)) == "x1-16g"


def test_name_casing_and_bytes_do_not_change_the_class() -> None:
    assert gpu_class("nvidia l40s", 48305799168) == gpu_class("NVIDIA L40S", 48305799168)
