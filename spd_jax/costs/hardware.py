"""Hardware profiles for the cost model (`spd_jax.costs.cycle`): one device's roofline, the fixed costs
that dominate batch-1 decoding on fast devices, and its collectives' latency by kind, device count and the
nodes a collective spans.

A part (a program, or a fused group of kernels) costs the roofline of each of its layers,
max(FLOPs / peak, bytes / (peak bandwidth x achievable fraction)), plus a fixed cost per decoder layer
(`layer_s`: kernel launches and ramp-up, per layer of the model and of a drafter) and one launch
(`launch_s`). A collective over D devices costs its latency, `link_latency_s` plus `hop_latency_s` per
ring step (an all-reduce 2 (D - 1) steps, an all-gather D - 1, a ppermute 1), plus the bytes each device
receives over the achievable link bandwidth: a ring all-reduce 2 (D - 1) / D of the array, an all-gather
(D - 1) packets, a ppermute one.

Two latency classes (`Hardware.latency_class`, `with_latency`): "nccl", NCCL's own latency model
(src/graph/tuning.cc: Ring / LL inside a node; across nodes its ring with the network's per-step latency on
the steps that cross nodes, or for an all-reduce its tree where that is lower, as NCCL's tuner picks), and
"one-shot": a one-shot kernel (each device writes its data into every peer's memory over P2P and reduces
locally; gpt-fast's ENABLE_INTRA_NODE_COMM, SGLang's and vLLM's custom all-reduce) at one fixed latency, inside
a node and for at most `one_shot_max_devices` devices; a collective outside that falls back to NCCL.

Multi-node profiles (`devices_per_node` > 0) place devices node by node, `model` fastest
(`spd_jax.costs.cycle.mesh_nodes`); a collective spanning several nodes pays the network's latency on the
steps that cross nodes and moves its bytes at the network's bandwidth.

Sources of every constant (each profile's `assumes` repeats its own; `spd_jax.costs.calibration` and
`tests/test_calibration.py` check the calibrated ones against the figures they reproduce):
- [gpt-fast] https://github.com/pytorch-labs/gpt-fast README.md, "Tensor Parallelism": Llama-2-7B bf16,
  batch 1, 8 x A100-80GB (330 W, hybrid cube mesh): 104.9 / 168.84 / 254.02 / 328.43 tok/s on 1 / 2 / 4 /
  8 GPUs, run with ENABLE_INTRA_NODE_COMM=1 (torch's one-shot all-reduce) under torch.compile's CUDA
  graphs; its note: "Empirically, seems like peak bandwidth is about 1700 GB/s" (0.83 of 2039).
- [vLLM] https://github.com/gpustack/gpustack docs/performance-lab/qwen3-8b/h100-latency.md, "Other
  Benchmark Cases", BS=1: vLLM v0.11.0, Qwen3-8B bf16, one H100 SXM, mean TPOT 7.28 ms.
- Fitted jointly to [gpt-fast]'s four times and [vLLM]'s (`calibration.figures`, 5 figures, 3 constants):
  GPU_MEM_EFFICIENCY 0.83 (the achievable fraction of peak HBM bandwidth at batch 1), GPU_LAYER_S 50 us
  (fixed per layer) and gpt-fast's one-shot all-reduce 4.5 us (A100_GPT_FAST only); gpt-fast's 1 / 2 / 4 /
  8-GPU times within 2%, vLLM's within 0.2%. For comparison, [sglang] measures one-shot all-reduce kernels
  at 3.7-5.9 us on 2-8 H100s.
- [NCCL] https://github.com/NVIDIA/nccl src/graph/tuning.cc (baseLatencies, hwLatencies, nsteps): Ring /
  LL over NVLink, 6.6 us per collective + 0.6 us per step, 2 (D - 1) steps per all-reduce and D - 1 per
  all-gather: an all-reduce 7.8 us on 2 GPUs, 15.0 on 8 (NCCL_BASE_S, NCCL_NVLINK_HOP_S). XLA runs its GPU
  collectives through NCCL. https://github.com/NVIDIA/nccl/issues/1259 measures ~6 us on 2 H100s inside
  CUDA graphs.
- [NCCL bw] https://github.com/NVIDIA/nccl/issues/1455: ring all-reduce bus bandwidth 365-370 GB/s on 8 x H100
  SXM, "about 80% of 450GBps (NVLink)" (NVLINK_EFFICIENCY 0.8).
- [sglang] https://github.com/sgl-project/sglang/pull/2904: custom one-shot all-reduce on H100, 3.7-5.9 us
  at 512 B-4 kB over 2 / 4 / 8 GPUs (vLLM's 8.5-10.1 us), without CUDA graphs.
- [datasheets] H100 SXM5: 989.4 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 GB/s both ways
  (https://glennklockwood.com/garden/processors/h100, from NVIDIA's datasheet); H200 SXM: 4.8 TB/s HBM3e,
  the same GH100 die (https://ai-hpc.github.io/ai-hardware-engineer-roadmap/, 8x-H200 "Hardware
  Architecture"); A100 SXM4 80GB: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, NVLink 300 + 300 GB/s
  (https://glennklockwood.com/garden/processors/A100).
- [scaling-book] https://github.com/jax-ml/scaling-book (https://jax-ml.github.io/scaling-book/): tpus.md,
  TPU v5e 1.97e14 bf16 FLOP/s, 8.1e11 B/s HBM, ICI 4.5e10 B/s one way per link; v5p 4.59e14, 2.8e12, 9e10;
  sharding.md, "A note on ICI latency": about 1 us per hop (ICI_HOP_S), and a 3-hop all-gather of 32 kB
  shards on v5e measured "closer to 8us": 3 us of hops + 2.6 us of bytes leave ICI_BASE_S 2.5 us; a 4-chip
  all-gather measured at 680 us against 560 us at full bandwidth (ICI_EFFICIENCY 0.82).
- [NCCL net] the same file, NET row: 2.7 us per inter-node Ring / LL step and 5.0 us per Tree / LL level, 6.8 us
  Tree / LL base, and `getNetOverhead`'s 1 us per intra-node step of a multi-node ring (x86 Intel)
  (NCCL_NET_RING_HOP_S, NCCL_NET_TREE_HOP_S, NCCL_TREE_BASE_S, NCCL_NET_OVERHEAD_S). Checks: its own
  predicted 25.2 us for a 128 B all-reduce over 2 x 8 H100s (https://github.com/NVIDIA/nccl/issues/1453,
  "128 Bytes -> Algo 0 proto 0 time 25.214764", which this model gives), and 19.9 us measured for 8 B over 2
  A100 nodes with one GPU each on HDR InfiniBand (https://github.com/NVIDIA/nccl-tests/issues/150; the model
  16.6 us).
- [IB] InfiniBand NDR, one 400 Gb/s ConnectX-7 per GPU as in DGX/HGX H100 nodes: 50 GB/s per GPU per
  direction, "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (https://github.com/NVIDIA/nccl-tests/issues/290,
  a maintainer; IB_EFFICIENCY 0.94).
- [PCIe] NVIDIA L40S (https://www.nvidia.com/en-us/data-center/l40s/ datasheet, as tabulated at
  https://www.mullet.se/product.html?product_id=355414): 362.05 TFLOP/s dense bf16 (733 with sparsity), 864 GB/s
  GDDR6, PCIe Gen4 x16 64 GB/s bidirectional (32 GB/s per direction), no NVLink. An 8-GPU all-reduce of 8 B over
  PCIe measured 42.56 us (8 x RTX 4090, nccl-tests all_reduce_perf, https://github.com/NVIDIA/nccl/issues/1530;
  54.18 us on 8 x RTX 3090, https://github.com/NVIDIA/nccl/issues/1439), twice NCCL's own PCI model (1.0 us a
  step: 20.6 us): PCIE_HOP_S 2.57 us per ring step is fitted to the 42.56 us (`calibration.figures`). vLLM
  refuses its one-shot all-reduce on more than two PCIe-only GPUs ("Custom allreduce is disabled because it's not
  supported on more than two PCIe-only GPUs", vllm/distributed/device_communicators/custom_all_reduce.py), so
  the PCIe profile's one-shot class covers 2 devices only.
- Assumed, no source found: GPU_LAUNCH_S 5 us and TPU_LAUNCH_S 3 us per program inside the on-device loop;
  TPU_LAYER_S 20 us per layer (no published batch-1 TPU step found; XLA fuses a layer into fewer ops than a
  CUDA-graph stack launches); the TPU profiles' HBM fraction (the GPUs' 0.83); the H200 and v5p profiles'
  fixed costs (the H100's and the v5e's); the L40S profile's fixed costs (the H100's fit: 83% of peak GDDR6
  bandwidth, 50 us per layer) and its PCIe efficiency (NVLink's 0.8); the PCIe one-shot latency at 2 devices
  (NVLink's 4.5 us); the one-shot class's 4.5 us on H100 and H200 (gpt-fast's A100 fit; SGLang measures 3.7-5.9
  us for such kernels on H100); Ethernet between nodes (TCP sockets, no RDMA: ETH_HOP_S 20 us per inter-node
  step, the order of a kernel TCP round trip on 100 GbE; 2 x 100 GbE a node, 3.1 GB/s per GPU; no published
  NCCL small-message figure over sockets was found). `docs/projections.md` shows how the projections move with
  the per-layer cost and the collective latency.

This module holds numbers only: it must not run or compile anything.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from spd_jax.models.costs import LayerCost
from spd_jax.models.kinds import KINDS

# the LayerCost kinds that pay `layer_s`: the model's layers and the drafters' (not heads, embeddings, projections)
LAYER_KINDS = (*KINDS, "psm_layer", "eagle3_layer")
COLLECTIVES = ("all_reduce", "all_gather", "ppermute")
LATENCY_CLASSES = ("nccl", "one-shot")
# NCCL's network constants (src/graph/tuning.cc, [NCCL net] above), the same for every GPU profile
NCCL_TREE_BASE_S = 6.8e-6  # Tree / LL base latency
NCCL_NET_OVERHEAD_S = 1e-6  # getNetOverhead: each intra-node step of a ring that spans nodes (x86 Intel)


def ring_steps(kind: str, devices: int) -> int:
    """Latency-bound steps of one collective over `devices` (NCCL's ring model, `nsteps` in
    src/graph/tuning.cc): all-reduce 2 (D - 1), all-gather D - 1, ppermute (one neighbour) 1."""
    if kind not in COLLECTIVES:
        raise ValueError(f"collective kind must be one of {COLLECTIVES}, got {kind!r}")
    return {"all_reduce": 2 * (devices - 1), "all_gather": devices - 1, "ppermute": 1}[kind]


def inter_steps(kind: str, nodes: int) -> int:
    """Of `ring_steps`, those that cross nodes (NCCL's nInterSteps): an all-reduce 2 (N - 1), an all-gather
    N - 1, a ppermute between two nodes 1."""
    if nodes <= 1:
        return 0
    return {"all_reduce": 2 * (nodes - 1), "all_gather": nodes - 1, "ppermute": 1}[kind]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A hardware profile (units in names). The first eight fields are the model's original ones;
    `link_latency_s` is the fixed latency of every NCCL-class collective, to which `hop_latency_s` per ring
    step adds (`ring_steps`); the one-shot class and the network between nodes are optional."""

    name: str
    peak_flops_per_s: float  # dense FLOP/s in the decode dtype
    mem_bytes_per_s: float  # memory (HBM / DRAM) bandwidth, peak (datasheet)
    link_latency_s: float  # fixed latency of one collective (any kind, any device count)
    link_bytes_per_s: float  # per direction, per device, peak
    launch_s: float  # fixed overhead of each part (a program, or a fused group of kernels)
    assumes: str  # what the figures are and where they come from
    projection: bool  # True: figures from published sources, not measured on this machine
    layer_s: float = 0.0  # fixed cost per decoder layer (model or PSM): launches and ramp-up of its kernels
    mem_efficiency: float = 1.0  # achievable fraction of mem_bytes_per_s at batch 1
    link_efficiency: float = 1.0  # achievable fraction of link_bytes_per_s
    hop_latency_s: float = 0.0  # latency per ring step of a collective (`ring_steps`)
    stage_efficiency: float = 1.0  # the pipeline stages' programs' bandwidth relative to the others' (CPU fit)
    latency_class: str = "nccl"  # which latency small collectives pay: "nccl" or "one-shot" (module docstring)
    one_shot_latency_s: float = 0.0  # a one-shot collective inside a node; 0: none on this hardware
    one_shot_max_devices: int = 0  # the most devices a one-shot kernel serves (PCIe: 2)
    devices_per_node: int = 0  # devices joined by the fast link; 0: every device (one box, or a TPU slice)
    net_hop_latency_s: float = 0.0  # each ring step that crosses nodes (NCCL's Ring / LL NET)
    net_tree_latency_s: float = 0.0  # each tree level across nodes (NCCL's Tree / LL NET; also a ring's steps
    #                                  when every device is on a node of its own: NCCL's ppn = 1)
    net_bytes_per_s: float = 0.0  # per direction, per device, between nodes, peak
    net_efficiency: float = 1.0  # achievable fraction of net_bytes_per_s

    def __post_init__(self):
        if self.latency_class not in LATENCY_CLASSES:
            raise ValueError(f"latency_class must be one of {LATENCY_CLASSES}, got {self.latency_class!r}")

    def with_latency(self, latency_class: str) -> "Hardware":
        """The same hardware, its collectives at `latency_class` ("nccl" or "one-shot")."""
        return dataclasses.replace(self, latency_class=latency_class)

    @property
    def has_one_shot(self) -> bool:
        """Whether the one-shot class differs from NCCL's anywhere on this hardware."""
        return self.one_shot_latency_s > 0 and self.one_shot_max_devices > 1

    def seconds(self, c: LayerCost, stage: bool = False) -> float:
        """One layer's roofline at the achievable bandwidth (a pipeline stage's program: times
        `stage_efficiency`)."""
        bw = self.mem_bytes_per_s * self.mem_efficiency * (self.stage_efficiency if stage else 1.0)
        return c.seconds(self.peak_flops_per_s, bw)

    def part_s(self, costs: Sequence[LayerCost], stage: bool = False) -> float:
        """One part: the roofline of each of its layers, summed, its decoder layers' fixed costs, and one
        launch. stage: a pipeline stage's program (`stage_efficiency`)."""
        return (sum(self.seconds(c, stage) for c in costs) + self.layer_s * sum(c.kind in LAYER_KINDS for c in costs)
                + self.launch_s)

    def latency_s(self, kind: str, devices: int, nodes: int = 1) -> float:
        """The latency of one collective of `kind` over `devices` spread over `nodes` nodes (0 on one
        device): the one-shot latency where the class and the group allow it, else NCCL's model: inside a
        node its ring (`link_latency_s` + `hop_latency_s` a step); across nodes the ring with the network's
        latency on the steps that cross nodes and at least NCCL's net overhead on the others, or, for an
        all-reduce, its tree where lower."""
        if devices <= 1:
            return 0.0
        steps = ring_steps(kind, devices)
        if (self.latency_class == "one-shot" and self.has_one_shot and nodes <= 1
                and devices <= self.one_shot_max_devices):
            return self.one_shot_latency_s
        if nodes <= 1:
            return self.link_latency_s + self.hop_latency_s * steps
        cross = inter_steps(kind, nodes)
        net = self.net_tree_latency_s if devices == nodes else self.net_hop_latency_s  # NCCL: ppn = 1, tree's
        ring = (self.link_latency_s + (steps - cross) * max(self.hop_latency_s, NCCL_NET_OVERHEAD_S)
                + cross * net)
        if kind != "all_reduce":
            return ring
        tree = NCCL_TREE_BASE_S + 2 * ((devices // nodes - 1) * self.hop_latency_s
                                       + (nodes.bit_length() - 1) * self.net_tree_latency_s)  # log2i
        return min(ring, tree)

    def collective_s(self, kind: str, nbytes: float, devices: int, nodes: int = 1) -> float:
        """One collective over `devices` (on `nodes` nodes): its latency plus the bytes each device receives
        over the achievable link bandwidth (the network's where it spans nodes: its slowest link). nbytes:
        the array all-reduced, each device's packet of an all-gather, or what a ppermute sends."""
        if devices <= 1:
            return 0.0
        moved = {"all_reduce": 2 * (devices - 1) / devices * nbytes, "all_gather": (devices - 1) * nbytes,
                 "ppermute": nbytes}[kind]
        bw = (self.net_bytes_per_s * self.net_efficiency if nodes > 1
              else self.link_bytes_per_s * self.link_efficiency)
        return self.latency_s(kind, devices, nodes) + moved / bw

    def nodes(self, devices: int) -> int:
        """Nodes `devices` consecutive devices occupy (1 without nodes)."""
        return max(1, -(-devices // self.devices_per_node)) if self.devices_per_node else 1

    def ppermute_s(self, nbytes: float, nodes: int = 1) -> float:
        return self.collective_s("ppermute", nbytes, 2, nodes)

    def all_reduce_s(self, nbytes: float, n: int, nodes: int = 1) -> float:
        """A ring all-reduce over n devices: each sends and receives 2 (n - 1) / n of the bytes."""
        return self.collective_s("all_reduce", nbytes, n, nodes)

    def all_gather_s(self, packet_bytes: float, n: int, nodes: int = 1) -> float:
        """An all-gather over n devices of one packet each: each receives the n - 1 others'."""
        return self.collective_s("all_gather", packet_bytes, n, nodes)


# ---------------------------------------------------------------- the constants (sources: the module docstring)

GPU_MEM_EFFICIENCY = 0.83  # fitted: [gpt-fast] + [vLLM]
GPU_LAYER_S = 50e-6  # fitted: [gpt-fast] + [vLLM]
NCCL_BASE_S, NCCL_NVLINK_HOP_S = 6.6e-6, 0.6e-6  # [NCCL]
NVLINK_EFFICIENCY = 0.8  # [NCCL bw]
GPU_LAUNCH_S = 5e-6  # assumed
ONE_SHOT_S = 4.5e-6  # fitted on gpt-fast's A100 ([gpt-fast]); assumed to carry over to H100 / H200 ([sglang]: 3.7-5.9)
NCCL_NET_RING_HOP_S, NCCL_NET_TREE_HOP_S = 2.7e-6, 5.0e-6  # [NCCL net]
IB_BYTES_PER_S, IB_EFFICIENCY = 50e9, 0.94  # [IB]: NDR 400 Gb/s a GPU; 46-48 of 50 GB/s
ETH_HOP_S = 20e-6  # assumed: TCP sockets, no RDMA
ETH_BYTES_PER_S = 25e9 / 8  # assumed: 2 x 100 GbE a node, shared by its 8 GPUs
PCIE_HOP_S = 2.57e-6  # fitted: [PCIe] 42.56 us for an 8-GPU all-reduce = 6.6 + 14 steps x 2.57
GPUS_PER_NODE = 8

H100_NVLINK = Hardware(
    "H100-SXM-NVLink", peak_flops_per_s=989e12, mem_bytes_per_s=3.35e12, link_latency_s=NCCL_BASE_S,
    link_bytes_per_s=450e9, launch_s=GPU_LAUNCH_S, layer_s=GPU_LAYER_S, mem_efficiency=GPU_MEM_EFFICIENCY,
    link_efficiency=NVLINK_EFFICIENCY, hop_latency_s=NCCL_NVLINK_HOP_S, projection=True,
    one_shot_latency_s=ONE_SHOT_S, one_shot_max_devices=GPUS_PER_NODE,
    assumes="projection, not measured: NVIDIA H100 SXM (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 "
            "450 GB/s per direction); 83% of peak bandwidth at batch 1 and 50 us fixed per layer, fitted jointly to "
            "gpt-fast's Llama-2-7B on one A100 and vLLM's Qwen3-8B on one H100 (7.28 ms/token); collectives by "
            "NCCL's latency model (6.6 us + 0.6 us per ring step; 80% of NVLink, nccl issue 1455), or one-shot at "
            "4.5 us (gpt-fast's A100 fit, assumed); 5 us per program assumed; bf16")
H200_NVLINK = dataclasses.replace(
    H100_NVLINK, name="H200-SXM-NVLink", mem_bytes_per_s=4.8e12,
    assumes="projection, not measured: NVIDIA H200 SXM (989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, NVLink 4 "
            "450 GB/s per direction); the H100 profile's calibrated fixed costs (83% of peak bandwidth, 50 us per "
            "layer) and NCCL's collective latencies (6.6 us + 0.6 us per ring step), or one-shot at 4.5 us, assumed "
            "to carry over; bf16")
# gpt-fast's machine, for the calibration only: its one-shot all-reduce (4.5 us, fitted), not NCCL's ring
A100_GPT_FAST = Hardware(
    "A100-80GB (gpt-fast's machine)", peak_flops_per_s=312e12, mem_bytes_per_s=2.039e12, link_latency_s=NCCL_BASE_S,
    link_bytes_per_s=300e9, launch_s=GPU_LAUNCH_S, layer_s=GPU_LAYER_S, mem_efficiency=GPU_MEM_EFFICIENCY,
    link_efficiency=NVLINK_EFFICIENCY, hop_latency_s=NCCL_NVLINK_HOP_S, projection=True, latency_class="one-shot",
    one_shot_latency_s=ONE_SHOT_S, one_shot_max_devices=GPUS_PER_NODE,
    assumes="calibration only: NVIDIA A100 SXM4 80GB (312 TFLOP/s bf16, 2.039 TB/s HBM2e, NVLink 3 300 "
            "GB/s per direction); the GPU fixed costs (83%, 50 us per layer); gpt-fast's one-shot all-reduce under "
            "CUDA graphs 4.5 us at any device count, fitted with them to its TP curve (3.7-5.9 us for such one-shot "
            "kernels on H100: sgl-project/sglang pull 2904)")
# a GPU box without NVLink: 8 x L40S on PCIe Gen4 ([PCIe])
L40S_PCIE = Hardware(
    "L40S-PCIe", peak_flops_per_s=362e12, mem_bytes_per_s=864e9, link_latency_s=NCCL_BASE_S,
    link_bytes_per_s=32e9, launch_s=GPU_LAUNCH_S, layer_s=GPU_LAYER_S, mem_efficiency=GPU_MEM_EFFICIENCY,
    link_efficiency=NVLINK_EFFICIENCY, hop_latency_s=PCIE_HOP_S, projection=True,
    one_shot_latency_s=ONE_SHOT_S, one_shot_max_devices=2,
    assumes="projection, not measured: 8 x NVIDIA L40S on PCIe Gen4 x16, no NVLink (362 TFLOP/s dense bf16, "
            "864 GB/s GDDR6, 32 GB/s per direction); the H100 fit's 83% of peak bandwidth and 50 us per layer "
            "(assumed); NCCL's 6.6 us + 2.57 us per ring step, fitted to a measured 42.6 us 8-GPU all-reduce over "
            "PCIe (RTX 4090, nccl issue 1530); one-shot only on 2 GPUs (vLLM refuses it on more PCIe-only GPUs), "
            "at 4.5 us (assumed); 80% of PCIe (assumed); bf16")
# clusters: nodes of 8 H100s on NVLink, joined by InfiniBand NDR or by Ethernet
H100_IB = dataclasses.replace(
    H100_NVLINK, name="H100-nodes-IB", devices_per_node=GPUS_PER_NODE, net_hop_latency_s=NCCL_NET_RING_HOP_S,
    net_tree_latency_s=NCCL_NET_TREE_HOP_S, net_bytes_per_s=IB_BYTES_PER_S, net_efficiency=IB_EFFICIENCY,
    assumes="projection, not measured: nodes of 8 H100 SXM on NVLink (the H100 profile) joined by InfiniBand NDR, "
            "one 400 Gb/s NIC per GPU (50 GB/s, 94% achieved: nccl-tests issue 290); between nodes NCCL's network "
            "latencies (2.7 us a ring step, 5.0 us a tree level, 1 us net overhead: tuning.cc); one-shot only "
            "inside a node; bf16")
H100_ETH = dataclasses.replace(
    H100_IB, name="H100-nodes-Ethernet", net_hop_latency_s=ETH_HOP_S, net_tree_latency_s=ETH_HOP_S,
    net_bytes_per_s=ETH_BYTES_PER_S, net_efficiency=NVLINK_EFFICIENCY,
    assumes="projection, not measured: nodes of 8 H100 SXM on NVLink (the H100 profile) joined by Ethernet "
            "without RDMA (NCCL over TCP sockets): 20 us per step that crosses nodes and 2 x 100 GbE a node (3.1 "
            "GB/s a GPU, 80% achieved), all assumed (no published small-message figure found); one-shot only "
            "inside a node; bf16")
ICI_BASE_S, ICI_HOP_S = 2.5e-6, 1e-6  # [scaling-book]
ICI_EFFICIENCY = 0.82  # [scaling-book]
TPU_LAYER_S = 20e-6  # assumed
TPU_LAUNCH_S = 3e-6  # assumed
TPU_V5E_ICI = Hardware(
    "TPU-v5e-ICI", peak_flops_per_s=197e12, mem_bytes_per_s=810e9, link_latency_s=ICI_BASE_S,
    link_bytes_per_s=45e9, launch_s=TPU_LAUNCH_S, layer_s=TPU_LAYER_S, mem_efficiency=GPU_MEM_EFFICIENCY,
    link_efficiency=ICI_EFFICIENCY, hop_latency_s=ICI_HOP_S, projection=True,
    assumes="projection, not measured: TPU v5e (197 TFLOP/s bf16, 810 GB/s HBM2; ICI 45 GB/s one way per "
            "link, jax-ml/scaling-book); collectives 2.5 us + 1 us per hop (scaling-book's ICI latency note and its "
            "measured 8 us 3-hop all-gather), 82% of ICI, one latency class (no NCCL, no one-shot kernel); 83% of "
            "peak HBM (the GPU calibration's, assumed) and 20 us per layer (assumed: no published batch-1 TPU "
            "figure); bf16")
TPU_V5P_ICI = dataclasses.replace(
    TPU_V5E_ICI, name="TPU-v5p-ICI", peak_flops_per_s=459e12, mem_bytes_per_s=2.8e12, link_bytes_per_s=90e9,
    assumes="projection, not measured: TPU v5p (459 TFLOP/s bf16, 2.8 TB/s HBM2e; ICI 90 GB/s one way per "
            "link, jax-ml/scaling-book); latencies, efficiencies and the per-layer cost as the v5e profile's "
            "(assumed); bf16")

PROFILES = {hw.name: hw for hw in (H100_NVLINK, H200_NVLINK, TPU_V5E_ICI, TPU_V5P_ICI, L40S_PCIE, H100_IB, H100_ETH)}
