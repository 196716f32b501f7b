"""Model and hardware specs for the cost model, their presets, and loading them from JSON.

Units: sizes in bytes (B), bandwidths in bytes per second (B/s, decimal: 1 GB/s = 1e9 B/s),
compute in FLOP/s. Every preset's numbers and where they come from are listed in
docs/cost-model.md; the short `source` notes live in `MODEL_PRESET_SOURCES` and
`HARDWARE_PRESET_SOURCES` (they are not part of the spec).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eplb.errors import EplbError, FieldError, shown
from eplb.io.files import existing_file, json_kind, plural, read_json, usable_path

__all__ = [
    "HARDWARE_PRESETS",
    "HARDWARE_PRESET_SOURCES",
    "MODEL_PRESETS",
    "MODEL_PRESET_SOURCES",
    "HardwareSpec",
    "ModelSpec",
    "all_to_all_links",
    "hardware_from_dict",
    "link_bandwidth",
    "load_hardware",
    "load_model",
    "model_from_dict",
    "model_preset",
    "named_model",
    "service_preset",
]

# Optional keys a spec file may carry besides the spec's fields; they are ignored.
_NOTE_KEYS = frozenset({"source", "notes"})
SpecT = TypeVar("SpecT", bound=BaseModel)


class ModelSpec(BaseModel):
    """The MoE part of a model: what the cost model needs per MoE layer (one definition: presets, spec files and
    the API's request bodies are all validated by it).

    Experts are SwiGLU FFNs (gate, up, down), so one expert has 3 x hidden x intermediate
    parameters. Shared experts are assumed to have the routed experts' width
    (DeepSeek-style: n_shared x moe_intermediate_size).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, defer_build=True)
    name: str = Field(min_length=1, max_length=200)
    num_moe_layers: int = Field(ge=1, le=10_000, description="MoE layers (dense-FFN layers excluded)")
    first_dense_layers: int = Field(0, ge=0, le=10_000, description="dense-FFN layers before the MoE layers "
                                    "(config.json's first_k_dense_replace; 0: every layer is MoE): the model "
                                    "layers are 0..first_dense_layers + num_moe_layers - 1, the MoE ones last")
    num_experts: int = Field(ge=1, le=65_536, description="routed experts per MoE layer (E)")
    top_k: int = Field(ge=1, le=65_536, description="routed experts chosen per token (k)")
    num_shared_experts: int = Field(ge=0, le=1024, description="experts every token goes through (0 if none)")
    hidden_size: int = Field(ge=1, le=1_000_000, description="model width")
    moe_intermediate_size: int = Field(ge=1, le=1_000_000, description="one expert's FFN width")
    expert_bytes_per_param: float = Field(gt=0, le=16, description="routed expert weights, scales included (B/param)")
    shared_bytes_per_param: float = Field(gt=0, le=16, description="shared expert weights (B/param)")
    dispatch_bytes_per_copy: float = Field(gt=0, le=1e9, description="bytes sent per token copy at dispatch (B)")
    combine_bytes_per_copy: float = Field(gt=0, le=1e9, description="bytes sent back per token copy at combine (B)")

    @model_validator(mode="after")
    def _top_k_fits(self) -> ModelSpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        return self

    @property
    def num_model_layers(self) -> int:
        """Every layer of the model, dense ones included (DeepSeek-V3: 3 + 58 = 61)."""
        return self.first_dense_layers + self.num_moe_layers

    def moe_layer_ids(self) -> list[int]:
        """The model layer of each MoE layer (DeepSeek-V3: 3..60), as SGLang and TensorRT-LLM number them."""
        return list(range(self.first_dense_layers, self.num_model_layers))

    def window_mismatch(
        self, layers: int, experts: int, what: str = "the window has", names: Mapping[str, str] | None = None
    ) -> str | None:
        """What is wrong with data of `layers` x `experts` as this model's, or None: the one rule of a model and its
        data (POST /placement, deployments, `eplb solve`/`evaluate`/`replay`/`compare`, `eplb.replay.replay`,
        `eplb synth`). Its rows must have the model's routed experts, and it may hold at most one row per MoE layer
        (fewer are a part of the model; more name MoE layers the model does not have, which an export would write
        as model layers). what: the data's name and verb ('the log has', 'the loads have'); names: what the text
        calls the data's "experts" and "layers" (the flags that set them: `eplb synth`'s), if anything. The way out
        is the caller's to add, in its words (`eplb.solve.model_mismatch`)."""

        def ref(size: str) -> str:
            return f" ({names[size]})" if names and size in names else ""

        if experts != self.num_experts:
            return (f"{what} {plural(experts, 'expert')}{ref('experts')}, but model {shown(self.name)} has "
                    f"{self.num_experts}")
        if layers > self.num_moe_layers:
            dense = f", the first {self.first_dense_layers} dense" if self.first_dense_layers else ""
            return (f"{what} {plural(layers, 'layer')}{ref('layers')}, but model {shown(self.name)} has "
                    f"{plural(self.num_moe_layers, 'MoE layer')} ({plural(self.num_model_layers, 'layer')}{dense})")
        return None

    def window_rows(self) -> str:
        """The data this model takes (`window_mismatch`'s rule said the other way), for a way out: 'one row per MoE
        layer, at most 58 (fewer are a part of the model), of its 256 experts'."""
        return (f"one row per MoE layer, at most {self.num_moe_layers:,} (fewer are a part of the model), of its "
                f"{plural(self.num_experts, 'expert')}")

    @property
    def expert_params(self) -> int:
        """Parameters of one expert in one layer: 3 x hidden x intermediate (gate + up + down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def flops_per_row(self) -> float:
        """FLOP for one token row through one expert: 2 x expert_params (one multiply-add each)."""
        return 2.0 * self.expert_params

    @property
    def expert_bytes(self) -> float:
        """Bytes of one routed expert in one layer (B)."""
        return self.expert_params * self.expert_bytes_per_param

    @property
    def shared_expert_bytes(self) -> float:
        """Bytes of all shared experts of one layer together (B); 0 without shared experts."""
        return self.num_shared_experts * self.expert_params * self.shared_bytes_per_param

    @property
    def expert_bytes_all_layers(self) -> float:
        """Bytes one physical expert slot costs in HBM across all MoE layers (B)."""
        return self.expert_bytes * self.num_moe_layers

    def to_dict(self) -> dict[str, Any]:
        """The spec as a JSON-ready dict with exactly the spec's field names."""
        return self.model_dump()


