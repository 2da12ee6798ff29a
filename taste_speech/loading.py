"""Reading TASTE checkpoints safely: where the weights are, what they hold, and how they are named.

Used by ``TasteForCausalLM.from_pretrained`` (which then fills the model) and by
``python -m taste_speech.check`` (which only compares). Nothing here unpickles arbitrary objects:
safetensors files are parsed from their JSON header, ``.bin``/``.pth`` files go through
``torch.load(weights_only=True)`` and must hold a flat ``name -> tensor`` dict.

Key spellings (spec §10.2). The spoken LM is a peft-wrapped Llama; depending on the peft version
and save path its weights appear as

* peft >= 0.7 (ours, canonical): ``…q_proj.base_layer.weight`` + ``…q_proj.lora_A.default.weight``;
* peft < 0.7: the base weight at ``…q_proj.weight`` beside the adapters (adapters possibly
  without the ``.default`` segment);
* merged (``merge_and_unload``): ``spoken_lm.language_model.model.layers…`` with no adapters.

``canonical_key`` maps each of them onto the module path of the model being loaded.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
from dataclasses import dataclass, field

import torch

LORA_PREFIX = "spoken_lm.language_model.base_model.model."
MERGED_PREFIX = "spoken_lm.language_model."
LM_HEAD_KEY = LORA_PREFIX + "lm_head.weight"
EMBED_KEY = LORA_PREFIX + "model.embed_tokens.weight"
_ADAPTED = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
SAFE_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_SHARD = re.compile(r"pytorch_model-\d{5}-of-\d{5}\.bin")

# safetensors dtype names -> torch dtypes (the ones a TASTE checkpoint can contain).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
TRAINING_ONLY_FILE = "cosyvoice/speech_tokenizer_v1.onnx"


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not match the architecture; the message says which file
    or which tensors, and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    """What a weight file says about one tensor, read without loading its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str


# -- locating ------------------------------------------------------------------------------------
def check_checkpoint_name(name_or_path) -> None:
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"pass a checkpoint folder or hub id (owner/name), got {name_or_path!r}; "
                         "taste_speech.tiny.default_tiny_checkpoint() is the folder of the embedded tiny one")


def resolve_checkpoint_dir(name_or_path, revision: str | None = None, cache_dir: str | None = None,
                           token=None, local_files_only: bool | None = None, force_download: bool = False,
                           proxies: dict | None = None) -> str:
    """A local directory as is; otherwise a hub id (``owner/name``), fetched with huggingface_hub
    (taken from the local cache when ``HF_HUB_OFFLINE=1`` or ``local_files_only``). Either way the
    directory must hold ``config.json`` and model weights."""
    check_checkpoint_name(name_or_path)
    path = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isdir(path):
        require_checkpoint_files(path)
        return path
    if os.path.exists(path):
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory that holds config.json")
    if not looks_like_hub_id(name_or_path):
        raise FileNotFoundError(f"{name_or_path!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        # the S3 speech tokenizer is only used in training (about 0.5 GB): not fetched
        directory = snapshot_download(repo_id=str(name_or_path), revision=revision, cache_dir=cache_dir, token=token,
                                      local_files_only=bool(local_files_only), force_download=force_download,
                                      proxies=proxies, ignore_patterns=[TRAINING_ONLY_FILE])
    except Exception as exc:  # offline, unknown repo, no access
        raise CheckpointError(
            f"there is no local directory {name_or_path!r}, and fetching it as a Hugging Face hub id failed "
            f"({type(exc).__name__}: {exc}). For the hub model, download it first "
            f"(hf download {name_or_path} --local-dir DIR) and pass DIR; for a local folder, check the path."
        ) from exc
    try:
        require_checkpoint_files(directory)
    except CheckpointError as exc:  # e.g. only the processor's files were fetched before, now offline
        raise CheckpointError(f"the cached copy of {name_or_path} is incomplete: {exc} (run `hf download "
                              f"{name_or_path}`, or unset HF_HUB_OFFLINE to let it download)") from None
    return directory


def looks_like_hub_id(name) -> bool:
    """``owner/name`` as the hub spells it. Anything else that is not an existing folder (absolute,
    ``./``, ``../``, ``~``, deeper paths) is a mistyped local path, never sent to the hub."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(name)) is not None


def require_checkpoint_files(directory: str) -> None:
    """A checkpoint folder holds config.json and weights; an interrupted download often does not."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise CheckpointError(f"{directory} has no config.json: it is not a TASTE checkpoint folder, or its "
                              "download was interrupted - download it again")
    weight_files(directory)


