"""What one device can do: the hardware model the planner times a layout with.

A device is described by a handful of numbers, used by :mod:`lightning_par.planner.trace` (the time of an op) and
:mod:`lightning_par.planner.plan` (collectives, memory):

- ``peak_flops`` by compute dtype and ``matmul_table``: how fast matrix products run, by shape. A GEMM of
  ``M x K`` by ``K x N`` has the intensity ``I = MNK / (MK + KN + MN)`` (its FLOPs per element moved, halved);
  the table maps ``I`` to the fraction of peak it reaches, rising and saturating (small and thin GEMMs leave the
  tensor cores idle: too few tiles, wave quantization, memory traffic per FLOP), interpolated in ``log I``. An op
  costs ``flops / (peak * efficiency(I))``, or the time to move its bytes, whichever is longer: a roofline per op.
  Without a table, ``matmul_efficiency`` is the one fraction for every shape;
- ``memory_bandwidth``: how fast the other ops (norms, activations, softmax, the optimizer step) move bytes;
- ``op_overhead_s``: the fixed cost of launching one op (eager PyTorch: one kernel per op);
- ``dtensor_op_overhead_s``: what one op on a DTensor costs on top (its sharding propagation in Python), where the
  host's time is the step's time (the CPU ranks): paid by the tensor-parallel modules in forward and backward and,
  per parameter tensor, by the optimizer step over TP's and FSDP2's DTensor parameters. 0 on the GPU presets,
  where the host runs ahead of the kernels;
- ``intra_node_bandwidth`` / ``inter_node_bandwidth``: collective bus bandwidth per device (NCCL's "busbw": a ring
  all-reduce of ``n`` bytes over ``k`` devices takes ``2 n (k-1)/k / bandwidth``), inside a node (NVLink) and
  across nodes (InfiniBand, one NIC), and ``latency_s`` per collective; ``rails``: how many NICs per node a
  collective's rings spread over (a group with 8 ranks in each node of a rail-optimized H100 cluster: 8);
- ``overlap``: whether communication can run beside compute (GPUs: the copy engines and NCCL's own SMs). False
  for the CPU ranks here: gloo's transfers and reductions run on the same cores as the compute, which the 4 ranks
  already oversubscribe, so every collective's time is exposed, whatever the runtime overlaps;
- ``devices_per_node``: which groups stay inside a node (ranks are laid out tp innermost, pp outermost);
- ``memory_gib`` and ``reserved_gib``: device memory, and what the runtime takes before any tensor (CUDA context,
  NCCL buffers, allocator fragmentation).

Presets: ``h100-sxm``, ``h200`` (both calibrated on measured steps: ``calibration.json``, written by
``benchmarks/planner_fit.py``), ``h100-pcie`` and ``b200`` (datasheet figures only), ``a100`` (80 GB SXM, as in
Megatron's Selene runs) and ``cpu`` (this 2-core CPU with gloo, measured); or a JSON / YAML file with the same
fields (``--hardware FILE``), missing fields taken from ``base``.

- ``attention_efficiency``: the fraction of the bf16 peak a fused attention kernel reaches on the FLOPs it computes
  (half the counted square under a causal mask); 0 prices attention as a GEMM of its intensity (the A100 table);
- ``fusion``: under ``torch.compile``, the share of the memory traffic between two matrix products that fusion
  removes beyond the largest op's own (1, the ideal, unless calibrated).

:data:`GPUS` is the table of CUDA devices by name (:func:`detect_gpu`): their dense peak FLOP/s per dtype, which
``train/mfu`` divides by, and the preset ``strategy="planned"`` plans with (the nearest one, with a note, where no
preset describes the device).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from lightning_par.topology import LayoutError

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One device type and how devices are connected (see the module docstring for what each field does)."""

    name: str
    peak_flops: dict[str, float] = field(default_factory=dict)  # compute dtype ("fp32", "bf16") -> FLOP/s
    matmul_efficiency: float = 0.7  # every shape, where matmul_table is empty
    matmul_table: tuple[tuple[float, float], ...] = ()  # (GEMM intensity I, fraction of peak), I increasing
    # fused attention (SDPA) in bf16: the fraction of peak its kernels reach on the FLOPs they compute (a causal
    # kernel half of the counted square); 0: attention is a GEMM of its intensity, as the table prices it
    attention_efficiency: float = 0.0
    # compiled (torch.compile): the share of the memory traffic of the ops between two matrix products that fusion
    # removes, beyond the largest op's own (1: one kernel moving only that; measured on a GPU: less)
    fusion: float = 1.0
    memory_bandwidth: float = 2e12  # bytes/s
    op_overhead_s: float = 5e-6
    dtensor_op_overhead_s: float = 0.0
    intra_node_bandwidth: float = 200e9  # bytes/s per device, collective bus bandwidth
    inter_node_bandwidth: float = 25e9
    # NICs per node one collective's rings can spread over (rail-optimized nodes: one per GPU, NCCL one channel per
    # rail); 1: a group's inter-node traffic is bound by one NIC per rank, whatever it holds in each node
    rails: int = 1
    latency_s: float = 2e-5
    overlap: bool = True
    devices_per_node: int = 8
    memory_gib: float = 80.0
    reserved_gib: float = 2.0
    notes: str = ""

    def flops(self, compute_dtype: str, intensity: float | None = None) -> float:
        """Achievable matmul FLOP/s for a compute dtype ("fp32" or "bf16") and a GEMM of this intensity (None:
        the largest shapes)."""
        if compute_dtype not in self.peak_flops:
            raise LayoutError(f"hardware {self.name!r} gives no peak FLOP/s for {compute_dtype}; add it to peak_flops.")
        return self.peak_flops[compute_dtype] * self.efficiency(intensity)

    def attention_flops(self) -> float:
        """FLOP/s a fused bf16 attention kernel reaches on the FLOPs it computes (``attention_efficiency`` of the
        bf16 peak)."""
        return self.peak_flops.get("bf16", 0.0) * self.attention_efficiency

    def efficiency(self, intensity: float | None = None) -> float:
        """The fraction of peak a GEMM of intensity ``I`` reaches: ``matmul_table`` interpolated in ``log I``,
        flat beyond its ends (``matmul_efficiency`` without a table)."""
        table = self.matmul_table
        if not table:
            return self.matmul_efficiency
        if intensity is None or intensity >= table[-1][0]:
            return table[-1][1]
        if intensity <= table[0][0]:
            return table[0][1]
        for (x0, y0), (x1, y1) in zip(table, table[1:], strict=False):
            if intensity <= x1:
                t = math.log(intensity / x0) / math.log(x1 / x0)
                return y0 + t * (y1 - y0)
        return table[-1][1]

    def bandwidth(self, span_nodes: bool, ranks_per_node: int = 1) -> float:
        """Bus bandwidth per device of a collective over a group; one spanning nodes with ``ranks_per_node`` of its
        ranks in each node runs its rings over up to ``rails`` NICs per node (NCCL's channels, one per rail), so
        each inter-node hop carries that share of the data: the NICs' sum, up to the intra-node links."""
        if not span_nodes:
            return self.intra_node_bandwidth
        nics = max(1, min(ranks_per_node, self.rails))
        return min(self.intra_node_bandwidth, self.inter_node_bandwidth * nics)

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * GiB

    def to_dict(self) -> dict:
        return asdict(self)