class HardwareSpec(BaseModel):
    """One GPU: peak dense compute, HBM, and the two links all-to-all traffic can take."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, defer_build=True)
    name: str = Field(min_length=1, max_length=200)
    dense_flops: float = Field(gt=0, le=1e19, description="FLOP/s, dense, at the expert GEMM's compute precision")
    hbm_bandwidth: float = Field(gt=0, le=1e15, description="B/s")
    hbm_capacity: float = Field(gt=0, le=1e15, description="B")
    nvlink_bandwidth: float = Field(gt=0, le=1e15, description="B/s, one direction, per GPU")
    nic_bandwidth: float = Field(gt=0, le=1e15, description="B/s, one direction, per GPU (scale-out network)")

    def to_dict(self) -> dict[str, Any]:
        """The spec as a JSON-ready dict with exactly the spec's field names."""
        return self.model_dump()


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

MODEL_PRESETS: dict[str, ModelSpec] = {
    "deepseek-v4.1-flash": ModelSpec.model_construct(
        name="deepseek-v4.1-flash",
        num_moe_layers=40,
        num_experts=384,
        top_k=6,
        num_shared_experts=1,
        hidden_size=5120,
        moe_intermediate_size=2304,
        expert_bytes_per_param=0.53125,
        shared_bytes_per_param=1.0,
        dispatch_bytes_per_copy=5376,
        combine_bytes_per_copy=10240,
    ),
    "deepseek-v3": ModelSpec.model_construct(
        name="deepseek-v3",
        num_moe_layers=58,
        first_dense_layers=3,
        num_experts=256,
        top_k=8,
        num_shared_experts=1,
        hidden_size=7168,
        moe_intermediate_size=2048,
        expert_bytes_per_param=1.0,
        shared_bytes_per_param=1.0,
        dispatch_bytes_per_copy=7392,
        combine_bytes_per_copy=14336,
    ),
    "kimi-k2": ModelSpec.model_construct(
        name="kimi-k2",
        num_moe_layers=60,
        first_dense_layers=1,
        num_experts=384,
        top_k=8,
        num_shared_experts=1,
        hidden_size=7168,
        moe_intermediate_size=2048,
        expert_bytes_per_param=1.0,
        shared_bytes_per_param=1.0,
        dispatch_bytes_per_copy=7392,
        combine_bytes_per_copy=14336,
    ),
    "qwen3-235b-a22b": ModelSpec.model_construct(
        name="qwen3-235b-a22b",
        num_moe_layers=94,
        num_experts=128,
        top_k=8,
        num_shared_experts=0,
        hidden_size=4096,
        moe_intermediate_size=1536,
        expert_bytes_per_param=2.0,
        shared_bytes_per_param=2.0,
        dispatch_bytes_per_copy=8192,
        combine_bytes_per_copy=8192,
    ),
    "mixtral-8x7b": ModelSpec.model_construct(
        name="mixtral-8x7b",
        num_moe_layers=32,
        num_experts=8,
        top_k=2,
        num_shared_experts=0,
        hidden_size=4096,
        moe_intermediate_size=14336,
        expert_bytes_per_param=2.0,
        shared_bytes_per_param=2.0,
        dispatch_bytes_per_copy=8192,
        combine_bytes_per_copy=8192,
    ),
    "deepseek-v2-lite": ModelSpec.model_construct(
        name="deepseek-v2-lite",
        num_moe_layers=26,
        first_dense_layers=1,
        num_experts=64,
        top_k=6,
        num_shared_experts=2,
        hidden_size=2048,
        moe_intermediate_size=1408,
        expert_bytes_per_param=2.0,
        shared_bytes_per_param=2.0,
        dispatch_bytes_per_copy=4096,
        combine_bytes_per_copy=4096,
    ),
    "gpt-oss-120b": ModelSpec.model_construct(
        name="gpt-oss-120b",
        num_moe_layers=36,
        num_experts=128,
        top_k=4,
        num_shared_experts=0,
        hidden_size=2880,
        moe_intermediate_size=2880,
        expert_bytes_per_param=0.53125,
        shared_bytes_per_param=2.0,
        dispatch_bytes_per_copy=5760,
        combine_bytes_per_copy=5760,
    ),
}