def weight_files(directory: str) -> list[str]:
    """The weight files of a checkpoint directory: the shards named by an index, or one file;
    safetensors before ``.bin``, as transformers reads them."""
    if os.path.exists(os.path.join(directory, SAFE_INDEX)) and os.path.exists(os.path.join(directory, SAFE_SINGLE)):
        raise CheckpointError(f"{directory} holds both {SAFE_SINGLE} and a shard index ({SAFE_INDEX}): one of "
                              "them is left over from an older save; delete the older one")
    for index_name, single in ((SAFE_INDEX, SAFE_SINGLE), (BIN_INDEX, BIN_SINGLE)):
        if os.path.isfile(os.path.join(directory, single)):
            return [os.path.join(directory, single)]
        index = os.path.join(directory, index_name)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a valid shard index (needs a 'weight_map'): {exc}") from exc
            paths = [os.path.join(directory, s) for s in shards]
            absent = [p for p in paths if not os.path.isfile(p)]
            if absent:
                raise CheckpointError(f"{index} names shard(s) that are not there: {', '.join(absent)}; "
                                      "download the missing files")
            return paths
    raise CheckpointError(
        f"no model weights in {directory}: expected model.safetensors, sharded model-*.safetensors with "
        f"{SAFE_INDEX}, or pytorch_model.bin"
    )


# -- headers (no tensor data) ----------------------------------------------------------------------
def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Shapes and dtypes from a safetensors header; also checks that the file is long enough for
    every tensor the header announces (a truncated download fails here, by name)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"cannot read {path}: not a safetensors file (only {size} bytes); download it again")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"cannot read {path}: truncated or not a safetensors file (header of {header_len} "
                                  f"bytes in a {size}-byte file); download it again")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise CheckpointError(f"cannot read {path}: corrupt safetensors header ({exc}); download it again") from exc
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable header entry for {name!r} ({exc})") from exc
        if end > data_size:
            raise CheckpointError(f"cannot read {path}: the file is truncated (tensor {name} ends at byte {end} of the "
                                  f"data section, the file holds {data_size} data bytes); download it again")
        infos[name] = TensorInfo(shape, dtype, path)
    return infos