#: Fraction of dense bf16 peak a cuBLAS GEMM reaches in training, by intensity ``MNK / (MK + KN + MN)``. The shape
#: -- rising with the GEMM's size and saturating -- is the one NVIDIA's "Matrix Multiplication Background User's
#: Guide" (docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication) explains and plots for
#: A100 (tile quantization, wave quantization, memory- vs math-bound); the level is fitted to Megatron-LM's
#: measured Table 1 (Narayanan et al. 2021, A100; ``benchmarks/planner_megatron.py``): achieved throughput inside
#: training, lower than an isolated GEMM's (clocks under sustained power, kernels beside it). Attention with head
#: size 64-128 sits at ``I`` 60-140, a transformer's linear layers at 500-1700. H100 takes the same fractions of its
#: peak: no H100 measurement is held here.
GEMM_TABLE_TRAINING = ((64.0, 0.25), (128.0, 0.36), (256.0, 0.47), (512.0, 0.56), (1024.0, 0.63), (2048.0, 0.66))

_H100_SXM = Hardware(
    name="h100-sxm",
    # dense bf16 989 TFLOP/s; fp32 without TF32 (PyTorch's default for float32 matmuls) 67 TFLOP/s
    peak_flops={"bf16": 989e12, "fp32": 67e12},
    matmul_efficiency=0.58,
    matmul_table=GEMM_TABLE_TRAINING,
    memory_bandwidth=3.35e12 * 0.8,
    op_overhead_s=4e-6,
    intra_node_bandwidth=360e9,  # NVLink 4 (900 GB/s both ways): all-reduce bus bandwidth of nccl-tests
    inter_node_bandwidth=40e9,  # one 400 Gb/s NDR port per GPU
    # rails stays 1 (each rank bound by its own NIC), as the a100 preset's Megatron fit and the planner's tests
    # take it; an HGX/DGX H100 node has 8 ConnectX-7 ports, one per GPU on its own rail: a hardware file with
    # "base: h100-sxm" and "rails: 8" plans such a cluster's collectives (benchmarks/plan_accuracy.py does)
    latency_s=1.5e-5,
    devices_per_node=8,
    memory_gib=79.6,
    reserved_gib=3.0,
    notes="H100 SXM5 80 GB, 8 per node on NVSwitch, one 400 Gb/s InfiniBand port per GPU",
)