MODEL_PRESET_SOURCES: dict[str, str] = {
    "deepseek-v4.1-flash": (
        "seed 000 (DeepInfer/DeepSeek V4.1-Flash MoE: 384 routed, top-6, 1 shared, hidden 5120, "
        "intermediate 2304, FP4 routed experts with scales 0.53125 B/param, FP8 shared 1 B/param, "
        "5376 B dispatch FP8 + 10240 B combine BF16 per copy). num_moe_layers=40 is not in the seed: "
        "taken from public write-ups of the release's config.json (40 layers, every one MoE)."
    ),
    "deepseek-v3": (
        "deepseek-ai/DeepSeek-V3 config.json: n_routed_experts 256, num_experts_per_tok 8, "
        "n_shared_experts 1, hidden_size 7168, moe_intermediate_size 2048, num_hidden_layers 61 with "
        "first_k_dense_replace 3 -> 58 MoE layers; FP8 weights (block scales, ~0.02% extra, ignored). "
        "Dispatch 7168 B FP8 + 56 x 4 B per-128-channel scales = 7392 B; combine 7168 x 2 B BF16."
    ),
    "kimi-k2": (
        "moonshotai/Kimi-K2-Instruct config.json: n_routed_experts 384, num_experts_per_tok 8, "
        "n_shared_experts 1, hidden_size 7168, moe_intermediate_size 2048, num_hidden_layers 61 with "
        "first_k_dense_replace 1 -> 60 MoE layers; FP8 block-quantized weights. Dispatch/combine as "
        "deepseek-v3 (same hidden size)."
    ),
    "qwen3-235b-a22b": (
        "Qwen/Qwen3-235B-A22B config.json: num_experts 128, num_experts_per_tok 8, no shared expert, "
        "hidden_size 4096, moe_intermediate_size 1536, num_hidden_layers 94, all MoE; BF16 weights "
        "and BF16 dispatch/combine (4096 x 2 B)."
    ),
    "mixtral-8x7b": (
        "mistralai/Mixtral-8x7B-v0.1 config.json: num_local_experts 8, num_experts_per_tok 2, "
        "hidden_size 4096, intermediate_size 14336, num_hidden_layers 32, all MoE; BF16 weights "
        "and BF16 dispatch/combine."
    ),
    "deepseek-v2-lite": (
        "deepseek-ai/DeepSeek-V2-Lite config.json: n_routed_experts 64, num_experts_per_tok 6, "
        "n_shared_experts 2, hidden_size 2048, moe_intermediate_size 1408, num_hidden_layers 27 with "
        "first_k_dense_replace 1 (26 MoE layers); BF16 weights and BF16 dispatch/combine (2048 x 2 B)."
    ),
    "gpt-oss-120b": (
        "openai/gpt-oss-120b config.json: num_local_experts 128, experts_per_token 4, hidden_size 2880, "
        "intermediate_size 2880, num_hidden_layers 36, all MoE, no shared expert; MXFP4 experts "
        "(4 bit + one 8-bit scale per 32 = 0.53125 B/param), BF16 dispatch/combine (2880 x 2 B). "
        "shared_bytes_per_param is unused (no shared expert)."
    ),
}

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "b200": HardwareSpec.model_construct(
        name="b200",
        dense_flops=4.5e15,
        hbm_bandwidth=8.0e12,
        hbm_capacity=180e9,
        nvlink_bandwidth=900e9,
        nic_bandwidth=100e9,
    ),
    "b200-fp4": HardwareSpec.model_construct(
        name="b200-fp4",
        dense_flops=9.0e15,
        hbm_bandwidth=8.0e12,
        hbm_capacity=180e9,
        nvlink_bandwidth=900e9,
        nic_bandwidth=100e9,
    ),
    "h100": HardwareSpec.model_construct(
        name="h100",
        dense_flops=1.979e15,
        hbm_bandwidth=3.35e12,
        hbm_capacity=80e9,
        nvlink_bandwidth=450e9,
        nic_bandwidth=50e9,
    ),
    "h200": HardwareSpec.model_construct(
        name="h200",
        dense_flops=1.979e15,
        hbm_bandwidth=4.8e12,
        hbm_capacity=141e9,
        nvlink_bandwidth=450e9,
        nic_bandwidth=50e9,
    ),
    "h800": HardwareSpec.model_construct(
        name="h800",
        dense_flops=1.979e15,
        hbm_bandwidth=3.35e12,
        hbm_capacity=80e9,
        nvlink_bandwidth=200e9,
        nic_bandwidth=50e9,
    ),
    "h20": HardwareSpec.model_construct(
        name="h20",
        dense_flops=2.96e14,
        hbm_bandwidth=4.0e12,
        hbm_capacity=96e9,
        nvlink_bandwidth=450e9,
        nic_bandwidth=50e9,
    ),
}

