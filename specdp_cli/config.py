"""The configuration: a pydantic schema, YAML/TOML loading and `--set a.b=value` overrides.

Paths written in a config file are relative to that file; paths given with `--set` are relative to
the current directory. Every problem is raised as a `ConfigError` whose lines name the field path
and what is allowed, so the CLI can print them without a traceback.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .methods import METHODS
from .request_params import ParamError, SamplingParams, check_sampling

PATH_FIELDS = (("model",), ("tokenizer",), ("chat_template",), ("speculative", "model"))


class ConfigError(Exception):
    """A configuration the schema refuses; `.problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


class UsageError(Exception):
    """A malformed command line (bad --set, unreadable file): exit status 2."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SpeculativeConfig(_Strict):
    method: str = "draft_model"                  # one of methods.METHODS
    model: Optional[str] = None
    num_speculative_tokens: int = Field(4, ge=1, le=64)
    max_model_len: Optional[int] = Field(None, ge=2)
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    policy: Literal["auto", "skip", "dummy"] = "auto"
    # vLLM's form: [start, end, k] over the number of running sequences (inclusive); a batch size no range
    # covers uses num_speculative_tokens. In lockstep the ranges apply to the largest batch of the ranks.
    num_speculative_tokens_per_batch_size: Optional[list[list[int]]] = None
    adaptive: bool = False                       # choose k (0..num_speculative_tokens) every step from measurements
    quantization: Optional[Literal["fp8"]] = None   # the draft model's weights quantized at load (as `quantization`)
    # vLLM's name: 1 = the drafter replicated on every process of a DP rank's TP group, or tensor_parallel_size =
    # split over it as the target is; unset: the method's own (replicated; mtp: split). Checked by preflight.
    draft_tensor_parallel_size: Optional[int] = Field(None, ge=1)

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        if v not in METHODS:
            raise ValueError(f"unknown method {v!r}: choose one of {', '.join(METHODS)}")
        return v

    @model_validator(mode="after")
    def _lookup_range(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens_per_batch_size is not None:
            if self.adaptive:
                raise ValueError("set either num_speculative_tokens_per_batch_size (a fixed schedule) or adaptive: "
                                 "true (k chosen from measurements), not both")
            _check_ranges(self.num_speculative_tokens_per_batch_size, self.num_speculative_tokens)
        return self


def _check_ranges(ranges: list[list[int]], k_max: int) -> None:
    """[start, end, k] ranges: 1 <= start <= end, 0 <= k <= num_speculative_tokens, no overlaps."""
    for r in ranges:
        if len(r) != 3:
            raise ValueError(f"num_speculative_tokens_per_batch_size: each entry is [start, end, k] "
                             f"(batch sizes start..end, inclusive, draft k tokens); got {r}")
        start, end, k = r
        if not 1 <= start <= end:
            raise ValueError(f"num_speculative_tokens_per_batch_size: range {r} needs 1 <= start <= end")
        if not 0 <= k <= k_max:
            raise ValueError(f"num_speculative_tokens_per_batch_size: range {r} drafts k = {k}; k must lie in "
                             f"0..num_speculative_tokens ({k_max}): lower it or raise num_speculative_tokens")
    by_start = sorted(ranges)
    for a, b in zip(by_start, by_start[1:]):
        if b[0] <= a[1]:
            raise ValueError(f"num_speculative_tokens_per_batch_size: ranges {a} and {b} overlap (batch sizes "
                             f"{b[0]}..{min(a[1], b[1])}); each batch size may have one k")


class ParallelConfig(_Strict):
    data_parallel_size: int = 1  # checked (>= 1, multiple of num_machines) by preflight, with a sentence
    # vLLM's name: each DP rank is a group of this many processes (GPUs of one machine) holding the target's
    # attention and MLP split by heads / columns; checked by preflight (heads, GPUs, family, method)
    tensor_parallel_size: int = 1
    dp_sync: Literal["auto", "always", "never"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    num_machines: int = Field(1, ge=1)
    machine_rank: int = Field(0, ge=0)
    main_process_ip: str = "127.0.0.1"
    main_process_port: Optional[int] = Field(None, ge=1, le=65535)
    collective_timeout_s: float = Field(120.0, gt=0)
    check_collectives: bool = False
    enable_expert_parallel: bool = False      # vLLM's name: split a MoE target's experts over the DP ranks

    @model_validator(mode="after")
    def _machines(self):
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank ({self.machine_rank}) must be below num_machines ({self.num_machines})")
        if self.num_machines > 1 and self.main_process_port is None:
            raise ValueError("main_process_port is required when num_machines > 1 "
                             "(every machine must name the same port)")
        return self


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    # schedule step N + 1 while the device runs step N (vLLM's name); None: on with a GPU, method none and tp 1
    async_scheduling: Optional[bool] = None


class CacheConfig(_Strict):
    block_size: int = Field(16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    num_blocks: Optional[int] = Field(None, ge=1)   # default: sized from GPU memory (CUDA) or max_num_seqs (CPU)
    enable_prefix_caching: bool = True      # full KV blocks shared between sequences with the same prefix (lossless)


class SamplingConfig(_Strict):
    """Defaults for requests that do not say (request_params.py defines the fields, their defaults and bounds)."""
    max_tokens: int = SamplingParams.max_tokens
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k

    @model_validator(mode="after")
    def _bounds(self):
        try:
            check_sampling(self.model_dump(), {})
        except ParamError as e:
            raise ValueError(str(e)) from None
        return self


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model_name: Optional[str] = None
    api_key: Optional[str] = None
    max_queue: int = Field(256, ge=1)
    # HTTP frontend processes (vLLM's --api-server-count): each serves a share of the connections, all of them
    # every rank; one process's Python caps what a small model's ranks can be sent
    api_server_count: int = Field(1, ge=1, le=64)
    # each API server's event loop: uvloop where installed (auto), as vLLM and SGLang run theirs (server/event_loop.py)
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"


class Config(_Strict):
    model: str
    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int = Field(4096, ge=2)
    seed: int = 0
    enforce_eager: bool = False        # no CUDA graphs (CPU always runs eagerly)
    # fp8: the target's linear layers quantized at load to 128 x 128 block FP8 (vLLM's --quantization fp8)
    quantization: Optional[Literal["fp8"]] = None
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="after")
    def _api_servers_one_machine(self):
        if self.server.api_server_count > 1 and self.parallel.num_machines > 1:
            raise ValueError("server.api_server_count > 1 needs num_machines 1 (the ranks of other machines reach "
                             "one frontend); set server.api_server_count: 1")
        return self

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model


# ---------------------------------------------------------------------------------------------
# loading

def read_config_file(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {p}")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix.lower() == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parser error is the user's file
        raise ConfigError([f"{p}: cannot parse: {e}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{p}: the top level must be a mapping of keys to values"])
    _resolve_paths(data, p.resolve().parent)
    return data


def parse_set(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value), the value parsed as a YAML scalar."""
    key, sep, raw = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not key.strip() or any(not k for k in keys):
        raise UsageError(f"--set expects KEY=VALUE with a dotted key, e.g. --set parallel.data_parallel_size=2; got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str], base_dir: Path | None = None) -> dict:
    base_dir = base_dir or Path.cwd()
    for item in overrides:
        keys, value = parse_set(item)
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
        if tuple(keys) in PATH_FIELDS:
            _resolve_paths(data, base_dir, only=tuple(keys))
    return data


def _looks_like_template(value: str) -> bool:
    return "{{" in value or "{%" in value


def _resolve_paths(data: dict, base: Path, only: tuple[str, ...] | None = None) -> None:
    for keys in PATH_FIELDS:
        if only is not None and keys != only:
            continue
        node = data
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        value = node.get(keys[-1])
        if not isinstance(value, str) or not value:
            continue
        if keys == ("chat_template",) and _looks_like_template(value):
            continue
        node[keys[-1]] = str((base / os.path.expanduser(value)).resolve())


def validate(data: dict) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err) for err in e.errors()]) from None


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> Config:
    data = read_config_file(path)
    apply_overrides(data, overrides or [])
    return validate(data)


def _describe(err: dict) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ())) or "(top level)"
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        parent = _model_at(err["loc"][:-1])
        allowed = ", ".join(parent.model_fields) if parent else ""
        return f"{loc}: unknown key (allowed here: {allowed})"
    if kind == "missing":
        return f"{loc}: required, but not given"
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    given = err.get("input")
    if kind not in ("model_type",) and not isinstance(given, (dict, list)):
        return f"{loc}: {msg} (got {given!r})"
    return f"{loc}: {msg}"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return None
        model = field.annotation
    return model