#: the presets from their datasheets (and the A100 table above), before any calibration; what
#: ``benchmarks/planner_fit.py`` fits from
BASE_PRESETS: dict[str, Hardware] = {
    "h100-sxm": _H100_SXM,
    # the H100 SXM's GH100 with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200 datasheet): the same compute and NVLink
    "h200": replace(_H100_SXM, name="h200", memory_bandwidth=4.8e12 * 0.8,
                    memory_gib=140.4,  # what CUDA reports for the "141 GB" (143,771 MiB), as 79.6 for "80 GB"
                    notes="H200 SXM 141 GB HBM3e, 8 per node on NVSwitch, one 400 Gb/s InfiniBand port per GPU"),
    # NVIDIA H100 Tensor Core GPU datasheet, PCIe column: 756 TFLOP/s bf16 dense (1,513 with sparsity), 51 TFLOP/s
    # fp32, 80 GB HBM2e at 2.0 TB/s, 300-350 W, PCIe Gen5 (128 GB/s, 64 each way) or an NVLink bridge between two
    # cards (600 GB/s); no NVSwitch. Uncalibrated: nothing was measured on one (plan says so)
    "h100-pcie": replace(
        _H100_SXM, name="h100-pcie", peak_flops={"bf16": 756e12, "fp32": 51e12}, memory_bandwidth=2.0e12 * 0.8,
        # a ring over the host's PCIe Gen5 switches: 64 GB/s each way per card, about half of it as NCCL bus
        # bandwidth (an estimate, not a datasheet figure)
        intra_node_bandwidth=32e9,
        notes="H100 PCIe 80 GB (datasheet figures, uncalibrated), 8 per node on PCIe Gen5 without NVSwitch, one "
              "400 Gb/s port per GPU"),
    # NVIDIA HGX B200 datasheet (8 GPUs; per GPU here): 36 PFLOP/s fp16/bf16 with sparsity -> 2.25 dense per GPU,
    # fp32 600 TFLOP/s -> 75, 1.44 TB of HBM3e at 64 TB/s -> 180 GB at 8 TB/s; NVLink 5, 1.8 TB/s per GPU both ways
    # (the H100's 900 GB/s gives 360 GB/s of all-reduce bus bandwidth: the same 40% here); DGX B200: 8 ConnectX-7
    # 400 Gb/s ports. Uncalibrated: nothing was measured on one (plan says so)
    "b200": replace(
        _H100_SXM, name="b200", peak_flops={"bf16": 2250e12, "fp32": 75e12}, memory_bandwidth=8.0e12 * 0.8,
        intra_node_bandwidth=720e9, memory_gib=180e9 / GiB,  # "180 GB" (what CUDA reports was not seen here)
        notes="B200 180 GB HBM3e (HGX B200 datasheet figures, uncalibrated), 8 per node on NVLink 5, one 400 Gb/s "
              "port per GPU"),
    "a100": Hardware(
        name="a100",
        peak_flops={"bf16": 312e12, "fp32": 19.5e12},
        matmul_efficiency=0.58,
        matmul_table=GEMM_TABLE_TRAINING,
        memory_bandwidth=2.039e12 * 0.8,
        op_overhead_s=5e-6,
        intra_node_bandwidth=230e9,  # NVLink 3 (600 GB/s both ways): all-reduce bus bandwidth of nccl-tests
        inter_node_bandwidth=22e9,  # one 200 Gb/s HDR port per GPU (Selene: 8 per DGX node)
        latency_s=2e-5,
        devices_per_node=8,
        memory_gib=79.2,
        reserved_gib=3.0,
        notes="A100 SXM4 80 GB, 8 per DGX node on NVSwitch, one 200 Gb/s HDR InfiniBand port per GPU (Selene)",
    ),
    "cpu": Hardware(
        name="cpu",
        # measured on this machine, one thread per rank (as the tests run): a 1024^3 fp32 matmul 90 GFLOP/s; bf16
        # matmuls have no native kernel on this CPU and run at about 1 GFLOP/s
        peak_flops={"fp32": 90e9, "bf16": 0.9e9},
        matmul_efficiency=1.0,
        # torch.mm of fp32 M x K by K x N on one thread, best of 9 rounds, less the 1.2 us dispatch of a 1x1 mm
        # (benchmarks of 2026-11-25 on this machine, shared with other jobs): 32^3 6 GFLOP/s (I 10.7), 64^3 40
        # (I 21), 128^3 98 (I 43), 256^3 102, 128x512x128 98; larger ones at the 90 of the quiet machine
        matmul_table=((10.7, 0.07), (21.3, 0.44), (42.7, 1.0)),
        memory_bandwidth=12e9,  # one core copying 64 MiB
        op_overhead_s=1e-5,  # eager dispatch of one op with autograd
        # a DTensor op of 4 elements on a 1-rank mesh, one thread, best of 5 x 200 in CPU time: 25.6 us, the plain
        # op 2.8 us (2026-11-25)
        dtensor_op_overhead_s=23e-6,
        # gloo on 4 ranks sharing the 2 cores (as the tests and benchmarks run), CPU time per rank and collective,
        # 100 rounds (15 of 4 MiB) at load 5-7 (2026-11-25): 4 KiB all-reduce 1.73 ms, all-gather 1.17 ms; 4 MiB
        # all-reduce 4.0 ms and all-gather (4 MiB in) 8.3 ms, i.e. 2.6 and 1.7 GB/s of bus bandwidth past the latency
        intra_node_bandwidth=2e9,
        inter_node_bandwidth=2e9,
        latency_s=1.7e-3,
        # gloo's transfers and reductions take the cores the compute needs: nothing is hidden (docs/plan.md,
        # "predicted vs measured on this machine")
        overlap=False,
        devices_per_node=2,  # ranks beyond the 2 cores share them
        memory_gib=11.5,  # 23 GiB of host memory shared by the 2 ranks
        reserved_gib=0.5,
        notes="this machine: 2 AMD EPYC cores, gloo over loopback (its figures measured with 4 ranks sharing them)",
    ),
}