HARDWARE_PRESET_SOURCES: dict[str, str] = {
    "b200": (
        "seed 000: 4.5 PFLOP/s dense FP8, 8 TB/s HBM3e, NVLink 900 GB/s per direction, 100 GB/s NIC "
        "per GPU (seed 000 figure 4, right panel). 180 GB HBM per GPU as HGX/DGX B200 expose it "
        "(the package carries 192 GB)."
    ),
    "b200-fp4": (
        "B200 with FP4 activations (FP4 x FP4 GEMMs): 9 PFLOP/s dense, otherwise as b200; seed 000 figure 7's last bar."
    ),
    "h100": (
        "H100 SXM datasheet: 1979 TFLOP/s dense FP8 (3958 with sparsity), 3.35 TB/s HBM3, 80 GB, "
        "NVLink 4 900 GB/s total = 450 GB/s per direction; NIC 400 Gb/s ConnectX-7 per GPU = 50 GB/s."
    ),
    "h200": (
        "H200 SXM datasheet: 1979 TFLOP/s dense FP8, 4.8 TB/s HBM3e, 141 GB, NVLink 450 GB/s per "
        "direction; NIC 400 Gb/s per GPU = 50 GB/s."
    ),
    "h800": (
        "H800 SXM: H100 compute and memory (1979 TFLOP/s dense FP8, 3.35 TB/s, 80 GB) with NVLink cut "
        "to 400 GB/s total = 200 GB/s per direction; NIC 400 Gb/s InfiniBand per GPU = 50 GB/s "
        "(as in DeepSeek's clusters)."
    ),
    "h20": (
        "H20: 296 TFLOP/s dense FP8, 4.0 TB/s HBM3, 96 GB, NVLink 900 GB/s total = 450 GB/s per "
        "direction; NIC assumed 400 Gb/s per GPU = 50 GB/s."
    ),
}


# --------------------------------------------------------------------------------------------
# Loading and validation
# --------------------------------------------------------------------------------------------

