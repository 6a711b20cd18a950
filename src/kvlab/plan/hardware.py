"""Accelerator catalog: memory, bandwidth and dense compute, each with its source.

Figures are the vendors' datasheet numbers for dense (non-sparse) math. Memory is given as the
datasheet states it (decimal GB, as vendors do); we keep bytes exact and say which unit we print.

vLLM sizes its budget from a different number: the total the CUDA runtime reports
(`torch.cuda.mem_get_info`), which is the card's capacity in GiB less what the driver keeps,
and on GDDR cards whose ECC is on by default (L4, L40S, A10G) one sixteenth less again.
`cuda_memory_bytes` is that figure: measured where a published vLLM log states it (H100
79.22 GiB of 80, vLLM PR 10511; RTX 3090 23.58 GiB of 24, vLLM issue 10517), and for every
other card estimated from those two: capacity in GiB (x 15/16 with ECC) less 0.78 GiB on
HBM cards (as the H100) or 0.42 GiB on GDDR cards (as the RTX 3090).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

from kvlab.plan.errors import PlanError

GB = 10**9
GIB = 2**30
# what CUDA does not report as total: 80 - 79.22 GiB on an H100 (HBM), 24 - 23.58 on an RTX 3090 (GDDR)
RESERVED_GIB = {"hbm": 0.78, "gddr": 0.42}


@dataclass(frozen=True)
class Device:
    """One card: memory in bytes, bandwidth in GB/s (decimal), compute in TFLOP/s."""

    name: str
    memory_bytes: int
    bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: Optional[float] = None
    source: str = "user input"
    cuda_memory_bytes: Optional[int] = None  # the total CUDA reports, which vLLM multiplies by its utilisation
    cuda_memory_source: str = "estimate: the card's memory"

    def __post_init__(self) -> None:
        for field_name in ("memory_bytes", "bandwidth_gbs", "bf16_tflops"):
            value = getattr(self, field_name)
            if value is None or value <= 0:
                raise PlanError(f"{field_name} must be positive, got {value!r}")

    @property
    def vllm_total_bytes(self) -> int:
        """The total vLLM's worker sees (`requested_memory = total x --gpu-memory-utilization`)."""
        return self.cuda_memory_bytes if self.cuda_memory_bytes is not None else self.memory_bytes


def _card(name: str, memory_gb: float, bandwidth: float, bf16: float, fp8: Optional[float], source: str,
          capacity_gib: float, memory: str = "hbm", measured_gib: Optional[float] = None,
          measured_source: str = "") -> Device:
    """A catalog card; `memory` is "hbm", "gddr" or "gddr-ecc" (ECC on by default keeps 1/16)."""
    if measured_gib is not None:
        cuda, cuda_source = int(measured_gib * GIB), measured_source
    else:
        ecc = memory == "gddr-ecc"
        reserved = RESERVED_GIB["hbm" if memory == "hbm" else "gddr"]
        cuda = int(capacity_gib * GIB * (15 / 16 if ecc else 1)) - int(reserved * GIB)
        cuda_source = (f"estimate: {capacity_gib:g} GiB{' x 15/16 (ECC)' if ecc else ''} less the driver's "
                       f"{reserved} GiB")
    return Device(name, int(memory_gb * GB), bandwidth, bf16, fp8, source, cuda, cuda_source)


CATALOG = {
    "h100-sxm": _card("H100 SXM", 80, 3350, 989, 1979, "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense)", 80,
                      measured_gib=79.22, measured_source="measured: vLLM PR 10511's log (H100, 79.22 GiB)"),
    "h100-pcie": _card("H100 PCIe", 80, 2000, 756, 1513, "NVIDIA H100 Tensor Core GPU datasheet (PCIe, dense)", 80),
    "h200": _card("H200 SXM", 141, 4800, 989, 1979, "NVIDIA H200 Tensor Core GPU datasheet (SXM, dense)", 141),
    "b200": _card("B200", 180, 7700, 2250, 4500, "NVIDIA HGX B200 datasheet (per GPU, dense = sparse / 2)", 180),
    "mi300x": _card("MI300X", 192, 5300, 1307.4, 2614.9, "AMD Instinct MI300X accelerator datasheet (dense)", 192),
    "a100-80gb": _card("A100 80GB SXM", 80, 2039, 312, None, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB, dense)",
                       80),
    "l4": _card("L4", 24, 300, 121, 242.5, "NVIDIA L4 Tensor Core GPU datasheet (dense = sparse / 2)", 24, "gddr-ecc"),
    "l40s": _card("L40S", 48, 864, 362, 733, "NVIDIA L40S datasheet (dense = sparse / 2)", 48, "gddr-ecc"),
    "a10g": _card("A10G", 24, 600, 125, None, "NVIDIA A10 datasheet (AWS's A10G: the same 24 GB at 600 GB/s; "
                  "bf16 dense = sparse / 2)", 24, "gddr-ecc"),
    "rtx-4090": _card("RTX 4090", 24, 1008, 165.2, 330.3,
                      "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090, dense)", 24, "gddr"),
    "rtx-3090": _card("RTX 3090", 24, 936, 71, None, "NVIDIA Ampere GA102 whitepaper (RTX 3090, fp16/bf16 tensor, "
                      "dense)", 24, "gddr", measured_gib=23.58, measured_source="measured: vLLM issue 10517's log (23.58 GiB)"),
    "jetson-agx-orin-64gb": Device("Jetson AGX Orin 64GB", 64 * GB, 204.8, 42.5, None,
                                   "NVIDIA Jetson AGX Orin series datasheet (shared memory; bf16 about 42.5 dense)"),
}
ALIASES = {"h100": "h100-sxm", "h200-sxm": "h200", "a100": "a100-80gb", "4090": "rtx-4090", "orin": "jetson-agx-orin-64gb",
           "3090": "rtx-3090", "b200-sxm": "b200", "mi300": "mi300x", "a10": "a10g", "h100-sxm5": "h100-sxm"}


def device(name: str) -> Device:
    """A catalog card by name (case-insensitive, aliases allowed); one-line error with close matches."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    close = difflib.get_close_matches(key, list(CATALOG) + list(ALIASES), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known cards: {', '.join(CATALOG)}"
    raise PlanError(f"unknown GPU {name!r}{hint}")


def devices(names: str) -> list[Device]:
    """`--gpu h100,l40s,l4`: each card, in the order given, without repeats."""
    found: list[Device] = []
    for name in (part for part in names.split(",") if part.strip()):
        card = device(name)
        if card not in found:
            found.append(card)
    if not found:
        raise PlanError("--gpu needs at least one card name")
    return found


def custom_device(memory_gib: float, bandwidth_gbs: float, tflops: float) -> Device:
    """A card described by its numbers (`--memory-gib --bandwidth-gbs --tflops`)."""
    if memory_gib is None or memory_gib <= 0:
        raise PlanError(f"--memory-gib must be positive, got {memory_gib!r}")
    return Device("custom", int(memory_gib * GIB), bandwidth_gbs, tflops, cuda_memory_source="the memory given")