#: the constants ``benchmarks/planner_fit.py`` fitted from measured GPU steps, with the runs they came from and the
#: errors on the runs held out of each fit
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


def read_calibration(path: Path = CALIBRATION_FILE) -> dict | None:
    """The calibration file's contents, or None where there is none (then the presets are the datasheets')."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def calibrated(base: Hardware, constants: dict, device: dict) -> Hardware:
    """``base`` with fitted constants: its GEMM table scaled by ``matmul_scale`` (capped at the peak), compiled
    fusion's share ``fusion``, and the device's ``attention_efficiency`` (its measured SDPA rate over its peak)."""
    scale = float(constants["matmul_scale"])
    return replace(base, matmul_table=tuple((i, min(1.0, e * scale)) for i, e in base.matmul_table),
                   matmul_efficiency=min(1.0, base.matmul_efficiency * scale),
                   attention_efficiency=float(device["attention_efficiency"]), fusion=float(constants["fusion"]),
                   notes=f"{base.notes}; calibrated on measured steps (runs {', '.join(device['runs'])})")


def _calibrate(presets: dict[str, Hardware], calibration: dict | None) -> dict[str, Hardware]:
    if not calibration:
        return dict(presets)
    devices = calibration.get("devices", {})
    return {name: calibrated(hw, calibration["constants"], devices[name]) if name in devices else hw
            for name, hw in presets.items()}


#: the presets the planner uses: :data:`BASE_PRESETS`, with the GPU ones calibrated where the calibration file holds
#: them (``h100-sxm``, ``h200``)
PRESETS: dict[str, Hardware] = _calibrate(BASE_PRESETS, read_calibration())


def load_hardware(spec: str | Path | Hardware) -> Hardware:
    """A preset by name, or a JSON / YAML file of :class:`Hardware` fields (``base: PRESET`` fills the rest)."""
    if isinstance(spec, Hardware):
        return spec
    text = str(spec)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if not path.is_file():
        raise LayoutError(f"unknown hardware {text!r}: use a preset ({', '.join(PRESETS)}) or a JSON / YAML file "
                          "with the fields of lightning_par.planner.hardware.Hardware.")
    raw = path.read_text()
    if path.suffix == ".json":
        data = json.loads(raw)
    else:
        import yaml

        data = yaml.safe_load(raw)
    if not isinstance(data, dict):
        raise LayoutError(f"{path}: expected a mapping of Hardware fields, got {type(data).__name__}.")
    base = PRESETS.get(data.pop("base", ""), Hardware(name=path.stem))
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise LayoutError(f"{path}: unknown hardware fields {unknown}; the fields are {sorted(known)}.")
    data.setdefault("name", path.stem)
    if "matmul_table" in data:
        table = tuple((float(i), float(e)) for i, e in data["matmul_table"] or ())
        if any(b[0] <= a[0] for a, b in zip(table, table[1:], strict=False)) or any(not 0 < e <= 1 for _, e in table):
            raise LayoutError(f"{path}: matmul_table needs [intensity, efficiency] pairs with increasing intensity "
                              "and efficiencies in (0, 1].")
        data["matmul_table"] = table
    elif "matmul_efficiency" in data:
        data["matmul_table"] = ()  # one efficiency for every shape, as the file says
    if "peak_flops" in data:
        data["peak_flops"] = {**base.peak_flops, **{k: float(v) for k, v in data["peak_flops"].items()}}
    return replace(base, **data)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA devices by name
# ----------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuSpec:
    """One CUDA device model: its dense peak FLOP/s by matmul dtype (``bf16``, ``fp16``, ``tf32``: fp32 matmuls on
    TF32 tensor cores, ``fp32``: without them), the preset the planner uses for it, and what that preset gets wrong
    for it (``preset_note``, empty where the preset is this device)."""

    name: str
    peak_flops: dict[str, float]
    preset: str
    preset_note: str = ""


# Dense peaks (without 2:4 sparsity: NVIDIA's tables print the sparse figure, twice the dense one, marked "*") from
# NVIDIA's datasheets at the boost clock: H100 (SXM5, PCIe, NVL), H200 (SXM, NVL), A100 (40/80 GB, SXM4 and PCIe: the
# same peaks), L40S, and HGX B200 (per GPU, at 1000 W). fp32 is the CUDA cores' rate, what PyTorch's default float32
# matmul precision ("highest") gets; tf32 where TF32 is on. None of these was measured here.
_HOPPER_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}
_HOPPER_NVL = {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}
_AMPERE_A100 = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
_NEAREST = "the plan's step times and the choice between layouts are only as good as that nearest preset"
GPUS: dict[str, GpuSpec] = {
    "h100-sxm": GpuSpec("H100 SXM", _HOPPER_SXM, "h100-sxm"),
    "h100-pcie": GpuSpec("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}, "h100-sxm",
                         "an H100 PCIe has 76% of the SXM's peak, 2.0 TB/s instead of 3.35 and no NVSwitch; "
                         + _NEAREST),
    "h100-nvl": GpuSpec("H100 NVL", _HOPPER_NVL, "h100-sxm",
                        "an H100 NVL has 84% of the SXM's peak, 94 GB at 3.9 TB/s and NVLink bridges between pairs "
                        "only; " + _NEAREST),
    "h200": GpuSpec("H200 SXM", _HOPPER_SXM, "h200"),
    "h200-nvl": GpuSpec("H200 NVL", _HOPPER_NVL, "h200",
                        "an H200 NVL has 84% of the SXM's peak and NVLink bridges instead of NVSwitch; " + _NEAREST),
    "a100-sxm": GpuSpec("A100 SXM4", _AMPERE_A100, "a100"),
    "a100-pcie": GpuSpec("A100 PCIe", _AMPERE_A100, "a100",
                         "the a100 preset is an SXM4 80 GB on NVSwitch; a PCIe card has no NVSwitch and less memory "
                         "bandwidth; " + _NEAREST),
    "l40s": GpuSpec("L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}, "a100",
                    "an L40S has 48 GB of GDDR6 at 0.86 TB/s, PCIe only, and 1.16x the A100's bf16 peak; " + _NEAREST),
    "b200": GpuSpec("B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 75e12}, "h200",
                    "a B200 has 2.3x the H200's bf16 peak, 8 TB/s and NVLink 5 (1.8 TB/s): the plan's step times are "
                    "pessimistic and " + _NEAREST),
}


def detect_gpu(device_name: str) -> GpuSpec | None:
    """The :data:`GPUS` entry for a CUDA device name (``torch.cuda.get_device_name``), or None for a device the table
    does not hold. Names are matched on whole words: "NVIDIA H100 80GB HBM3" is the SXM (CUDA names it without the
    form factor), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"; an L40 or
    a GB200 is not an L40S or a B200."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    if "B200" in words:
        return GPUS["b200"]
    if "L40S" in words:
        return GPUS["l40s"]
    for chip in ("h100", "h200"):
        if chip.upper() in words:
            if "NVL" in words:
                return GPUS[f"{chip}-nvl"]
            if "PCIE" in words and chip == "h100":
                return GPUS["h100-pcie"]
            return GPUS["h100-sxm" if chip == "h100" else "h200"]
    if "A100" in words:
        return GPUS["a100-pcie" if "PCIE" in words else "a100-sxm"]
    return None