def _from_dict(cls: type[SpecT], spec_kind: str, d: Any) -> SpecT:
    """Validate a spec dict (its field names, plus optional "source"/"notes") into `cls`; one-line errors."""
    if not isinstance(d, Mapping):
        raise EplbError(f"{spec_kind} spec must be a JSON object, got {type(d).__name__}")
    try:
        return cls.model_validate({k: v for k, v in d.items() if k not in _NOTE_KEYS})
    except ValidationError as exc:
        first = exc.errors()[0]
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        fields = f"; the fields are {', '.join(cls.model_fields)}"
        where = ".".join(str(p) for p in first["loc"])
        raise EplbError(f"{spec_kind} spec: {_explain(first, where, fields)}{more}") from None


def _explain(error: Any, field: str, fields: str) -> str:
    """One pydantic error as the words a spec file's author reads."""
    kind, ctx, got = error["type"], error.get("ctx", {}), error.get("input")
    if kind == "missing":
        return f"missing field {field}{fields}"
    if kind == "extra_forbidden":
        return f"unknown field {field}{fields}"
    if kind == "greater_than":
        return f"{field} must be a positive number, got {shown(got)}"
    if kind == "greater_than_equal":
        bound = ctx.get("ge")
        need = {0: "0 or more", 1: "a positive integer"}.get(bound, f">= {bound}")
        return f"{field} must be {need}, got {shown(got)}"
    if kind == "less_than_equal":
        return f"{field} must be at most {ctx.get('le')}, got {shown(got)}"
    if kind.startswith("int"):
        return f"{field} must be an integer, got {shown(got)}"
    if kind.startswith(("float", "bool")):
        return f"{field} must be a number, got {shown(got)}"
    if kind.startswith("string"):
        return f"{field} must be a non-empty string, got {shown(got)}"
    return f"{field + ': ' if field else ''}{str(error['msg']).removeprefix('Value error, ')}"