def load_pickled_state_dict(path: str, mmap: bool = False) -> dict[str, torch.Tensor]:
    """A ``.bin``/``.pth`` state dict through ``torch.load(weights_only=True)``: only tensors and
    plain containers are accepted, never arbitrary objects. ``mmap=True`` maps the data lazily."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head.startswith(b"\x80")):  # a zip archive, or a legacy pickle
        raise CheckpointError(f"{path} is not a torch checkpoint (it starts with {head!r}: an error page or an "
                              "interrupted download?); download it again")
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as exc:  # legacy (non-zip) files cannot be memory-mapped
            if not mmap or "mmap" not in str(exc):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # (torch's own text suggests weights_only=False - running the file's code: not quoted)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path} is not a plain tensor state dict: it holds objects other than tensors{what}, which are never "
            "unpickled here. Re-save it with torch.save(model.state_dict(), path) or convert it to safetensors."
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path} as a torch checkpoint ({str(exc).splitlines()[0]}); the file is "
                              "truncated or not a torch.save archive - download it again") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} is not a plain tensor state dict: it holds a {type(obj).__name__}")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        shown = ", ".join(f"{k!r} ({type(obj[k]).__name__})" for k in bad[:5])
        raise CheckpointError(f"{path} is not a plain tensor state dict (name -> tensor); {len(bad)} entries are not "
                              f"tensors: "
                              f"{shown}")
    return obj


class CheckpointReader:
    """All tensors of a checkpoint directory: headers first (``infos``), data on demand (``get``)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.files = weight_files(directory)
        self.infos: dict[str, TensorInfo] = {}
        self._pickled: dict[str, dict[str, torch.Tensor]] = {}
        for path in self.files:
            if path.endswith(".safetensors"):
                file_infos = read_safetensors_header(path)
            else:
                state = load_pickled_state_dict(path, mmap=True)
                self._pickled[path] = state
                file_infos = {k: TensorInfo(tuple(v.shape), v.dtype, path) for k, v in state.items()}
            duplicated = sorted(set(file_infos) & set(self.infos))
            if duplicated:
                raise CheckpointError(f"tensor(s) stored twice (in {path} and another shard): {', '.join(duplicated)}")
            self.infos.update(file_infos)

    def get(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        if info.file in self._pickled:
            return self._pickled[info.file][name]
        from safetensors import safe_open

        try:
            with safe_open(info.file, framework="pt") as f:
                return f.get_tensor(name)
        except Exception as exc:  # corrupt data section
            raise CheckpointError(f"cannot read tensor {name} from {info.file} ({exc}); download the file again") from exc

    def iter_tensors(self, names):
        """Yield (name, tensor) for ``names``, opening each safetensors file once."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.infos[name].file, []).append(name)
        for path, file_names in by_file.items():
            if path in self._pickled:
                for name in file_names:
                    yield name, self._pickled[path][name]
                continue
            try:
                with safe_open(path, framework="pt") as f:
                    for name in file_names:
                        yield name, f.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"cannot read {path} ({exc}); download the file again") from exc


# -- names -----------------------------------------------------------------------------------------
def canonical_key(key: str, lora_model: bool) -> str:
    """The module path a stored key fills in a model with (``lora_model``) or without peft LoRA."""
    if lora_model:
        if key.startswith(MERGED_PREFIX) and not key.startswith(MERGED_PREFIX + "base_model."):
            key = LORA_PREFIX + key[len(MERGED_PREFIX):]  # merged spelling
        if key.startswith(LORA_PREFIX + "model.layers."):
            key = re.sub(rf"\.{_ADAPTED}\.weight$", r".\1.base_layer.weight", key)  # old peft base weight
            key = re.sub(r"\.lora_([AB])\.weight$", r".lora_\1.default.weight", key)  # adapters without name
    elif key.startswith(LORA_PREFIX):
        key = MERGED_PREFIX + key[len(LORA_PREFIX):]
        key = key.replace(".base_layer.weight", ".weight")
    return key


@dataclass
class KeyMatch:
    """How a checkpoint's tensors line up with a model's state dict."""

    sources: dict[str, str]  # model key -> stored key
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "key: checkpoint (..) != model (..)"
    tied_lm_head: bool = False  # lm_head absent, to be tied to embed_tokens
    merged_lora: bool = False  # no adapters stored (merged weights): adapters are set to zero
    spelling: str = "canonical"

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self, source: str) -> str:
        lines = [f"{source} does not match the TASTE architecture of its config:"]
        for title, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("mis-shaped", self.mismatched)):
            if items:
                lines.append(f"  {len(items)} {title} tensor(s):")
                lines.extend(f"    {k}" for k in items)
        lines.extend(f"  hint: {h}" for h in _hints(self))
        lines.append("Run `python -m taste_speech.check DIR` for a full report; load with strict=False to ignore.")
        return "\n".join(lines)


def _hints(match: KeyMatch) -> list[str]:
    hints = []
    if any(k.startswith("spoken_lm.extract_for_bridge_out_llm.linear.") for k in match.unexpected):
        hints.append("the checkpoint has a 'weighted_layer' TASTE head; the config asks for "
                     "out_llm_module 'continue_latent_linear_last' (the published model)")
    if any(".base_layer." in k for k in match.missing) and not any(".base_layer." in k for k in match.sources):
        hints.append("no Llama base weights: this looks like an adapter-only peft save, which holds no backbone")
    if match.mismatched:
        hints.append("mis-shaped tensors usually mean config.json does not describe these weights (sizes of a "
                     "different model, or the whisper_joint folder next to config.json is missing)")
    return hints


def match_keys(stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> KeyMatch:
    """Map stored names (any §10.2 spelling) onto the expected state-dict keys and compare shapes.

    Allowed gaps: a missing ``lm_head.weight`` (tied to the embedding) and, when no adapter is
    stored at all, every LoRA adapter (a merged checkpoint)."""
    lora_model = any(".lora_A." in k for k in expected)
    sources: dict[str, str] = {}
    unexpected: list[str] = []
    spellings = set()
    for key in stored:
        target = canonical_key(key, lora_model)
        if target != key:
            spellings.add("merged" if ".lora_" not in key and "base_model" not in key else "old peft")
        if target in sources:
            raise CheckpointError(f"two stored tensors fill {target}: {sources[target]} and {key}")
        if target in expected:
            sources[target] = key
        else:
            unexpected.append(key)
    match = KeyMatch(sources=sources, unexpected=sorted(unexpected))
    has_adapters = any(".lora_" in k for k in stored)
    # merged weights carry no adapters and no peft wrapper prefix; a base stored in peft's unmerged
    # spelling (".base_layer.", or the old peft's plain weight under the wrapper prefix) without
    # them lost its adapters: those are reported missing, not set to zero
    unmerged_base = any(".base_layer." in k or k.startswith(LORA_PREFIX + "model.layers.") for k in stored)
    match.merged_lora = lora_model and not has_adapters and not unmerged_base
    if spellings:
        match.spelling = " + ".join(sorted(spellings))
    for key, shape in expected.items():
        if key in sources:
            got = tuple(stored[sources[key]])
            if got != tuple(shape):
                match.mismatched.append(f"{key}: checkpoint {got} != model {tuple(shape)}")
        elif key == LM_HEAD_KEY or (key == canonical_key(LM_HEAD_KEY, lora_model) and not lora_model):
            match.tied_lm_head = True
        elif match.merged_lora and ".lora_" in key:
            continue
        else:
            match.missing.append(key)
    match.mismatched.sort()
    return match


# -- writing ---------------------------------------------------------------------------------------
def write_safetensors_checkpoint(state: dict[str, torch.Tensor], directory: str,
                                 max_shard_size: int | None = None) -> list[str]:
    """Write ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards of at most
    ``max_shard_size`` bytes (a larger single tensor gets its own shard) plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}

    def save(tensors, name):
        # Through a temporary file: a model still memory-mapping an older file keeps its data.
        path = os.path.join(directory, name)
        try:
            save_file(tensors, path + ".partial", metadata={"format": "pt"})
        except BaseException:  # e.g. the disk is full: no half-written file is left behind
            if os.path.exists(path + ".partial"):
                os.remove(path + ".partial")
            raise
        os.replace(path + ".partial", path)
        return path

    if max_shard_size is None:
        written = [save(state, SAFE_SINGLE)]
        _remove_other_weight_files(directory, [SAFE_SINGLE])
        return written
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save(shard, name)
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = os.path.join(directory, SAFE_INDEX)
    with open(index + ".partial", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    os.replace(index + ".partial", index)
    _remove_other_weight_files(directory, names + [SAFE_INDEX])
    return [os.path.join(directory, n) for n in names]


def _remove_other_weight_files(directory: str, keep: list[str]) -> None:
    """An earlier save's weight files would be read instead of (or beside) this one's. Removed only
    once the new files are all in place, so a save that fails leaves the old checkpoint whole."""
    for name in os.listdir(directory):
        if name not in keep and (name in (SAFE_SINGLE, SAFE_INDEX, BIN_SINGLE, BIN_INDEX)
                                 or SAFE_SHARD.fullmatch(name) or BIN_SHARD.fullmatch(name)):
            os.remove(os.path.join(directory, name))
