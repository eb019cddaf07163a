"""`PlanConfig`: what `wholebatch plan` needs to know about the run, the model and the cluster.

Every field is a flag of `wholebatch plan` (`--act-mib` is `act_mib`), its help
the docstring under it. Units are in the names: GiB and MiB are 2^30 and 2^20
bytes; GB/s is 10^9 bytes per second; TFLOP/s is 10^12.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from wholebatch.errors import WholebatchError
from wholebatch.losses.specs import SPECS
from wholebatch.planner.mesh import PlanMesh

__all__ = ["DIRECTIONS", "DTYPE_BYTES", "LOSSES", "PlanConfig"]

LOSSES = (*SPECS, "tokens")
DIRECTIONS = tuple(dict.fromkeys(d for s in SPECS.values() for d in s.directions))
# The losses that take hard negatives and directions (InfoNCE).
_WITH_NEGATIVES = tuple(name for name, s in SPECS.items() if s.negatives)
_WITH_DIRECTIONS = tuple(name for name, s in SPECS.items() if s.directions)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
_DEFAULT_WORLD = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """One training configuration to size: loss, batch, model, devices, links."""

    loss: str = "clip"
    """clip, siglip, nt_xent, info_nce (whole-batch contrastive losses), or tokens
    (token-level accumulation of a per-item loss: no loss collectives)."""

    batch: int = 32768
    """N, the global batch of one optimizer step: pairs (clip, siglip, info_nce),
    samples of two views (nt_xent), or sequences (tokens)."""

    dim: int = 512
    """D, the embedding dim the contrastive loss receives."""

    negatives: int = 0
    """k, hard negatives per query (info_nce: each query is scored against all N
    positives and all N x k hard negatives of the whole batch)."""

    directions: str = "query_to_doc"
    """info_nce's directions, comma-separated: query_to_doc (always), doc_to_query,
    query_to_query, doc_to_doc."""

    classes: int = 0
    """supcon: the labels that have a positive in the whole batch (their sums are all-reduced);
    0: N // 2, the most there can be."""

    query_tokens: int = 32
    """maxsim: tokens per query (the largest rank's, after padding)."""

    doc_tokens: int = 180
    """maxsim: tokens per document (the largest rank's, after padding)."""

    strategy: str = ""
    """How the loss reaches other ranks' rows: gather, ring (clip, info_nce; siglip always
    rings) or auto (ring past wholebatch.losses.sizing.AUTO_RING_BYTES of gathered keys);
    "": the loss's default (gather; ring for siglip)."""

    known_sizes: bool = False
    """The loss is called with sizes= and check=False: no cross-rank metadata exchange
    (default: the exchange runs, an all-gather of 10 to 13 float64 per rank)."""

    dtype: str = "bf16"
    """dtype of the embeddings the loss receives: fp32, bf16, fp16 or fp64
    (the tiled kernels compute in float32 for 16-bit inputs)."""

    world: int = 0
    """W, ranks (one per GPU) in the data-parallel group (a flat world of DDP replicas);
    0 (the default): 8 in a flat world, the mesh's size with mesh (a different W is an error)."""

    mesh: str = ""
    """A device mesh instead of a flat world, dims and sizes as for wholebatch verify --mesh,
    e.g. dp=2,tp=2,cp=1,pp=1: dp (FSDP2 shards over dp x cp), dp_replicate (DDP, HSDP's
    replicate dim) and cp split the items; tp replicates them; pp: stages, the loss on the last."""

    gpus_per_node: int = 8
    """GPUs per node: rings within a node use the intra-node link, the rest the inter-node link."""

    memory_gib: float = 80.0
    """Memory of one device, GiB."""

    reserve_gib: float = 3.0
    """Device memory tensors cannot use (CUDA context, NCCL buffers, allocator slack), GiB."""

    act_mib: float = 0.0
    """The model's activation memory per sample, MiB: what one sample's forward keeps for
    backward (wholebatch.planner.measure_model measures it on CPU)."""

    params: float = 0.0
    """The model's parameter count (e.g. 4.28e8)."""

    state_bytes: float = 16.0
    """Bytes per parameter held for training: weights, gradients, optimizer state
    (16: fp32 weights and gradients plus Adam's two moments)."""

    grad_bytes: int = 4
    """Bytes per gradient element on DDP's all-reduce (4: fp32; 2: bf16/fp16 compression)
    and FSDP2's reduce-scatter (a mesh with dp or cp)."""

    param_bytes: int = 4
    """Bytes per parameter element FSDP2 all-gathers, forward and backward (a mesh with dp
    or cp; 4: fp32; 2: MixedPrecisionPolicy(param_dtype=torch.bfloat16))."""

    tokens: int = 256
    """Tokens (or patches) per sample, for the compute estimate 6 x params x tokens FLOPs."""

    flops_per_sample: float = 0.0
    """The model's forward + backward FLOPs per sample; 0: 6 x params x tokens."""

    micro_batches: int = 0
    """K, micro-batches per rank per step; 0: the smallest K that fits."""

    tile: int = 0
    """T, rows and columns of one logits tile; 0: what the losses choose on an accelerator
    (wholebatch.losses.tile_size_for: 3 float32 T x T buffers within 1 GiB, at most the sweep)."""

    intra_gbs: float = 300.0
    """Achieved bandwidth per GPU per direction inside a node, GB/s (NVLink: 300-450)."""

    inter_gbs: float = 40.0
    """Achieved bandwidth per GPU per direction between nodes, GB/s (400 Gb/s InfiniBand: ~45)."""

    latency_us: float = 10.0
    """Latency of one message round, microseconds."""

    tflops: float = 400.0
    """Achieved dense matmul throughput of one device, TFLOP/s (H100 bf16 peak: 989)."""

    hbm_gbs: float = 2500.0
    """Achieved device memory bandwidth, GB/s (the tiles' elementwise passes are bound by it)."""

    json: bool = False
    """Print the plan as JSON instead of tables."""

    plots: str = ""
    """Folder to write PNG plots of memory and bytes against W and batch ("": none)."""

    def __post_init__(self) -> None:
        def bad(name: str, value: object, need: str) -> WholebatchError:
            return WholebatchError(f"{name}={value!r} {need}")

        if self.loss not in LOSSES:
            raise bad("loss", self.loss, f"is not one of {', '.join(LOSSES)}")
        if self.dtype not in DTYPE_BYTES:
            raise bad("dtype", self.dtype, f"is not one of {', '.join(DTYPE_BYTES)}")
        self._check_mesh(bad)
        names = (
            "batch",
            "dim",
            "world",
            "gpus_per_node",
            "tokens",
            "grad_bytes",
            "param_bytes",
            "query_tokens",
            "doc_tokens",
        )
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, value, "must be a positive int")
        for name in ("micro_batches", "tile", "negatives", "classes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(
                    name,
                    value,
                    "must be an int >= 0"
                    + ("" if name == "negatives" else " (0: chosen by the planner)"),
                )
        dirs = self.direction_list
        if not set(dirs) <= set(DIRECTIONS) or DIRECTIONS[0] not in dirs:
            raise bad(
                "directions",
                self.directions,
                f"must be comma-separated names of {', '.join(DIRECTIONS)}, holding query_to_doc",
            )
        if self.negatives and self.loss not in _WITH_NEGATIVES:
            raise bad("negatives", self.negatives, f"applies to {_losses(_WITH_NEGATIVES)} only")
        if dirs != DIRECTIONS[:1] and self.loss not in _WITH_DIRECTIONS:
            raise bad("directions", self.directions, f"applies to {_losses(_WITH_DIRECTIONS)} only")
        spec = SPECS.get(self.loss)
        if self.strategy and (spec is None or self.strategy not in spec.offered()):
            offered = spec.strategies if spec else ()
            raise bad("strategy", self.strategy, f"is not one of {offered} for loss={self.loss!r}")
        if self.world > 65536:
            raise bad("world", self.world, "is above the 65,536 ranks the planner answers for")
        if self.batch < self.shards and self.loss != "tokens":
            where = f"world={self.world}" if not self.mesh else f"the {self.shards} item shards"
            raise bad("batch", self.batch, f"is smaller than {where}: give every rank a row")
        positive = ("memory_gib", "intra_gbs", "inter_gbs", "tflops", "hbm_gbs", "state_bytes")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise bad(name, value, "must be a number > 0")
        for name in ("reserve_gib", "act_mib", "params", "flops_per_sample", "latency_us"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise bad(name, value, "must be a number >= 0")
        if self.reserve_gib >= self.memory_gib:
            raise bad(
                "reserve_gib", self.reserve_gib, f"must be below memory_gib={self.memory_gib}"
            )

    def _check_mesh(self, bad: Callable[[str, object, str], WholebatchError]) -> None:
        """Resolve `world` 0: 8 flat, the mesh's size with `mesh` (a different world: an error)."""
        if not isinstance(self.mesh, str):
            raise bad("mesh", self.mesh, "must be a string of dims and sizes, e.g. 'dp=2,tp=2'")
        if not self.mesh:
            if self.world == 0:
                object.__setattr__(self, "world", _DEFAULT_WORLD)
            return
        shape = PlanMesh.parse(self.mesh)
        if self.world not in (0, shape.world):
            raise bad(
                "world",
                self.world,
                f"differs from the {shape.world} ranks of mesh={self.mesh!r}; "
                "leave world out (it is the mesh's size) or give the same number",
            )
        if self.plots:
            raise bad("plots", self.plots, "sweeps a flat world's W; plot without mesh")
        object.__setattr__(self, "world", shape.world)

    @functools.cached_property
    def mesh_shape(self) -> PlanMesh | None:
        """`mesh` parsed (None: a flat world)."""
        return PlanMesh.parse(self.mesh) if self.mesh else None

    @property
    def shards(self) -> int:
        """B: the item shards, the ranks a whole-batch loss gathers over (W in a flat world;
        dp_replicate x dp x cp on a mesh)."""
        m = self.mesh_shape
        return self.world if m is None else m.batch

    @property
    def direction_list(self) -> tuple[str, ...]:
        """`directions` as a tuple, in the order given, without repeats."""
        return tuple(dict.fromkeys(d.strip() for d in self.directions.split(",") if d.strip()))

    @property
    def elem(self) -> int:
        """Bytes per embedding element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def acc(self) -> int:
        """Bytes per element of the tiled kernels' compute dtype (float32 unless float64)."""
        return max(4, self.elem)

    @property
    def budget(self) -> int:
        """Bytes tensors may use on one device."""
        return int((self.memory_gib - self.reserve_gib) * 2**30)


def _losses(names: tuple[str, ...]) -> str:
    return " or ".join(f"loss={n!r}" for n in names)