def model_from_dict(d: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a dict with exactly its field names (plus optional "source"/"notes")."""
    return _from_dict(ModelSpec, "model", d)


def hardware_from_dict(d: Mapping[str, Any]) -> HardwareSpec:
    """A HardwareSpec from a dict with exactly its field names (plus optional "source"/"notes")."""
    return _from_dict(HardwareSpec, "hardware", d)


def _looks_like_path(s: str) -> bool:
    return s.endswith(".json") or os.sep in s or "/" in s


def _preset(name: str, presets: Mapping[str, SpecT]) -> SpecT | None:
    """The preset `name` names: case-insensitive, spaces around it ignored; None when it names none."""
    return presets.get(name.strip().lower())


def model_preset(name: str | None) -> ModelSpec | None:
    """The model preset `name` names (case-insensitive, spaces around it ignored: ' DeepSeek-V3 '), or None (no
    name, or no preset's): the one lookup of a name a log, a file or a flag gives."""
    return None if name is None else _preset(name, MODEL_PRESETS)


def service_preset(name: str, presets: Mapping[str, SpecT], field: str) -> SpecT:
    """The preset `name` names (`_preset`: case-insensitive, spaces around it ignored) for the service's `model` or
    `hardware` field (presets only, never a file path); a FieldError naming `field` when it names none."""
    preset = _preset(name, presets)
    if preset is None:
        raise FieldError(field, f"unknown preset {shown(name)}; known: {', '.join(presets)}")
    return preset


def _load_spec(name_or_path: str, presets: Mapping[str, Any], from_dict: Any, kind: str) -> Any:
    preset = _preset(name_or_path, presets)
    if preset is not None:
        return preset
    what = f"{kind} spec file"
    if _looks_like_path(name_or_path) or usable_path(name_or_path, what).is_file():
        path = existing_file(name_or_path, what)  # the file named once: by these, by read_json, or below
        data = read_json(path)
        other = json_kind(data)
        if other is not None:  # another of eplb's files given as a spec ('missing field name' told nothing)
            raise EplbError(f"{path}: {other[1]}, not a {kind} spec: give a preset ({', '.join(presets)}) or a JSON "
                            f"file of the {kind} spec's fields (docs/cost-model.md)")
        try:
            return from_dict(data)
        except EplbError as exc:
            raise EplbError(f"{path}: {exc}") from None
    raise EplbError(
        f"unknown {kind} {shown(name_or_path)}: give a preset ({', '.join(presets)}) "
        f"or a path to a JSON file with the {kind} spec's fields"
    )


def load_model(name_or_path: str) -> ModelSpec:
    """A model preset by name (case-insensitive), or a ModelSpec read from a JSON file."""
    spec: ModelSpec = _load_spec(name_or_path, MODEL_PRESETS, model_from_dict, "model")
    return spec


def named_model(name: str, source: str) -> ModelSpec:
    """The preset a file's metadata names as its model (case-insensitive; `source` is the file); EplbError naming
    the model, the presets and the --model override when there is no such preset (rather than guessing one)."""
    preset = model_preset(name)
    if preset is not None:
        return preset
    raise EplbError(f"{source}: names model {shown(name)}, which is no preset ({', '.join(MODEL_PRESETS)}); give "
                    "--model NAME or FILE (a preset, or a JSON file with the model spec's fields)")


def load_hardware(name_or_path: str) -> HardwareSpec:
    """A hardware preset by name (case-insensitive), or a HardwareSpec read from a JSON file."""
    spec: HardwareSpec = _load_spec(name_or_path, HARDWARE_PRESETS, hardware_from_dict, "hardware")
    return spec


PCIE_BANDWIDTH = 64e9
"""B/s per direction of a PCIe Gen5 x16 link (32 GT/s x 16 lanes, 128b/130b): the path weights take
between GPUs without NVLink, or through host memory."""
LINK_GBPS = (1e-3, 1e6)
"""Plausible link bandwidths, GB/s per GPU and direction (1 MB/s .. 1 PB/s): a link given as a number outside is
refused (`link_bandwidth`: the CLI's flags, the service's `link`, a deployment's alike)."""


def implausible_link(gbps: float) -> str | None:
    """What is wrong with a link of `gbps` GB/s per GPU and direction (outside `LINK_GBPS`), or None."""
    lo, hi = LINK_GBPS
    if lo <= gbps <= hi:
        return None
    return f"{gbps:g} GB/s is not a link bandwidth (give {lo:g} to {hi:,.0f} GB/s per GPU and direction)"


def all_to_all_links(hw: HardwareSpec, link: str | float) -> tuple[float, float | None]:
    """(B/s within a node, B/s between nodes or None) of an all-to-all `link`: one link ("nvlink", "nic",
    "pcie", GB/s: every copy crosses it), or two joined by "+" ("nvlink+nic": DeepEP's dispatch, copies within
    a node over the first, between nodes over the second; docs/cost-model.md)."""
    if isinstance(link, str) and "+" in link:
        parts = link.split("+")
        if len(parts) != 2 or not all(part.strip() for part in parts):
            raise EplbError(f"link {shown(link)}: give one link, or two joined by '+' (within a node + between nodes), "
                            "e.g. nvlink+nic")
        return link_bandwidth(hw, parts[0]), link_bandwidth(hw, parts[1])
    return link_bandwidth(hw, link), None


def link_bandwidth(hw: HardwareSpec, link: str | float) -> float:
    """Per-GPU, one-direction bandwidth of the all-to-all link, in B/s.

    `link` is "nvlink", "nic", "pcie" (PCIe Gen5 x16, `PCIE_BANDWIDTH`), or a number of GB/s (decimal:
    100 means 100e9 B/s), within `LINK_GBPS`.
    """
    if isinstance(link, str):
        key = link.strip().lower()
        if key == "nvlink":
            return hw.nvlink_bandwidth
        if key == "nic":
            return hw.nic_bandwidth
        if key == "pcie":
            return PCIE_BANDWIDTH
        if "+" in key:
            raise EplbError(f"link {shown(link)} is two links (within + between nodes), which only a cluster of nodes "
                            "takes (eplb solve, evaluate and replay with --gpus-per-node; the service's "
                            "cluster.gpus_per_node): give one link here")
        try:
            gbps = float(key)
        except ValueError:
            raise EplbError(
                f"link must be 'nvlink', 'nic', 'pcie' or a bandwidth in GB/s per GPU and direction, got {shown(link)}"
            ) from None
    elif isinstance(link, bool) or not isinstance(link, int | float):
        raise EplbError(f"link must be 'nvlink', 'nic', 'pcie' or a number of GB/s, got {shown(link)}")
    else:
        gbps = float(link)
    if not math.isfinite(gbps) or gbps <= 0:
        raise EplbError(f"link bandwidth must be a positive number of GB/s, got {link!r}")
    wrong = implausible_link(gbps)
    if wrong is not None:
        raise EplbError(wrong)
    return gbps * 1e9
